"""No start-up races: a run whose ports are taken between choosing and binding still starts.

The race is made to happen: in the driver, every port :func:`miles.net.free_port` hands out for the engine
and the router is taken by another listening socket before the service binds it. The run must start (the
engine and the router start again on other ports, each said once in the log), train, and push; the trainer
ranks' rendezvous and the weight-update group bind their stores before telling anyone the port, so there
is no window to take."""

from __future__ import annotations

import json
import logging
import socket
import sys
from pathlib import Path

import pytest

from miles.testing.runs import write_run_config

pytestmark = pytest.mark.slow

ROUTER = """
[rollout.router]
name = "smg"
policy = "manual"
"""


def test_a_run_starts_when_its_ports_are_taken_before_the_services_bind(
    tmp_path: Path,
    tiny_model: Path,
    arithmetic_prompts: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from miles import net
    from miles.compose import build_run
    from miles.host.train import run_training
    from miles.settings.loader import load_settings

    choose = net.free_port
    squatters: dict[str, socket.socket] = {}

    def taken_at_once(host: str = "127.0.0.1", **kwargs: int) -> int:
        """The chosen port, with another socket listening on it before the caller's service can bind it: the
        first port chosen for the engine (``engine_address``) and for the router (the launcher's
        ``service_address``, through a comprehension's frame)."""
        port = choose(host, **kwargs)
        frame, caller = sys._getframe(1), ""
        while frame is not None and frame.f_code.co_name.startswith("<"):
            frame = frame.f_back
        caller = frame.f_code.co_name if frame is not None else ""
        if caller in ("engine_address", "service_address") and caller not in squatters:
            squatter = socket.socket()
            squatter.bind((host, port))
            squatter.listen()
            squatters[caller] = squatter
        return port

    monkeypatch.setattr(net, "free_port", taken_at_once)
    run_dir = tmp_path / "run"
    config = write_run_config(tmp_path, tiny_model, arithmetic_prompts, run_dir, ROUTER, ranks=2, rollouts=1)
    run = build_run(load_settings(config))
    try:
        with caplog.at_level(logging.WARNING):
            assert run_training(run) == 0
        taken = {caller: s.getsockname()[1] for caller, s in squatters.items()}
    finally:
        for squatter in squatters.values():
            squatter.close()
    assert len(taken) == 2, taken
    fleet = json.loads((run_dir / "fleet.json").read_text())
    ports = {int(url.rsplit(":", 1)[1]) for url in [*fleet["engine_urls"], fleet["router_url"]]}
    assert not ports & set(taken.values())  # both moved
    moves = [r.getMessage() for r in caplog.records if "was taken before" in r.getMessage()]
    assert len(moves) == 2, moves  # said once each
    assert moves[0].startswith("engine-0: port ") and moves[1].startswith("router: port ")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and rows[0]["weight_sync/verified"] == 1.0
