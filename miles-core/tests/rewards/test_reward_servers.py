"""A reward server that dies while the run goes on is started again, same command and address, by the
launcher's tick, as often as it has restarts; then it is left gone. Real processes (a stdlib HTTP server
stands in for the model server: what is tested is the supervision), a real local launcher."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from miles.auth import ServiceKeys
from miles.host.reward_servers import RewardServers, _Started
from miles.launch.base import ProcessSpec
from miles.launch.local import LocalLauncher
from miles.net import free_port


def _pid(process: object) -> int:
    return int(process.pid)  # type: ignore[attr-defined]


def _tick_until(servers: RewardServers, launcher: LocalLauncher, condition: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline
        servers.tick(launcher)
        time.sleep(0.05)


def test_a_dead_reward_server_is_restarted_then_left_gone(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    spec = ProcessSpec(name="reward-model", argv=[sys.executable, "-m", "http.server", str(port), "-b", "127.0.0.1"])
    with LocalLauncher(run_dir=str(tmp_path)) as launcher:
        first = launcher.start_process(spec)
        servers = RewardServers(ServiceKeys(None, None))
        servers.started.append(_Started("reward.functions[0]", spec.name, url, url + "/", first, 30.0, spec, 1))
        servers.wait()
        servers.tick(launcher)  # (alive: nothing happens)
        assert servers.started[0].process is first and servers.restarted == 0

        os.kill(_pid(first), signal.SIGKILL)  # (a process this test's launcher started)
        _tick_until(servers, launcher, lambda: servers.restarted == 1)
        second = servers.started[0].process
        assert second is not first and first.exit_status() == -signal.SIGKILL
        servers.wait()  # the same address answers again
        assert "starting it again at " + url in caplog.text

        os.kill(_pid(second), signal.SIGKILL)
        _tick_until(servers, launcher, lambda: servers.started[0].gone)
        assert servers.restarted == 1 and servers.started[0].process is second
        assert "with no restart left" in caplog.text
