"""A real HTTP reward server on 127.0.0.1 (stdlib ``http.server`` in a thread, port from the OS)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest


class RewardServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.hits: dict[str, int] = {}
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def handle_error(self, request: Any, client_address: Any) -> None:
        import sys

        # a client that timed out closes the socket before /slow answers: expected, not an error
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: RewardServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, code: int, body: str, content_type: str = "application/json") -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            count = self.server.hits.get(self.path, 0) + 1
            self.server.hits[self.path] = count
            self.server.bodies.append(body)
        if self.path == "/score":
            # reward: characters of the response / 10; parts echo the label and an auth header check
            auth = 1.0 if self.headers.get("Authorization") == "Bearer t0ken" else 0.0
            self._send(200, json.dumps({"reward": len(body["response"]) / 10, "parts": {"auth": auth}}))
        elif self.path == "/number":
            self._send(200, "0.25")
        elif self.path == "/flaky":  # 503 twice, then an answer
            if count <= 2:
                self._send(503, '{"error": "warming up"}')
            else:
                self._send(200, '{"reward": 1.0}')
        elif self.path == "/slow":
            time.sleep(3.0)
            self._send(200, '{"reward": 1.0}')
        elif self.path == "/bad_request":
            self._send(400, '{"error": "no such model"}')
        elif self.path == "/not_json":
            self._send(200, "<html>oops</html>", "text/html")
        elif self.path == "/nan":
            self._send(200, '{"reward": "high"}')
        else:
            self._send(404, "{}")


@pytest.fixture
def reward_server() -> Iterator[RewardServer]:
    server = RewardServer()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
