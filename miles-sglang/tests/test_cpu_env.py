"""``scripts/sglang/cpu_env.py`` without building anything: cache keys follow what goes into a build, a
layer counts only once its marker is written, builds wait for each other's lock, and a CPU without the
kernels' instructions makes ``run`` skip with the reason (exit 0) and ``build`` / ``check`` exit 3. The
builds themselves run in ``tox -e sglang-real``."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "sglang" / "cpu_env.py"


@pytest.fixture
def cpu_env() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_cpu_env_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_kernel_key_follows_the_source_and_the_env_key_the_pins(
    cpu_env: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "aot"
    shutil.copytree(cpu_env.KERNEL_SOURCE / "csrc" / "cpu", source / "csrc" / "cpu")
    monkeypatch.setattr(cpu_env, "KERNEL_SOURCE", source)
    python = "/usr/bin/python3.11"
    key = cpu_env.kernel_key(python)
    assert key == cpu_env.kernel_key(python) and len(key) == 16
    assert cpu_env.kernel_key("/other/python3.12") != key
    (source / "csrc" / "cpu" / "norm.cpp").write_text("// changed\n")
    changed = cpu_env.kernel_key(python)
    assert changed != key
    env_key = cpu_env.env_key(python, changed)
    assert env_key == cpu_env.env_key(python, changed) != cpu_env.env_key(python, key)
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(cpu_env.CONSTRAINTS.read_text() + "extra==1\n")
    monkeypatch.setattr(cpu_env, "CONSTRAINTS", constraints)
    assert cpu_env.env_key(python, changed) != env_key
    deps = cpu_env.miles_dependencies()
    assert "pydantic>=2.7" in deps and not any(d.startswith("miles-") for d in deps)


def test_a_layer_counts_once_its_marker_is_written(cpu_env: ModuleType, tmp_path: Path) -> None:
    layer = tmp_path / "env-x"
    layer.mkdir()
    assert cpu_env.complete(layer) is None
    (layer / cpu_env.MARKER).write_text("{half")  # a marker cut short is no marker
    assert cpu_env.complete(layer) is None
    cpu_env.finish(layer, {"python": "/p"})
    assert cpu_env.complete(layer) == {"python": "/p"}
    assert not list(layer.glob("*.tmp"))


HOLDER = """
import fcntl, sys, time
with open(sys.argv[1], "a+") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    print("held", flush=True)
    time.sleep(1.5)
"""


def test_a_build_waits_for_the_lock_another_holds(
    cpu_env: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lock = tmp_path / "env-x.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with cpu_env.locked(lock, "the test layer"):
            waited = time.monotonic() - started
        assert waited > 0.5
        assert "waiting for another process building the test layer" in capsys.readouterr().err
    finally:
        holder.wait(timeout=30)
        assert holder.stdout is not None
        holder.stdout.close()


def test_a_cpu_without_the_isa_skips(
    cpu_env: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    reason = "this CPU (Old CPU, x86_64) lacks avx512_bf16, avx512_vnni: ..."
    monkeypatch.setattr(cpu_env, "skip_reason", lambda: reason)
    monkeypatch.setattr(cpu_env, "ensure", lambda args: pytest.fail("nothing may be built"))
    assert cpu_env.main(["run", "--", "-m", "pytest"]) == 0
    assert capsys.readouterr().out == f"SKIPPED: SGLang on this CPU: {reason}\n"
    assert cpu_env.main(["check"]) == cpu_env.SKIP_EXIT == 3
    assert cpu_env.main(["build"]) == 3
    assert reason in capsys.readouterr().err


def test_the_skip_reason_names_the_missing_flags(cpu_env: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    host = cpu_env.cpu_host()
    monkeypatch.setattr(cpu_env, "cpu_host", lambda: host)
    monkeypatch.setattr(host, "missing_cpu_flags", lambda: ["avx512_bf16"])
    assert "lacks avx512_bf16: SGLang's CPU kernels" in cpu_env.skip_reason()
    monkeypatch.setattr(host, "missing_cpu_flags", lambda: [])
    assert cpu_env.skip_reason() is None


def test_layers_of_vanished_checkouts_are_removed(cpu_env: ModuleType, tmp_path: Path) -> None:
    checkouts = tmp_path / "env-x" / "checkouts"
    gone, here, building = checkouts / "a", checkouts / "b", checkouts / "c"
    for overlay in (gone, here, building):
        overlay.mkdir(parents=True)
    cpu_env.finish(gone, {"checkout": str(tmp_path / "deleted-clone")})
    cpu_env.finish(here, {"checkout": str(tmp_path)})
    (checkouts / "a.lock").touch()
    cpu_env.prune_checkouts(tmp_path / "env-x")
    assert not gone.exists() and not (checkouts / "a.lock").exists()
    assert here.is_dir() and building.is_dir()  # a layer without its marker may be in the making
