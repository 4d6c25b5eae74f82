"""``miles sessions check`` and ``miles sessions serve`` as a user runs them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from miles.net import free_port
from miles.testing.chat_templates import build_chat_tokenizer


def miles(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "miles", *args], capture_output=True, text=True, env=env, timeout=180)


def test_check_reports_the_first_offending_turn_and_accepts_a_fixed_template(tmp_path: Path) -> None:
    build_chat_tokenizer("qwen3").save_pretrained(tmp_path / "qwen3")
    out = miles("sessions", "check", "--tokenizer", str(tmp_path / "qwen3"))
    assert out.returncode == 1
    assert "is not append-only: probe 'chat', turn 2 (message 2, role assistant)" in out.stdout
    out = miles("sessions", "check", "--tokenizer", str(tmp_path / "qwen3"), "--chat-template", "qwen3")
    assert out.returncode == 0 and "the fixed template 'qwen3' is append-only" in out.stdout
    template = tmp_path / "mine.jinja"
    template.write_text(build_chat_tokenizer("qwen2.5").chat_template)
    out = miles("sessions", "check", "--tokenizer", str(tmp_path / "qwen3"), "--chat-template", str(template), "--json")
    assert out.returncode == 0 and '"ok": true' in out.stdout


def test_check_names_bad_options(tmp_path: Path) -> None:
    out = miles("sessions", "check", "--tokenizer", str(tmp_path / "missing"))
    assert out.returncode != 0 and "--tokenizer:" in out.stderr and "Traceback" not in out.stderr
    build_chat_tokenizer("qwen2.5").save_pretrained(tmp_path / "tok")
    out = miles("sessions", "check", "--tokenizer", str(tmp_path / "tok"), "--chat-template", "nope")
    assert out.returncode != 0 and "rollout.sessions.chat_template: 'nope' is neither a file" in out.stderr
    out = miles("sessions", "check", "--tokenizer", str(tmp_path / "tok"), "--chat-template-kwargs", "[1]")
    assert out.returncode != 0 and "--chat-template-kwargs: expected a JSON object" in out.stderr


@pytest.mark.slow
def test_serve_answers_chat_requests_and_stops_on_sigterm(tmp_path: Path) -> None:
    from miles.testing.engine import EngineProcess
    from miles.testing.models import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", "qwen2", seed=0)
    with EngineProcess(model, log_path=tmp_path / "engine.log") as engine:
        port = free_port()
        log = open(tmp_path / "sessions.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", "miles", "sessions", "serve", "--engine-url", engine.url, "--port", str(port), "--max-tokens", "4"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                assert proc.poll() is None, (tmp_path / "sessions.log").read_text()
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.3)
            info = httpx.get(url + "/info").json()
            assert info["append_only"]["ok"] and info["live_check"]["ok"]
            sid = httpx.post(url + "/sessions").json()["id"]
            body = {"model": "policy", "messages": [{"role": "user", "content": "Hello"}]}
            reply = httpx.post(f"{url}/sessions/{sid}/v1/chat/completions", json=body, timeout=60).json()
            assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] <= 4
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    assert "sessions on http://127.0.0.1:" in (tmp_path / "sessions.log").read_text()
