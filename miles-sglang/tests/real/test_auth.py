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
    doc = httpx.get(keyed.url + "/openapi.json", headers=KEYS.headers(), timeout=60, trust_env=False).json()
    routes = [(m.upper(), p) for p, ops in doc["paths"].items() for m in ops if m.upper() != "OPTIONS"]
    assert len(routes) > 50
    refused, open_ = {}, []
    for method, path in routes:
        url = keyed.url + path.replace("{", "").replace("}", "")
        if path.startswith(PROBES):
            open_.append(path)
            continue
        other = {"Authorization": f"Bearer {KEYS.api_key}"}, {"Authorization": f"Bearer {KEYS.admin_api_key}"}
        codes = [
            httpx.request(
                method, url, headers=h, json={} if method != "GET" else None, timeout=60, trust_env=False
            ).status_code
            for h in ({}, {"Authorization": "Bearer not-the-key"}, *other)
        ]
        refused[f"{method} {path}"] = codes
    # each route refuses no key and a wrong key; exactly one of the two keys opens it (or neither: 403 where
    # SGLang forbids a route outright) — a refused request never reaches a handler
    wrong = {r: c for r, c in refused.items() if c[:2] != [401, 401] or sorted(c[2:]).count(401) < 1}
    assert not wrong, wrong
    assert refused["POST /generate"][2] != 401 and refused["POST /generate"][3] == 401
    assert refused["POST /update_weights_from_disk"][2] == 401 and refused["POST /update_weights_from_disk"][3] != 401
    assert "/health" in open_ and "/health_generate" in open_


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
