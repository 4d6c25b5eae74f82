"""``miles train`` with ``transport = p2p``: the driver attaches the fsdp trainer, two trainer ranks push
their shards to two engines after every GRPO step, every push is verified from randomized engine weights.
With a low-precision recipe each rank sends the quantized values and scales of its own rows: FP8 blocks of
128 rows straddle the two ranks (32 or 64 rows each), NVFP4's per-tensor scale comes from both ranks'
maxima."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


_TORCHAO = importlib.util.find_spec("torchao") is not None
_QUANT = pytest.mark.skipif(not _TORCHAO, reason="torchao (miles-core[quant]) is not installed")


@pytest.mark.parametrize(
    ("datapath", "precision"),
    [  # the torch data path in fp32: test_transport.py
        ("shm", "fp32"),
        pytest.param("shm", "fp8", marks=_QUANT),
        pytest.param("torch", "nvfp4", marks=_QUANT),
    ],
)
def test_grpo_run_pushes_every_step_through_p2p(tmp_path: Path, datapath: str, precision: str) -> None:
    from miles.testing.models import build_tiny_model

    model = build_tiny_model(tmp_path / "model", "qwen2", seed=0)
    data = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "label": str(a + b)}
        for a in range(4)
        for b in range(4)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text(
        textwrap.dedent(
            f"""
            [cluster]
            trainer_ranks = 2
            num_engines = 2

            [data]
            path = "{data}"

            [rollout]
            rollout_batch_size = 2
            n_samples_per_prompt = 4
            max_new_tokens = 6

            [rollout.engine]
            name = "local"
            enable_debug_endpoints = true
            attention_backend = "sdpa"

            [train]
            model_path = "{model}"
            num_rollouts = 2
            global_batch_size = 8
            lr = 1e-3

            [precision]
            name = "{precision}"

            [algorithm]
            name = "grpo"

            [[reward.functions]]
            name = "length_penalty"
            max_length = 6
            buffer_length = 4
            mode = "linear"

            [transport]
            name = "p2p"
            datapath = "{datapath}"
            randomize_engines_first = true

            [log]
            run_dir = "{run_dir}"

            [checkpoint]
            save_final = false
            export_hf = false
            """
        )
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "miles", "train", str(config)], capture_output=True, text=True, env=env, timeout=900
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["weight_sync/verified"] for m in metrics] == [1.0, 1.0]
    for m in metrics:
        assert m["weight_sync/verified_tensors"] > 0 and m["weight_sync/chunks"] > 0
        assert m["weight_sync/bytes"] > 0
    assert "weight_sync/plan_seconds" in metrics[0] and "weight_sync/plan_seconds" not in metrics[1]
    log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert "p2p transport: session" in log and "plan" in log
    engine_log = (run_dir / "logs" / "engine-0.log").read_text()
    if precision != "fp32":  # the engines hold and compute with the quantized weights the ranks sent
        fmt = "fp8_block" if precision == "fp8" else precision
        assert f"quantization {fmt!r}: 14 projections hold" in engine_log, engine_log[-2000:]
        # 2 layers x 7 projections: values + scale (nvfp4: + the per-tensor scale) beside the bf16 tensors
        quantized = [m["weight_sync/verified_tensors"] for m in metrics]
        assert quantized[0] == quantized[1] and quantized[0] >= 14 * (3 if precision == "nvfp4" else 2)
    assert not list(Path("/dev/shm").glob("miles-p2p-*"))
