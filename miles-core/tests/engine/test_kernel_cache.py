"""The kernel build cache: a build killed half-way never wedges later builds; one build serves every
environment; waiting for another build is bounded. Real compiles of a tiny pybind11 module."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from miles.engine.kernel_cache import (
    BUILD_TIMEOUT_ENV,
    CACHE_ENV,
    KernelBuildError,
    build_progress,
    extension_key,
    last_build_seconds,
    load_extension,
)

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")

SOURCE = textwrap.dedent(
    """
    #include <pybind11/pybind11.h>
    int add(int a, int b) { return a + b; }
    PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("add", &add); }
    """
)

LOADER = textwrap.dedent(
    """
    import logging, sys
    from pathlib import Path
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    from miles.engine.kernel_cache import load_extension
    module = load_extension("miles_test_ext", [Path(sys.argv[1])], what="the test extension")
    print("result", module.add(2, 3), flush=True)
    """
)


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "src" / "ext.cpp"
    path.parent.mkdir()
    path.write_text(SOURCE)
    return path


def last_build_seconds_in(cache: Path, what: str) -> float:
    import json

    return float(json.loads((cache / "build-times.json").read_text())[what])


def _env(cache: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, CACHE_ENV: str(cache), **extra}


def _run_loader(source: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", LOADER, str(source)], env=env, capture_output=True, text=True, timeout=timeout
    )


def test_killed_build_leaves_no_wedge_and_one_build_serves_other_environments(source: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    directory = cache / f"miles_test_ext_{extension_key([source])}"
    # 1. a build killed half-way (what Ctrl-C during an engine's first start does) leaves torch's lock file
    proc = subprocess.Popen(
        [sys.executable, "-c", LOADER, str(source)],
        env=_env(cache),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (directory / "lock").exists():
            assert proc.poll() is None, "the build ended before it could be interrupted"
            assert time.monotonic() < deadline, "the build never started"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the loader, ninja and the compilers: its own process group
        proc.wait()
    assert (directory / "lock").exists()
    assert not (directory / "COMPLETE").exists()

    # 2. the next load recovers: it removes the stale lock, builds and imports
    done = _run_loader(source, _env(cache), timeout=300)
    assert done.returncode == 0, done.stderr
    assert "result 5" in done.stdout
    assert "left by an interrupted build" in done.stderr
    assert (directory / "COMPLETE").exists() and not (directory / "lock").exists()
    # the build said what a first build costs, and recorded what this one took for the next
    assert "a first build takes" in done.stderr
    assert last_build_seconds_in(cache, "the test extension") > 0

    # 3. another checkout of the same sources (another path) in another process imports the build as it is:
    # with no working compiler, any rebuild would fail
    other = tmp_path / "other-checkout" / "ext.cpp"
    other.parent.mkdir()
    other.write_text(SOURCE)
    reused = _run_loader(other, _env(cache, CXX="/bin/false", CC="/bin/false", PATH="/nonexistent"), timeout=120)
    assert reused.returncode == 0, reused.stderr
    assert "result 5" in reused.stdout
    assert "building" not in reused.stderr


def test_waiting_for_another_build_is_bounded_and_names_the_directory(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fcntl

    cache = tmp_path / "cache"
    directory = cache / f"miles_test_ext_{extension_key([source])}"
    directory.mkdir(parents=True)
    monkeypatch.setenv(CACHE_ENV, str(cache))
    monkeypatch.setenv(BUILD_TIMEOUT_ENV, "0.5")
    with open(directory / "miles.lock", "a+") as held:  # another process's build in progress
        fcntl.flock(held, fcntl.LOCK_EX)
        start = time.monotonic()
        with pytest.raises(KernelBuildError, match=str(directory)):
            load_extension("miles_test_ext", [source], what="the test extension")
        assert time.monotonic() - start < 10


def test_a_compile_error_is_reported_with_the_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "bad.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(KernelBuildError, match="failed"):
        load_extension("miles_test_bad", [bad], what="the test extension")


def test_a_build_says_how_far_it_is_and_what_the_last_one_took(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No silent minute: every interval a line with the sources compiled so far, the time spent and the
    last build's time on this machine (its object files are what has been compiled)."""
    import logging
    import threading

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    assert last_build_seconds("the CPU kernels") is None
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "build-times.json").write_text('{"the CPU kernels": 78.4}')
    assert last_build_seconds("the CPU kernels") == 78.4
    directory = tmp_path / "build"
    directory.mkdir()

    def compile_two() -> None:
        time.sleep(0.35)
        (directory / "a.o").write_bytes(b"")
        time.sleep(0.3)
        (directory / "b.o").write_bytes(b"")

    compiler = threading.Thread(target=compile_two)
    with (
        caplog.at_level(logging.INFO, logger="miles.engine.kernel_cache"),
        build_progress("the CPU kernels", directory, 3, expected=78.4, interval=0.1),
    ):
        compiler.start()
        compiler.join()
        time.sleep(0.25)
    lines = [r.getMessage() for r in caplog.records]
    assert lines and all(line.startswith("building the CPU kernels: ") for line in lines)
    assert all(line.endswith("(the last build here took 78 s)") for line in lines)
    assert any(" 0 of 3 sources compiled" in line for line in lines)
    assert " 2 of 3 sources compiled" in lines[-1]
