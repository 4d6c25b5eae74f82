"""The ``local`` rollout-engine backend: registered by the built-in plugin ``local_engine``, cheap to
import, and its launch command really starts a server that answers ``/health``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from miles.components import ComponentKind
from miles.net import free_port
from miles.plugins.builtin import BUILTIN_PLUGINS
from miles.plugins.manager import PluginManager


def test_registered_as_builtin_plugin() -> None:
    assert ("local_engine", "miles.engine.plugin") in BUILTIN_PLUGINS
    pm = PluginManager(entry_points=False).load()
    record = {r.name: r for r in pm.records()}["local_engine"]
    assert record.status == "ok", record.error
    reg = pm.get(ComponentKind.ROLLOUT_ENGINE, "local")
    assert reg.component.capabilities.routed_experts is True


def test_plugin_module_imports_without_torch() -> None:
    code = "import sys, miles.engine.plugin; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_launch_command_serves(engine_models: dict[str, Path], tmp_path: Path) -> None:
    pm = PluginManager(entry_points=False).load()
    reg = pm.get(ComponentKind.ROLLOUT_ENGINE, "local")
    engine = reg.component(reg.settings_model(max_cache_tokens=128, threads=1))
    port = free_port()
    launch = engine.launch(
        model_path=str(engine_models["llama"]), host="127.0.0.1", port=port, device="cpu", dtype="float32", devices=[]
    )
    assert launch.url == f"http://127.0.0.1:{port}"
    assert launch.argv[:3] == [sys.executable, "-m", "miles.engine"] and "--max-cache-tokens" in launch.argv
    log = open(tmp_path / "launch.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        launch.argv, env={**os.environ, **launch.env, "OMP_NUM_THREADS": "1"}, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "launch.log").read_text()
            try:
                if httpx.get(launch.url + launch.health_path, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
        info = httpx.get(launch.url + "/server_info", timeout=10).json()
        assert info["max_cache_tokens"] == 128 and info["model_path"] == str(engine_models["llama"])
        out = httpx.post(
            launch.url + "/generate",
            json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}},
            timeout=60,
        )
        assert out.json()["meta_info"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_serve_cli_rejects_a_bad_model_dir(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "miles.engine", "--model", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "config.json" in out.stderr
