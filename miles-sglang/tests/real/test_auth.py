"""Real SGLang on another host refuses requests without the run's key (issue 46, across hosts).

Two namespace hosts (:class:`~miles.testing.hosts.NamespaceHosts`: each its own network stack, joined by a
bridge, as separate machines are): SGLang 0.5.23, started as ``miles train`` starts it
(``python -m miles_sglang.serve``, the keys in its environment), listens on host b's address. From host a,
every route of its OpenAPI document but its probes answers 401 without a key and with a wrong one; each level's
key is refused on the other level's routes; with the keys, Miles' engine client generates and flushes through
that address. No key shows on a command line of the server's processes or in its log (SGLang logs its
arguments at start: redacted).
"""

from __future__ import annotations

import json
import os
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from miles.auth import ServiceKeys
from miles.testing.hosts import NamespaceHosts, unavailable_reason

from .conftest import MAX_TOTAL_TOKENS, SERVED_DTYPE, STARTUP_TIMEOUT, TinyModels

KEYS = ServiceKeys("cross-host-api-key-0c5d1e", "cross-host-admin-key-7f3a22")
PORT = 30000
PROBES = ("/health", "/ready", "/metrics")

CHECK = textwrap.dedent(
    """
    import asyncio, json, sys, time, httpx
    base, api_key, admin_key, probes, timeout = json.loads(sys.argv[1])
    API = {"Authorization": "Bearer " + api_key}
    ADMIN = {"Authorization": "Bearer " + admin_key}
    WRONG = {"Authorization": "Bearer not-the-key"}
    client = httpx.Client(timeout=120, trust_env=False)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if client.get(base + "/health_generate", headers=API).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("SGLang on " + base + " did not answer in time")
        time.sleep(1.0)

    def code(method, path, headers):
        url = base + path.replace("{", "").replace("}", "")
        return client.request(method, url, headers=headers, json={} if method != "GET" else None).status_code

    doc = client.get(base + "/openapi.json", headers=API).json()
    routes = [(m.upper(), p) for p, ops in doc["paths"].items() for m in ops if m.upper() != "OPTIONS"]
    report = {"routes": len(routes), "refused": {}, "levels": {}, "open": {}}
    for method, path in routes:
        if not path.startswith(tuple(probes)):
            report["refused"][method + " " + path] = [code(method, path, {}), code(method, path, WRONG)]
    report["levels"]["admin key on /generate"] = code("POST", "/generate", ADMIN)
    for path in ("/update_weights_from_disk", "/pause_generation", "/flush_cache"):
        report["levels"]["api key on " + path] = code("POST", path, API)
    report["open"]["/health"] = client.get(base + "/health").status_code

    from miles.rollout.http_client import HttpEngineClient
    from miles.rollout.protocol import SamplingParams

    async def with_keys():
        async with HttpEngineClient([base], api_key=api_key, admin_api_key=admin_key) as engine:
            (out,) = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=3, temperature=0.0))
            await engine.flush_cache()
            return len(out.output_ids)

    report["generated"] = asyncio.run(with_keys())
    print(json.dumps(report))
    """
)


@pytest.fixture(scope="module")
def hosts() -> Iterator[NamespaceHosts]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with NamespaceHosts(2) as hosts:
        yield hosts


@pytest.fixture(scope="module")
def report(hosts: NamespaceHosts, tiny_llamas: TinyModels) -> dict[str, Any]:
    from miles_sglang.engine import SGLangEngine
    from miles_sglang.settings import SGLangEngineSettings

    a, b = hosts[0], hosts[1]
    launch = SGLangEngine(SGLangEngineSettings(max_total_tokens=MAX_TOTAL_TOKENS, log_level="info")).launch(
        model_path=str(tiny_llamas.first), host=b.address, port=PORT, device="cpu", dtype=SERVED_DTYPE,
        devices=[], seed=1234,
    )  # fmt: skip
    log = hosts.temp_dir / "sglang-b.log"
    with log.open("w") as out:
        b.popen(launch.argv, env={**os.environ, **launch.env, **KEYS.env()}, stdout=out, stderr=out)
    args = json.dumps([launch.url, KEYS.api_key, KEYS.admin_api_key, list(PROBES), STARTUP_TIMEOUT])
    done = a.python(CHECK, args, timeout=STARTUP_TIMEOUT + 300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:] + log.read_text()[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["log"] = log.read_text(errors="replace")
    result["cmdlines"] = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace") for pid in b.pids()}
    return result


def test_every_route_refuses_another_host_without_its_key(report: dict[str, Any]) -> None:
    refused = report["refused"]
    assert report["routes"] > 50 and {"POST /generate", "POST /update_weights_from_disk"} <= set(refused)
    wrong = {route: codes for route, codes in refused.items() if codes != [401, 401]}
    assert not wrong, wrong
    assert set(report["levels"].values()) == {401}, report["levels"]  # each level's key: its own routes only
    assert report["open"] == {"/health": 200}  # the liveness probe, which says nothing


def test_with_the_keys_the_engine_client_generates_from_another_host(report: dict[str, Any]) -> None:
    assert report["generated"] == 3


def test_no_key_on_a_command_line_or_in_the_log(report: dict[str, Any]) -> None:
    assert report["cmdlines"]  # the server, its scheduler and detokenizer
    for pid, cmdline in report["cmdlines"].items():
        assert not any(k in cmdline for k in KEYS.secrets()), (pid, cmdline)
    assert "server_args=" in report["log"] and "<redacted>" in report["log"], report["log"][-3000:]
    assert not any(k in report["log"] for k in KEYS.secrets())
