"""The ``sglang`` engine without SGLang: launch-command snapshots (CUDA and CPU), GPU placement by the
launcher, and the settings errors a run gets before anything starts (SGLang or its CPU kernels missing, no
GPU, too few GPUs, a CPU without AVX-512 BF16)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from miles.errors import SettingsError
from miles.settings.model import MilesSettings
from miles_sglang import cpu_host
from miles_sglang.checks import INSTALL_LINE, host_problems, sglang_installed
from miles_sglang.engine import SGLangEngine
from miles_sglang.settings import SGLangEngineSettings

PY = sys.executable


def launch(settings: SGLangEngineSettings, **where: Any) -> list[str]:
    args: dict[str, Any] = {
        "model_path": "/models/qwen",
        "host": "127.0.0.1",
        "port": 30001,
        "device": "cuda",
        "dtype": "bfloat16",
        "devices": [0],
        **where,
    }
    return SGLangEngine(settings).launch(**args).argv


def test_default_launch_command() -> None:
    assert launch(SGLangEngineSettings(), seed=1234) == [
        PY, "-m", "miles_sglang.serve",
        "--model-path", "/models/qwen", "--host", "127.0.0.1", "--port", "30001",
        "--tp-size", "1", "--base-gpu-id", "0", "--random-seed", "1234", "--dtype", "bfloat16",
        "--weight-version", "0",
        "--skip-server-warmup",
    ]  # fmt: skip


def test_every_option_on_the_launch_command() -> None:
    settings = SGLangEngineSettings(
        tp_size=2,
        mem_fraction_static=0.7,
        context_length=4096,
        max_running_requests=128,
        enable_deterministic_inference=True,
        enable_return_routed_experts=True,
        attention_backend="fa3",
        log_level="warning",
        extra_args=["--chunked-prefill-size", "4096"],
    )
    # engine rank 3 of a colocated run: GPUs 6 and 7, seed 1234 + 3, memory saver on
    argv = launch(settings, devices=[6, 7], rank=3, seed=1234, colocate=True, port=30007)
    assert argv == [
        PY, "-m", "miles_sglang.serve",
        "--model-path", "/models/qwen", "--host", "127.0.0.1", "--port", "30007",
        "--tp-size", "2", "--base-gpu-id", "6", "--random-seed", "1237", "--dtype", "bfloat16",
        "--weight-version", "0",
        "--mem-fraction-static", "0.7", "--context-length", "4096", "--max-running-requests", "128",
        "--attention-backend", "fa3", "--log-level", "warning",
        "--enable-return-routed-experts", "--enable-deterministic-inference", "--enable-memory-saver",
        "--skip-server-warmup",
        "--chunked-prefill-size", "4096",
    ]  # fmt: skip
    engine_launch = SGLangEngine(settings).launch(
        model_path="/m", host="127.0.0.1", port=1, device="cuda", dtype="bfloat16", devices=[0, 1]
    )
    assert engine_launch.health_path == "/health_generate" and engine_launch.url == "http://127.0.0.1:1"
    assert engine_launch.env == {
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"
    }  # GPUs are chosen with --base-gpu-id, not CUDA_VISIBLE_DEVICES


def test_memory_saver_follows_colocation_unless_set() -> None:
    assert "--enable-memory-saver" not in launch(SGLangEngineSettings(), colocate=False)
    assert "--enable-memory-saver" in launch(SGLangEngineSettings(), colocate=True)
    assert "--enable-memory-saver" not in launch(SGLangEngineSettings(enable_memory_saver=False), colocate=True)
    assert "--enable-memory-saver" in launch(SGLangEngineSettings(enable_memory_saver=True), colocate=False)
    assert "--skip-server-warmup" not in launch(SGLangEngineSettings(skip_server_warmup=False))


def test_launch_refuses_an_unknown_device_and_a_wrong_placement() -> None:
    with pytest.raises(
        SettingsError, match="cluster.device: rollout.engine 'sglang' serves on 'cuda' or 'cpu', got 'xpu'"
    ):
        launch(SGLangEngineSettings(), device="xpu", devices=[])
    with pytest.raises(SettingsError, match=r"tp_size: engine 0 was placed on GPUs \[0\], expected 2"):
        launch(SGLangEngineSettings(tp_size=2), devices=[0])


def test_cpu_launch_command() -> None:
    """The same command on a CPU: ``--device cpu`` instead of ``--base-gpu-id`` (which SGLang would read as the
    NUMA node to bind to), no overlap scheduling, ``SGLANG_USE_CPU_ENGINE=1`` in the environment."""
    engine_launch = SGLangEngine(SGLangEngineSettings(max_total_tokens=4096)).launch(
        model_path="/models/llama", host="127.0.0.1", port=30002, device="cpu", dtype="bfloat16", devices=[], seed=7
    )
    assert engine_launch.argv == [
        PY, "-m", "miles_sglang.serve",
        "--model-path", "/models/llama", "--host", "127.0.0.1", "--port", "30002",
        "--tp-size", "1", "--device", "cpu", "--random-seed", "7", "--dtype", "bfloat16",
        "--weight-version", "0", "--max-total-tokens", "4096",
        "--skip-server-warmup", "--disable-overlap-schedule",
    ]  # fmt: skip
    assert engine_launch.env == {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}
    assert engine_launch.health_path == "/health_generate" and engine_launch.url == "http://127.0.0.1:30002"
    # rank 2 of a colocated CPU run: seed + rank, and no memory saver (it pages CUDA memory)
    argv = launch(SGLangEngineSettings(), device="cpu", devices=[], rank=2, seed=5, colocate=True)
    assert "--base-gpu-id" not in argv and "--enable-memory-saver" not in argv
    assert argv[argv.index("--random-seed") + 1] == "7"
    assert "--max-total-tokens" not in launch(SGLangEngineSettings(), device="cpu", devices=[])
    assert "--max-total-tokens" in launch(SGLangEngineSettings(max_total_tokens=512))  # on CUDA too
    assert "--disable-overlap-schedule" not in launch(SGLangEngineSettings())
    with pytest.raises(SettingsError, match='rollout.engine_dtype: .* no float32 path .* = "bfloat16"'):
        launch(SGLangEngineSettings(), device="cpu", devices=[], dtype="float32")
    # "auto" (a judge reward's default: the checkpoint's dtype) serves bfloat16 on a CPU: a float32 checkpoint
    # served as float32 failed at its first forward; on CUDA "auto" stays SGLang's
    for auto in ("auto", ""):
        argv = launch(SGLangEngineSettings(), device="cpu", devices=[], dtype=auto)
        assert argv[argv.index("--dtype") + 1] == "bfloat16"
    argv = launch(SGLangEngineSettings(), dtype="auto")
    assert argv[argv.index("--dtype") + 1] == "auto"


def test_health_does_not_generate() -> None:
    """SGLang's ``/health`` generated a token by default and answered 503 after 20 s without one: a paused engine
    (each push of an async run) looked dead to Miles' failover and to smg. Every engine is started with
    ``/health`` as a liveness check (``/health_generate``, which the launcher waits on, still generates)."""
    on_gpu = SGLangEngine(SGLangEngineSettings()).launch(
        model_path="/models/qwen", host="127.0.0.1", port=30004, device="cuda", dtype="bfloat16", devices=[0]
    )
    assert on_gpu.env == {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}
    assert on_gpu.health_path == "/health_generate"


def test_lora_on_a_cpu_takes_sglangs_torch_kernels() -> None:
    """SGLang's default LoRA backend (``csgmv``) and its others are Triton GPU kernels: on a CPU the engine
    asks for ``torch_native`` (``tests/real`` serves adapters with it), unless the settings name a backend."""
    from miles_sglang.command import EnginePlacement, launch_argv

    where = EnginePlacement("/models/llama", "127.0.0.1", 30003, None, 1, "bfloat16", False, device="cpu")
    lora = SGLangEngineSettings(enable_lora=True, max_lora_rank=8, lora_target_modules=["q_proj", "v_proj"])
    argv = launch_argv(lora, where)
    assert argv[argv.index("--lora-backend") + 1] == "torch_native"
    chosen = launch_argv(lora.model_copy(update={"lora_backend": "triton"}), where)
    assert chosen[chosen.index("--lora-backend") + 1] == "triton"
    on_gpu = launch_argv(lora, EnginePlacement("/models/llama", "127.0.0.1", 30003, 0, 1, "bfloat16", False))
    assert "--lora-backend" not in on_gpu  # SGLang's own choice
    assert "--lora-backend" not in launch_argv(SGLangEngineSettings(), where)  # no LoRA, no LoRA flags


def test_cpu_host_problems_name_what_is_missing_and_how_to_build_it() -> None:
    options = SGLangEngineSettings()
    cpu = settings_for(device="cpu")
    assert host_problems(options, cpu, installed=True, kernels=True, missing_flags=[]) == []
    (no_sglang,) = host_problems(options, cpu, installed=False, kernels=False, missing_flags=[])
    assert no_sglang.startswith("rollout.engine: 'sglang' on a CPU (cluster.device = \"cpu\") needs SGLang")
    assert "SGLang is not installed here" in no_sglang and "scripts/sglang/cpu_env.py" in no_sglang
    (no_kernels,) = host_problems(options, cpu, installed=True, kernels=False, missing_flags=[])
    assert "SGLang's CPU kernels (sgl_kernel) is not installed here" in no_kernels
    assert cpu_host.BUILD_HINT in no_kernels
    (old_cpu,) = host_problems(options, cpu, installed=True, kernels=True, missing_flags=["avx512_bf16"])
    assert old_cpu.startswith("cluster.device: SGLang's CPU kernels need avx512_bf16, which this CPU (")
    refused = SGLangEngineSettings(enable_memory_saver=True, enable_deterministic_inference=True)
    saver, deterministic = host_problems(refused, cpu, installed=True, kernels=True, missing_flags=[])
    assert saver.startswith("rollout.engine.enable_memory_saver:") and "CUDA" in saver
    assert deterministic.startswith("rollout.engine.enable_deterministic_inference:")


def test_cpu_flags_come_from_cpuinfo() -> None:
    cpuinfo = "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx512f avx512bw avx512_bf16\n"
    flags = cpu_host.cpu_flags(cpuinfo)
    assert {"avx512f", "avx512_bf16"} <= flags and cpu_host.cpu_model(cpuinfo) == "Some CPU"
    assert cpu_host.missing_cpu_flags(flags) == ["avx512cd", "avx512dq", "avx512vl", "avx512_vnni"]
    assert cpu_host.missing_cpu_flags(set(cpu_host.REQUIRED_CPU_FLAGS)) == []


def test_the_launcher_places_tp_size_gpus_per_engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``launch_engines`` gives engine ``i`` ``tp`` GPUs after the trainer ranks' (from GPU 0 when colocated),
    its rank and seed."""
    import miles_sglang.engine as engine_module
    from miles.compose import build_run
    from miles.host.train import launch_engines
    from miles.launch.local import LocalLauncher
    from miles.rollout.backend import EngineLaunch

    monkeypatch.setattr(engine_module, "host_problems", lambda options, settings: [])  # pretend an 8-GPU host
    seen: list[EngineLaunch] = []

    class Recording(LocalLauncher):
        def start_engines(self, launches: list[EngineLaunch], *, timeout: float, wait: bool = True) -> list[str]:
            seen.extend(launches)
            return []  # nothing is started

    model = tmp_path / "qwen"  # the settings pass wants a model directory; the engines are never started
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}')

    def placed(colocate: bool) -> list[tuple[str, str, str, str]]:
        settings = MilesSettings.model_validate(
            {
                "cluster": {"device": "cuda", "num_engines": 2, "trainer_ranks": 2, "colocate": colocate},
                "rollout": {"engine": {"name": "sglang", "tp_size": 2}},
                "train": {"model_path": str(model), "seed": 7},
                "precision": "bf16",
            }
        )
        seen.clear()
        with Recording(run_dir=str(tmp_path)) as launcher:
            assert launch_engines(build_run(settings), launcher) == []
        flags = [dict(zip(x.argv[3::2], x.argv[4::2], strict=False)) for x in seen]
        return [(f["--base-gpu-id"], f["--tp-size"], f["--random-seed"], f["--dtype"]) for f in flags]

    # trainer ranks on GPUs 0-1: engines on 2-3 and 4-5; colocated: on 0-1 and 2-3
    assert placed(colocate=False) == [("2", "2", "7", "bfloat16"), ("4", "2", "8", "bfloat16")]
    assert placed(colocate=True) == [("0", "2", "7", "bfloat16"), ("2", "2", "8", "bfloat16")]


def test_ray_gives_each_engine_its_actors_own_gpus_on_two_nodes_of_four(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Two nodes x 4 GPUs under the ``ray`` launcher, 2 trainer ranks and 3 engines of ``tp_size`` 2: Ray shows
    each engine's process only its actor's two GPUs (``CUDA_VISIBLE_DEVICES``), so every command names GPU 0
    (a host-wide index, 2 / 4 / 6, would point past what the process sees), listens on its own node's address
    and is seeded by its rank."""
    import miles_sglang.engine as engine_module
    from miles.compose import build_run
    from miles.host.train import launch_engines
    from miles.launch.ray_launcher import RayLauncher, RayLauncherSettings
    from miles.rollout.backend import EngineLaunch

    monkeypatch.setattr(engine_module, "host_problems", lambda options, settings: [])  # SGLang is not here
    nodes = {0: "10.0.0.1", 1: "10.0.0.2", 2: "10.0.0.2"}  # engine 0 beside the trainer ranks, 1 and 2 on node 2
    seen: list[EngineLaunch] = []

    class Recording(RayLauncher):  # Ray's own numbering, its placement answered here (no cluster)
        def engine_address(self, index: int, host: str) -> tuple[str, int]:
            return nodes[index], 30000 + index

        def start_engines(self, launches: list[EngineLaunch], *, timeout: float, wait: bool = True) -> list[str]:
            seen.extend(launches)
            return []

    model = tmp_path / "qwen"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    ray = {"name": "ray", "address": "10.0.0.1:6379"}
    base = {
        "cluster": {"device": "cuda", "num_engines": 3, "trainer_ranks": 2},
        "rollout": {"engine": {"name": "sglang", "tp_size": 2}},
        "train": {"model_path": str(model), "seed": 7},
        "precision": "bf16",
    }
    settings = MilesSettings.model_validate({**base, "cluster": {**base["cluster"], "launcher": ray}})
    # (the run is built with the local launcher: this env has no Ray, which build_run would ask for)
    run = build_run(MilesSettings.model_validate(base))
    launcher = Recording(RayLauncherSettings(address=ray["address"]), run_dir=str(tmp_path))
    assert launch_engines(run, launcher) == []
    flags = [dict(zip(x.argv[3::2], x.argv[4::2], strict=False)) for x in seen]
    assert [(f["--host"], f["--base-gpu-id"], f["--tp-size"], f["--random-seed"]) for f in flags] == [
        ("10.0.0.1", "0", "2", "7"),
        ("10.0.0.2", "0", "2", "8"),
        ("10.0.0.2", "0", "2", "9"),
    ]
    assert all(launch.env.get("CUDA_VISIBLE_DEVICES") is None for launch in seen)  # Ray's to set, per actor
    # engines on other nodes listen beyond loopback: the run made a key, in their environment, not on a command line
    keys = {launch.env.get("MILES_API_KEY") for launch in seen}
    assert len(keys) == 1 and None not in keys and not any(k in " ".join(x.argv) for k in keys for x in seen)
    # the per-node check accepts this fleet on 2 x 4 GPUs (node 1: 2 ranks + 1 engine, node 2: 2 engines)
    four = [{"GPU": 4.0, "CPU": 16.0}, {"GPU": 4.0, "CPU": 16.0}]
    assert run.rollout_engine().placement_problems(four, settings) == []


def test_node_problems_check_each_node_not_the_drivers_host() -> None:
    """On a cluster this host's GPUs do not count (the driver may have none); each node's do: ``tp_size`` GPUs
    on one node per engine, one per trainer rank, on the nodes offering the launcher's custom resources."""
    from miles_sglang.checks import node_problems, places_on_nodes

    def on_ray(**cluster: Any) -> MilesSettings:
        launcher = {"name": "ray", "address": "auto", **cluster.pop("launcher", {})}
        return MilesSettings.model_validate(
            {"cluster": {"device": "cuda", "launcher": launcher, **cluster}, "rollout": {"engine": {"name": "sglang"}}}
        )

    two = SGLangEngineSettings(tp_size=2)
    four = [{"GPU": 4.0}, {"GPU": 4.0}]
    fleet = on_ray(num_engines=3, trainer_ranks=2)
    assert places_on_nodes(fleet) and not places_on_nodes(settings_for(device="cuda"))
    assert host_problems(two, fleet, installed=True, gpus=0) == []  # no GPU on the driver's host: fine
    assert node_problems(two, fleet, four) == []
    (few,) = node_problems(two, on_ray(num_engines=4, trainer_ranks=2), four)
    assert few == (
        "cluster.num_engines: 4 engines x rollout.engine.tp_size 2 (on one node each) + 2 trainer ranks need 10 "
        "GPUs; the Ray cluster's nodes have 4, 4 GPUs: 4 engines and 0 trainer ranks fit"
    )
    (wide,) = node_problems(SGLangEngineSettings(tp_size=8), fleet, four)
    assert wide.startswith("rollout.engine.tp_size: each engine needs 8 GPUs on one node;") and "at most 4" in wide
    # engines only where engine_resources are offered: one 4-GPU node holds 2 engines of tp 2, not 3
    labelled = [{"GPU": 4.0, "engine_node": 1.0}, {"GPU": 4.0, "trainer_node": 1.0}]
    pinned = on_ray(num_engines=3, trainer_ranks=2, launcher={"engine_resources": {"engine_node": 1}})
    (pin,) = node_problems(two, pinned, labelled)
    assert pin.endswith("2 engines and 2 trainer ranks fit"), pin
    # colocated: each engine shares its trainer rank's GPU
    assert node_problems(SGLangEngineSettings(), on_ray(num_engines=2, trainer_ranks=8, colocate=True), four) == []


def settings_for(**cluster: Any) -> MilesSettings:
    return MilesSettings.model_validate({"cluster": cluster, "rollout": {"engine": {"name": "sglang"}}})


def test_host_problems_name_the_field_and_the_install_line() -> None:
    options = SGLangEngineSettings(tp_size=2)
    missing = host_problems(options, settings_for(device="cuda", num_engines=1), installed=False, gpus=3)
    assert missing == [f"rollout.engine: 'sglang' is selected but SGLang is not installed: {INSTALL_LINE}"]
    assert 'pip install "miles-sglang[sglang]"' in INSTALL_LINE
    (none,) = host_problems(options, settings_for(device="cuda"), installed=True, gpus=0)
    assert "this host has no CUDA GPU" in none
    (few,) = host_problems(options, settings_for(device="cuda", num_engines=2), installed=True, gpus=4)
    assert (
        few
        == "cluster.num_engines: 2 engines x rollout.engine.tp_size 2 + 1 trainer ranks need 5 GPUs; this host has 4"
    )
    assert host_problems(options, settings_for(device="cuda", num_engines=2), installed=True, gpus=5) == []
    shared = settings_for(device="cuda", num_engines=2, colocate=True)
    assert host_problems(options, shared, installed=True, gpus=4) == []
    (few,) = host_problems(options, shared, installed=True, gpus=3)
    assert "sharing the trainer ranks' GPUs need 4 GPUs; this host has 3" in few


def test_build_run_refuses_sglang_on_this_host() -> None:
    """What this host really has: no CUDA GPU (and SGLang only in the protocol env)."""
    from miles.compose import build_run

    with pytest.raises(SettingsError) as info:
        build_run(settings_for(device="cuda", num_engines=1))
    message = str(info.value)
    assert "this host has no CUDA GPU" in message
    assert (INSTALL_LINE in message) is (not sglang_installed())


def test_miles_train_stops_before_anything_starts(tmp_path: Path) -> None:
    from miles.testing.models import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", "qwen2", seed=0)
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "hi", "label": "x"}) + "\n")
    run_dir = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text(
        f'[cluster]\ndevice = "cuda"\n[rollout.engine]\nname = "sglang"\n'
        f'[data]\npath = "{data}"\n[train]\nmodel_path = "{model}"\n[log]\nrun_dir = "{run_dir}"\n'
    )
    miles = Path(sys.executable).with_name("miles")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(miles), "train", str(config)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "this host has no CUDA GPU" in proc.stdout + proc.stderr
    assert ('pip install "miles-sglang[sglang]"' in proc.stderr) is (not sglang_installed())  # printed as written
    assert not (run_dir / "logs").exists()  # no process was started


def test_the_run_keys_reach_sglang_through_the_environment_only() -> None:
    """``miles_sglang.serve`` runs ``sglang.launch_server`` with ``--api-key`` / ``--admin-api-key`` from
    ``MILES_API_KEY`` / ``MILES_ADMIN_API_KEY`` (issue 46): the launch command holds no key, and what the
    process logs has the keys redacted (SGLang 0.5.23 logs its arguments, keys included)."""
    import logging

    from miles.auth import ServiceKeys
    from miles_sglang.serve import _redact_records, key_argv, keyed_launch

    argv = launch(SGLangEngineSettings())
    assert argv[1:3] == ["-m", "miles_sglang.serve"] and "--api-key" not in argv
    assert keyed_launch([PY, "-m", "sglang.launch_server", "--port", "1"]) == [
        PY,
        "-m",
        "miles_sglang.serve",
        "--port",
        "1",
    ]
    assert key_argv(ServiceKeys("k1")) == ["--api-key=k1"] and key_argv(ServiceKeys()) == []
    before = logging.getLogRecordFactory()
    try:
        _redact_records(["k1", "a2"])
        record = logging.getLogger("sglang").makeRecord(
            "sglang", logging.INFO, "f", 1, "server_args=%s", ({"api_key": "k1", "admin_api_key": "a2"},), None
        )
        assert record.getMessage() == "server_args={'api_key': '<redacted>', 'admin_api_key': '<redacted>'}"
    finally:
        logging.setLogRecordFactory(before)
