"""Real SGLang with the run's keys (issue 46): ``miles_sglang.serve`` hands ``--api-key`` / ``--admin-api-key`` from
the environment to SGLang 0.5.23, whose two levels then hold — every route but its probes refuses requests
without its key, with a wrong one and with the other level's — while Miles' engine client, sending each
route its key, generates and flushes. No key shows on a command line of the server's processes or in its
log (SGLang logs its arguments at start: redacted)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from miles.auth import ServiceKeys
from miles.launch.local import LocalLauncher

from .conftest import MAX_TOTAL_TOKENS, SERVED_DTYPE, STARTUP_TIMEOUT, Server, TinyModels

KEYS = ServiceKeys("sglang-api-key-4d2e9a", "sglang-admin-key-b71c05")
PROBES = ("/health", "/ready", "/metrics")
"""What SGLang 0.5.23 answers without a key (``decide_request_auth``: every path starting so)."""


@pytest.fixture(scope="module")
def keyed(tiny_llamas: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """An SGLang server started as ``miles train`` starts one, the keys in its environment only; its
    arguments logged (SGLang's ``info`` level)."""
    from miles.net import free_port
    from miles_sglang.engine import SGLangEngine
    from miles_sglang.settings import SGLangEngineSettings

    launch = SGLangEngine(SGLangEngineSettings(max_total_tokens=MAX_TOTAL_TOKENS, log_level="info")).launch(
        model_path=str(tiny_llamas.first), host="127.0.0.1", port=free_port(), device="cpu", dtype=SERVED_DTYPE,
        devices=[], seed=1234,
    )  # fmt: skip
    launch.env = {**launch.env, **KEYS.env()}
    launcher = LocalLauncher(run_dir=str(tmp_path_factory.mktemp("keyed")))
    launcher.keys = KEYS
    with launcher:
        (url,) = launcher.start_engines([launch], timeout=STARTUP_TIMEOUT)
        yield Server(url=url, launcher=launcher)


def test_every_sglang_route_refuses_a_request_without_its_key(keyed: Server) -> None:
    """Every operation of SGLang's OpenAPI document but its probes: 401 without a key and with a wrong one (a
    refused request never reaches a handler, so no route's effect is triggered); each level's key is refused
    on the other level's routes."""
    doc = httpx.get(keyed.url + "/openapi.json", headers=KEYS.headers(), timeout=60, trust_env=False).json()
    routes = [(m.upper(), p) for p, ops in doc["paths"].items() for m in ops if m.upper() != "OPTIONS"]
    assert len(routes) > 50

    def codes(method: str, path: str, *headers: dict[str, str]) -> list[int]:
        url = keyed.url + path.replace("{", "").replace("}", "")
        body = {} if method != "GET" else None
        return [
            httpx.request(method, url, headers=h, json=body, timeout=60, trust_env=False).status_code for h in headers
        ]

    refused = {}
    for method, path in routes:
        if not path.startswith(PROBES):
            refused[f"{method} {path}"] = codes(method, path, {}, {"Authorization": "Bearer not-the-key"})
    wrong = {route: c for route, c in refused.items() if c != [401, 401]}
    assert not wrong, wrong
    assert {"POST /generate", "POST /update_weights_from_disk", "POST /pause_generation"} <= set(refused)
    api, admin = KEYS.headers(), KEYS.headers(control=True)
    assert codes("POST", "/generate", admin) == [401]  # the admin key opens no generation route
    for path in ("/update_weights_from_disk", "/pause_generation", "/flush_cache", "/abort_request"):
        assert codes("POST", path, api) == [401], path  # nor the API key a control route
    assert httpx.get(keyed.url + "/health", timeout=60, trust_env=False).status_code == 200  # a probe: open


def test_the_engine_client_sends_each_route_its_key(keyed: Server) -> None:
    import asyncio

    from miles.rollout.http_client import HttpEngineClient
    from miles.rollout.protocol import SamplingParams

    async def check() -> None:
        async with HttpEngineClient([keyed.url], api_key=KEYS.api_key, admin_api_key=KEYS.admin_api_key) as client:
            (out,) = await client.generate([1, 2, 3], SamplingParams(max_new_tokens=3, temperature=0.0))
            assert len(out.output_ids) == 3
            await client.flush_cache()
            (info,) = await client.server_info()
            assert not {"api_key", "admin_api_key", "launch_command"} & set(info) and info.get("tp_size") == 1

    asyncio.run(check())


def test_no_key_on_a_command_line_or_in_the_log(keyed: Server) -> None:
    for pid in keyed.process_ids():
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        assert not any(k in cmdline for k in KEYS.secrets()), (pid, cmdline)
    log = Path(keyed.launcher.engines[0].log_path).read_text(errors="replace")
    assert "server_args=" in log and "<redacted>" in log, log[-3000:]
    assert not any(k in log for k in KEYS.secrets())
    assert os.path.getsize(keyed.launcher.engines[0].log_path) > 0
