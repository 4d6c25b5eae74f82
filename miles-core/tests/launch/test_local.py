"""The ``local`` launcher with real child processes: HTTP engines, gloo trainer ranks, failures, signals."""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles.components import ComponentKind
from miles.errors import LaunchError
from miles.launch.local import LocalLauncher, LocalLauncherSettings
from miles.launch.rendezvous import trainer_specs
from miles.net import free_port
from miles.plugins.builtin import BUILTIN_PLUGINS
from miles.plugins.manager import PluginManager
from miles.rollout.backend import EngineLaunch
from miles.settings.model import PluginSpec

Script = Callable[[str, str], list[str]]

CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as dead: it runs nothing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def wait_dead(pid: int, timeout: float = 15.0) -> bool:
    """For grandchildren (reaped by init, not by us): wait until ``pid`` is gone."""
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def http_engine(directory: Path) -> EngineLaunch:
    """A real HTTP server child standing in for an engine: ``python -m http.server`` on a free port."""
    port = free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(directory)]
    return EngineLaunch(argv=argv, url=f"http://127.0.0.1:{port}", env=CHILD_ENV, health_path="/")


def gone(pid: int) -> bool:
    """For the launcher's own children: reaped, so the pid no longer exists at all (not even a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


ALL_REDUCE = """
import json, os, sys
import torch
import torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
dist.all_reduce(t)
print(f"rank {rank}/{world} local {os.environ['LOCAL_RANK']}: {t.tolist()}", flush=True)
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as fh:
    json.dump({"rank": rank, "world": world, "sum": t.tolist()}, fh)
dist.barrier()
dist.destroy_process_group()
"""

FAIL_RANK_1 = """
import os, sys, time
if os.environ["RANK"] == "1":
    print("rank 1: simulated out-of-memory in step 3", flush=True)
    sys.exit(7)
time.sleep(120)
"""

SLEEP = "import time\ntime.sleep(120)\n"

EXIT_ON_RANK_0 = """
import os, sys, time
if os.environ["RANK"] == "0":
    sys.exit(3)
time.sleep(120)
"""

KILLED_IN_A_COLLECTIVE = """
import os, signal
import torch
import torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 1:
    print("rank 1: killed in step 3", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
dist.all_reduce(torch.ones(4))  # rank 0: "Connection closed by peer"
"""


def launcher(tmp_path: Path, **options: object) -> LocalLauncher:
    return LocalLauncher(LocalLauncherSettings(poll_interval=0.05, **options), run_dir=str(tmp_path / "run"))


def test_engine_comes_up_logs_to_run_dir_and_is_reaped(tmp_path: Path) -> None:
    launch = http_engine(tmp_path)
    with launcher(tmp_path) as lau:
        (url,) = lau.start_engines([launch], timeout=60)
        assert url == launch.url
        assert httpx.get(url + "/", trust_env=False).status_code == 200
        (engine,) = lau.engines
        assert engine.name == "engine-0" and alive(engine.pid)
        assert os.getpgid(engine.pid) == engine.pid  # its own process group (and session)
    assert gone(engine.pid) and engine.popen.returncode == -signal.SIGTERM
    assert (tmp_path / "run" / "logs" / "engine-0.log").read_text().count("GET / HTTP") >= 1
    lau.shutdown()  # idempotent
    with pytest.raises(LaunchError, match="was shut down"):
        lau.start_engines([http_engine(tmp_path)], timeout=5)


def test_engine_exiting_early_fails_fast_with_its_log_tail(tmp_path: Path) -> None:
    good = http_engine(tmp_path)
    fail = "import os, sys; print('cannot load model /nope/model on', os.environ['CUDA_VISIBLE_DEVICES']); sys.exit(3)"
    bad = EngineLaunch(argv=[sys.executable, "-c", fail], url="http://127.0.0.1:9/", env={"CUDA_VISIBLE_DEVICES": "3"})
    lau = launcher(tmp_path)
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"engine-1 exited \(exit code 3\) before answering") as info:
        lau.start_engines([good, bad], timeout=120)
    assert time.monotonic() - start < 60  # did not wait for the timeout
    assert "cannot load model /nope/model on 3" in str(info.value)  # EngineLaunch.env reached the child
    assert (info.value.process, info.value.returncode) == ("engine-1", 3)
    assert all(gone(p.pid) for p in lau.processes)  # the good engine was stopped too
    lau.shutdown()


def test_an_engine_whose_port_was_taken_starts_again_on_another(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The race of choosing a port and binding it, made to happen: another socket listens on the engine's port
    before the engine binds it. The engine fails to bind, the launcher starts it on another port (saying so
    once) and returns the URL it answers on."""

    def at(host: str, port: int) -> EngineLaunch:
        argv = [sys.executable, "-m", "http.server", str(port), "--bind", host, "--directory", str(tmp_path)]
        return EngineLaunch(argv=argv, url=f"http://{host}:{port}", env=CHILD_ENV, health_path="/", rebind=at)

    with socket.socket() as squatter, launcher(tmp_path) as lau, caplog.at_level(logging.WARNING):
        squatter.bind(("127.0.0.1", free_port()))
        squatter.listen()
        taken = squatter.getsockname()[1]
        (url,) = lau.start_engines([at("127.0.0.1", taken)], timeout=60, wait=False)
        assert url.endswith(f":{taken}")  # not final until it answers
        (final,) = lau.wait_engines(timeout=60)
        assert not final.endswith(f":{taken}") and lau.engine_urls == [final]
        assert httpx.get(final + "/", trust_env=False).status_code == 200
        assert lau.engines[0].exit_status() is None
    moves = [r.getMessage() for r in caplog.records if "was taken before the engine could bind" in r.getMessage()]
    assert moves == [f"engine-0: port {taken} was taken before the engine could bind it; starting it again on {final}"]


def test_engine_not_healthy_in_time(tmp_path: Path) -> None:
    slow = EngineLaunch(
        argv=[sys.executable, "-c", f"print('loading weights', flush=True)\n{SLEEP}"], url="http://127.0.0.1:9"
    )
    with launcher(tmp_path) as lau:
        with pytest.raises(
            LaunchError, match=r"engine-0 did not answer http://127.0.0.1:9/health with 200 within 1.5 s"
        ) as info:
            lau.start_engines([slow], timeout=1.5)
        assert "loading weights" in info.value.log_tail
        assert gone(lau.engines[0].pid)


def test_starting_engines_say_what_they_are_doing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """While an engine starts (weights, the CPU kernels' first build), the launcher says every few seconds
    what it is doing — its latest log line — and the trainer ranks may start meanwhile (``wait=False``)."""
    import logging

    port = free_port()
    slow = EngineLaunch(
        argv=[
            sys.executable,
            "-c",
            "import time, subprocess, sys\n"
            "print('building the CPU kernels (once per machine; ~40 s on 2 cores)', flush=True)\n"
            "time.sleep(2.5)\n"
            f"subprocess.run([sys.executable, '-m', 'http.server', '{port}', '--bind', '127.0.0.1'])",
        ],
        url=f"http://127.0.0.1:{port}",
        health_path="/",
    )
    settings = LocalLauncherSettings(progress_interval=0.5)
    with LocalLauncher(settings, run_dir=str(tmp_path / "run")) as lau, caplog.at_level(logging.INFO):
        (url,) = lau.start_engines([slow], timeout=60, wait=False)
        assert url == slow.url and lau.engines[0].exit_status() is None  # returned at once
        lau.wait_engines(timeout=60)
        assert httpx.get(url + "/", timeout=5).status_code == 200
    notes = [r.getMessage() for r in caplog.records if "is starting" in r.getMessage()]
    assert notes and all("building the CPU kernels" in n for n in notes), notes


def test_a_status_line_keeps_the_head_of_the_message() -> None:
    from miles.launch.local import status_of

    line = (
        "2026-12-06 01:24:07,512 INFO miles.engine.kernel_cache: building the CPU kernels in "
        "/root/.cache/miles/kernels/miles_cpu_kernels_0123456789abcdef (once per machine and source version; "
        "the last build here took 78 s) " + "x" * 80
    )
    status = status_of(line)
    assert status.startswith("building the CPU kernels in /root/.cache/miles/kernels/")
    assert len(status) == 160 and status.endswith("...")
    assert status_of("2026-12-06 01:24:07,512 rank0 INFO miles.driver.loop: step 1") == "step 1"
    assert status_of("  Loading weights  ") == "Loading weights"


def test_two_gloo_ranks_all_reduce(tmp_path: Path, script: Script) -> None:
    argv = [*script("all_reduce", ALL_REDUCE), str(tmp_path)]
    with launcher(tmp_path) as lau:
        lau.start_trainers(trainer_specs(argv, 2, env=CHILD_ENV))
        assert lau.wait_trainers(timeout=240) == 0
        assert [p.popen.returncode for p in lau.trainers] == [0, 0]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["rank"], r["world"], r["sum"]) for r in results] == [(0, 2, [3.0, 30.0]), (1, 2, [3.0, 30.0])]
    assert "rank 1/2 local 1: [3.0, 30.0]" in (tmp_path / "run" / "logs" / "trainer-1.log").read_text()


def test_failed_rank_terminates_everything_and_is_named(tmp_path: Path, script: Script) -> None:
    lau = launcher(tmp_path)
    lau.start_engines([http_engine(tmp_path)], timeout=60)
    lau.start_trainers(trainer_specs(script("fail", FAIL_RANK_1), 3, env=CHILD_ENV))
    with pytest.raises(LaunchError, match=r"trainer rank 1 \(trainer-1\) failed: exit code 7") as info:
        lau.wait_trainers(timeout=120)
    assert "simulated out-of-memory in step 3" in str(info.value)
    assert (info.value.process, info.value.returncode) == ("trainer-1", 7)
    codes = {p.name: p.popen.returncode for p in lau.processes}
    assert codes == {
        "engine-0": -signal.SIGTERM,
        "trainer-0": -signal.SIGTERM,
        "trainer-1": 7,
        "trainer-2": -signal.SIGTERM,
    }
    assert all(gone(p.pid) for p in lau.processes)


def test_the_rank_killed_is_named_not_its_peer_whose_collective_failed_with_it(tmp_path: Path, script: Script) -> None:
    # both ranks are dead when the launcher first looks (Ray, too, may report a killed actor after its peer's exit)
    lau = launcher(tmp_path)
    lau.start_trainers(trainer_specs(script("killed", KILLED_IN_A_COLLECTIVE), 2, env=CHILD_ENV))
    for trainer in lau.trainers:
        trainer.popen.wait(timeout=240)
    with pytest.raises(LaunchError) as info:
        lau.wait_trainers(timeout=120)
    said = str(info.value)
    assert said.startswith(
        "trainer rank 1 (trainer-1) failed: killed by SIGKILL; after it, trainer rank 0 (trainer-0): exit code 1;"
    ), said
    assert "killed in step 3" in said  # its log's tail, not its peer's
    assert (info.value.process, info.value.returncode) == ("trainer-1", -signal.SIGKILL)
    assert all(gone(p.pid) for p in lau.processes)


def test_a_rank_killed_soon_after_its_peers_exit_is_named(tmp_path: Path, script: Script) -> None:
    # rank 0's error exit is seen first; rank 1 is killed within failure_grace: the signal is named the cause
    lau = launcher(tmp_path, failure_grace=60.0)
    lau.start_trainers(trainer_specs(script("exit_then_killed", EXIT_ON_RANK_0), 2, env=CHILD_ENV))
    rank0, rank1 = lau.trainers
    rank0.popen.wait(timeout=60)
    killer = threading.Timer(1.0, os.kill, (rank1.pid, signal.SIGKILL))
    killer.start()
    started = time.monotonic()
    with pytest.raises(LaunchError) as info:
        lau.wait_trainers(timeout=120)
    killer.join()
    said = str(info.value)
    assert said.startswith(
        "trainer rank 1 (trainer-1) failed: killed by SIGKILL; after it, trainer rank 0 (trainer-0): exit code 3;"
    ), said
    assert time.monotonic() - started < 30  # the signal ended the wait, not the grace


def test_without_a_killed_rank_the_first_failure_is_named_after_the_grace(tmp_path: Path, script: Script) -> None:
    lau = launcher(tmp_path, failure_grace=0.5)
    lau.start_trainers(trainer_specs(script("exit_then_killed", EXIT_ON_RANK_0), 2, env=CHILD_ENV))
    with pytest.raises(LaunchError, match=r"^trainer rank 0 \(trainer-0\) failed: exit code 3; all other") as info:
        lau.wait_trainers(timeout=120)
    assert (info.value.process, info.value.returncode) == ("trainer-0", 3)
    assert lau.trainers[1].popen.returncode == -signal.SIGTERM


def test_engine_dying_while_trainers_run_stops_the_run(tmp_path: Path, script: Script) -> None:
    with launcher(tmp_path) as lau:
        lau.start_engines([http_engine(tmp_path)], timeout=60)
        lau.start_trainers(trainer_specs(script("sleep", SLEEP), 2, env=CHILD_ENV))
        os.kill(lau.engines[0].pid, signal.SIGKILL)
        with pytest.raises(LaunchError, match=r"engine-0 exited \(killed by SIGKILL\) while the trainers ran"):
            lau.wait_trainers(timeout=120)
        assert all(gone(p.pid) for p in lau.processes)


def test_a_dead_engine_is_restarted_then_left_out_then_the_run_stops_when_none_is_left(
    tmp_path: Path, script: Script, caplog: pytest.LogCaptureFixture
) -> None:
    from miles.launch.engine_restarts import EngineDeathPolicy

    caplog.set_level("ERROR", logger="miles.launch.engine_restarts")
    errors: list[BaseException] = []
    with launcher(tmp_path) as lau:
        lau.engine_deaths = EngineDeathPolicy(restarts=1)
        first = lau.engines
        urls = lau.start_engines([http_engine(tmp_path), http_engine(tmp_path)], timeout=60)
        lau.start_trainers(trainer_specs(script("sleep", SLEEP), 1, env=CHILD_ENV))
        dead = lau.engines[1]

        def kill() -> None:
            try:
                os.kill(dead.pid, signal.SIGKILL)
                # restarted with the same command: a new process answering the same URL
                deadline = time.monotonic() + 60
                while not answers(urls[1]) or lau.engines[1] is dead:
                    assert time.monotonic() < deadline, "engine-1 was not restarted"
                    time.sleep(0.1)
                again = lau.engines[1]
                os.kill(again.pid, signal.SIGKILL)  # no restart left: left out, the run goes on
                while not again.reaped:
                    time.sleep(0.05)
                time.sleep(0.3)
                assert lau.engines[0].exit_status() is None and not lau.stopping
                zero = lau.engines[0]
                os.kill(zero.pid, signal.SIGKILL)  # engine-0 has its own restart
                while lau.engines[0] is zero:
                    assert time.monotonic() < deadline + 60, "engine-0 was not restarted"
                    time.sleep(0.05)
                os.kill(lau.engines[0].pid, signal.SIGKILL)  # none left, no restart left: the run stops
            except BaseException as exc:  # the main thread asserts it
                errors.append(exc)

        def answers(url: str) -> bool:
            try:
                return httpx.get(url, timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        killer = threading.Thread(target=kill)
        killer.start()
        with pytest.raises(LaunchError) as info:
            lau.wait_trainers(timeout=60)
        killer.join()
        assert not errors, errors
        assert "engine-0 exited (killed by SIGKILL) while the trainers ran; no engine is left" in str(info.value)
        assert first is lau.engines and [p.name for p in lau.processes].count("engine-1") == 2
        assert [p.name for p in lau.processes].count("engine-0") == 2
        assert all(gone(p.pid) for p in lau.processes)
    said = caplog.text
    assert "engine-1 exited (killed by SIGKILL) while the trainers ran: restarting it (restart 1 of 1" in said
    assert "no restarts left (rollout.engine_restarts = 1): the run goes on with engine-0" in said
    assert "engine-0 exited (killed by SIGKILL) while the trainers ran: restarting it (restart 1 of 1" in said


def test_shutdown_kills_sigterm_ignorers_and_their_group(tmp_path: Path, script: Script) -> None:
    stubborn = script(
        "stubborn",
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(tmp_path / 'grandchild.pid')!r}, 'w').write(str(child.pid))\n"
        "time.sleep(120)\n",
    )
    lau = launcher(tmp_path, terminate_timeout=1.0)
    (proc,) = [lau.start_process(spec) for spec in trainer_specs(stubborn, 1, name="helper")]
    pid_file = tmp_path / "grandchild.pid"
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, proc.log_tail()
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    assert alive(grandchild) and os.getpgid(grandchild) == proc.pid
    lau.shutdown()
    assert proc.popen.returncode == -signal.SIGKILL and gone(proc.pid)
    assert wait_dead(grandchild)


DRIVER = """
import json, logging, sys, time
from miles.launch.local import LocalLauncher, LocalLauncherSettings
from miles.launch.rendezvous import trainer_specs
from miles.net import free_port
from miles.rollout.backend import EngineLaunch
logging.basicConfig(level=logging.INFO)
out, engine_argv, url, sleeper = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
with LocalLauncher(LocalLauncherSettings(poll_interval=0.05), run_dir=out) as launcher:
    launcher.start_engines([EngineLaunch(argv=engine_argv, url=url, health_path="/")], timeout=60)
    launcher.start_trainers(trainer_specs(sleeper, 2))
    with open(out + "/pids.json", "w") as fh:
        json.dump([p.pid for p in launcher.processes], fh)
    launcher.wait_trainers()
"""


def terminal_signals() -> None:
    """In a child before exec: the signal dispositions of a terminal session, whatever the test runner
    inherited (a shell's background job ignores SIGINT, ``nohup`` ignores SIGHUP)."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def start_driver(tmp_path: Path, script: Script, **popen: Any) -> tuple[subprocess.Popen[bytes], list[int]]:
    """Run DRIVER in a subprocess; return it and the pids of its engine and two trainer ranks, all up."""
    popen.setdefault("preexec_fn", terminal_signals)
    engine = http_engine(tmp_path)
    argv = [
        *script("driver", DRIVER),
        str(tmp_path),
        json.dumps(engine.argv),
        engine.url,
        json.dumps(script("sleep", SLEEP)),
    ]
    driver = subprocess.Popen(
        argv, env={**os.environ, **CHILD_ENV}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **popen
    )
    pid_file = tmp_path / "pids.json"
    deadline = time.monotonic() + 90
    while not pid_file.exists() or not pid_file.read_text().endswith("]"):
        if driver.poll() is not None or time.monotonic() > deadline:
            driver.kill()
            pytest.fail(driver.communicate(timeout=30)[0].decode())
        time.sleep(0.05)
    pids = json.loads(pid_file.read_text())
    if not (len(pids) == 3 and all(alive(pid) for pid in pids)):
        driver.send_signal(signal.SIGTERM)  # the driver stops what it started
        pytest.fail(f"not all of {pids} came up: {driver.communicate(timeout=60)[0].decode()}")
    return driver, pids


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signal_to_the_driver_tears_everything_down(tmp_path: Path, script: Script, sig: signal.Signals) -> None:
    driver, pids = start_driver(tmp_path, script)
    try:
        driver.send_signal(sig)
        output = driver.communicate(timeout=60)[0].decode()
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    # either way the driver dies of the signal after stopping its children (CPython ends an unhandled
    # KeyboardInterrupt by re-raising SIGINT; a default SIGTERM / SIGHUP is re-raised by the launcher)
    assert driver.returncode == -sig, output
    assert ("KeyboardInterrupt" in output) == (sig == signal.SIGINT), output
    assert f"received {sig.name}: stopping 1 launcher(s)" in output
    assert all(wait_dead(pid) for pid in pids)


def test_builtin_plugin_registers_local(tmp_path: Path) -> None:
    manager = PluginManager(builtins=[b for b in BUILTIN_PLUGINS if b[0] == "launch"], entry_points=False).load()
    assert manager.registry(ComponentKind.LAUNCHER).get("local").component is LocalLauncher
    spec = PluginSpec(name="local", terminate_timeout=2.5)
    with manager.create(ComponentKind.LAUNCHER, spec, field="cluster.launcher", run_dir=str(tmp_path)) as lau:
        assert isinstance(lau, LocalLauncher) and lau.settings.terminate_timeout == 2.5
        assert lau.log_dir == str(tmp_path / "logs")


def test_an_ignored_sighup_stays_ignored(tmp_path: Path, script: Script) -> None:
    """Under ``nohup`` (SIGHUP ignored) a closed terminal must not stop the run."""
    driver, pids = start_driver(tmp_path, script, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        driver.send_signal(signal.SIGHUP)
        with pytest.raises(subprocess.TimeoutExpired):
            driver.wait(timeout=1.0)
        assert all(alive(pid) for pid in pids)
        driver.send_signal(signal.SIGTERM)
        output = driver.communicate(timeout=60)[0].decode()
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    assert driver.returncode == -signal.SIGTERM and "received SIGHUP" not in output, output
    assert all(wait_dead(pid) for pid in pids)


def test_an_ignored_sigint_is_handled_anyway(tmp_path: Path, script: Script) -> None:
    """``miles train ... &`` from a script inherits an ignored SIGINT; ``kill -INT`` must still stop the run
    and everything it started."""
    driver, pids = start_driver(tmp_path, script, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        driver.send_signal(signal.SIGINT)
        driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    assert driver.returncode != 0
    assert all(wait_dead(pid) for pid in pids)


def test_children_die_with_a_killed_driver(tmp_path: Path, script: Script) -> None:
    """``kill -9`` of the driver runs no handler; the kernel's parent-death signal stops its children."""
    driver, pids = start_driver(tmp_path, script)
    driver.kill()
    driver.communicate(timeout=60)
    assert driver.returncode == -signal.SIGKILL
    assert all(wait_dead(pid) for pid in pids)


def test_atexit_reaps_children_of_a_driver_that_forgot_shutdown(tmp_path: Path, script: Script) -> None:
    driver = script(
        "forgetful",
        "import sys\n"
        "from miles.launch.local import LocalLauncher, LocalLauncherSettings\n"
        "from miles.launch.rendezvous import trainer_specs\n"
        # no parent-death signal: only the atexit hook can stop the ranks
        "launcher = LocalLauncher(LocalLauncherSettings(die_with_parent=False), run_dir=sys.argv[1])\n"
        "launcher.start_trainers(trainer_specs([sys.executable, '-c', 'import time; time.sleep(120)'], 2))\n"
        "print(*[p.pid for p in launcher.processes], flush=True)\n"
        "raise RuntimeError('driver bug after starting the ranks')\n",
    )
    done = subprocess.run(
        [*driver, str(tmp_path)], capture_output=True, text=True, timeout=120, env={**os.environ, **CHILD_ENV}
    )
    assert done.returncode == 1 and "driver bug after starting the ranks" in done.stderr
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2 and all(wait_dead(pid) for pid in pids)


STUBBORN_DRIVER = """
import logging, sys
from miles.launch.local import LocalLauncher, LocalLauncherSettings
from miles.launch.rendezvous import trainer_specs
logging.basicConfig(level=logging.INFO)
rank = sys.argv[2:]
with LocalLauncher(LocalLauncherSettings(poll_interval=0.05, terminate_timeout=4.0), run_dir=sys.argv[1]) as launcher:
    launcher.start_trainers(trainer_specs(rank, 1))
    launcher.wait_trainers()
"""


def test_second_ctrl_c_does_not_interrupt_the_teardown(tmp_path: Path, script: Script) -> None:
    ready = tmp_path / "ready"
    rank = script(
        "stubborn_rank",
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"open({str(ready)!r}, 'w').write('ok')\n"
        "time.sleep(120)\n",
    )
    argv = [*script("stubborn_driver", STUBBORN_DRIVER), str(tmp_path), *rank]
    driver = subprocess.Popen(
        argv,
        env={**os.environ, **CHILD_ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=terminal_signals,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line.decode()) for line in driver.stdout or ()], daemon=True)
    reader.start()

    seen: list[str] = []

    def wait_for(text: str) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                seen.append(lines.get(timeout=1))
                if text in seen[-1]:
                    return
            except queue.Empty:
                pass
        pytest.fail(f"driver never logged {text!r}; it logged:\n{''.join(seen)}")

    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline and driver.poll() is None
            time.sleep(0.05)
        driver.send_signal(signal.SIGINT)
        wait_for("received SIGINT: stopping 1 launcher(s)")  # teardown has begun; the rank ignores SIGTERM
        driver.send_signal(signal.SIGINT)
        wait_for("received SIGINT during shutdown; still stopping child processes")
        wait_for("ignored SIGTERM for 4 s: SIGKILL")
        driver.wait(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        reader.join(timeout=30)
        if driver.stdout is not None:
            driver.stdout.close()
    assert driver.returncode == -signal.SIGINT


def test_an_engine_added_while_the_trainers_run_is_watched_not_waited_for_and_retired_is_no_death(
    tmp_path: Path,
) -> None:
    """``add_engine`` returns at once (``engines_up`` says when it answers, one look each tick); a retired
    engine is stopped and reaped, and ``wait_trainers`` does not take it for a death (nothing restarts it);
    ``tick`` runs at every check."""
    from miles.launch.engine_restarts import EngineDeathPolicy

    def make(index: int, host: str, port: int) -> EngineLaunch:
        launch = http_engine(tmp_path)
        argv = [*launch.argv[:3], str(port), *launch.argv[4:]]  # on the address the launcher chose
        return EngineLaunch(argv=argv, url=f"http://{host}:{port}", env=CHILD_ENV, health_path="/")

    with launcher(tmp_path) as lau:
        lau.engine_deaths = EngineDeathPolicy(restarts=3)
        (first,) = lau.start_engines([http_engine(tmp_path)], timeout=60)
        started = time.monotonic()
        url = lau.add_engine(make, host="127.0.0.1")
        assert time.monotonic() - started < 5 and lau.engine_urls == [first, url]
        deadline = time.monotonic() + 60
        while not lau.engines_up():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert httpx.get(url + "/", trust_env=False).status_code == 200
        added = lau.engines[1]
        assert added.name == "engine-1" and alive(added.pid)
        lau.retire_engine(first)
        assert gone(lau.engines[0].pid) and alive(added.pid)
        ticks: list[float] = []
        lau.start_trainers(trainer_specs([sys.executable, "-c", "import time; time.sleep(1)"], 1, env=CHILD_ENV))
        assert lau.wait_trainers(timeout=60, tick=lambda: ticks.append(time.monotonic())) == 0
        assert len(ticks) > 3  # called at each check
        assert len(lau.engines) == 2 and lau.engines[0].reaped and alive(added.pid)  # not restarted


KEYED_ENGINE = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class Keyed(BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.headers.get("authorization") == "Bearer " + sys.argv[2]
        self.send_response(200 if ok else 401)
        self.end_headers()

    def log_message(self, *args):
        pass

HTTPServer(("127.0.0.1", int(sys.argv[1])), Keyed).serve_forever()
"""


def test_an_engine_added_to_a_keyed_run_is_looked_at_with_the_runs_key(tmp_path: Path) -> None:
    """Issue 46: an engine whose health path needs the run's API key (SGLang's ``/health_generate``) and
    answers 401 without it is up for ``engines_up`` once it answers the run's key, as for ``wait_engines``."""
    from miles.auth import ServiceKeys

    def make(index: int, host: str, port: int) -> EngineLaunch:
        argv = [sys.executable, "-c", KEYED_ENGINE, str(port), "run-key-7f3a"]
        return EngineLaunch(argv=argv, url=f"http://{host}:{port}", env=CHILD_ENV, health_path="/health_generate")

    with launcher(tmp_path) as lau:
        lau.keys = ServiceKeys("run-key-7f3a")
        url = lau.add_engine(make, host="127.0.0.1")
        deadline = time.monotonic() + 60
        while not lau.engines_up():
            assert time.monotonic() < deadline, lau.engines[0].log_tail(20)
            time.sleep(0.1)
        assert httpx.get(url + "/health_generate", trust_env=False).status_code == 401  # (it does check)
