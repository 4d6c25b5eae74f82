"""``miles train`` with the low-precision rollout recipes (GRPO, fsdp trainer in bf16 over fp32 master
weights, one local engine launched with the recipe's ``quantization``): every push carries the quantized
bytes and scales, through a different transport per recipe, and is verified against randomized engine
weights; the engine computes with them (``_scaled_mm`` for FP8 per-row, dequantize-then-matmul for MXFP8
and NVFP4)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torchao", reason="torchao (miles-core[quant]) is not installed")

pytestmark = pytest.mark.slow

CASES = [
    # precision table, transport, what the engine log says it computes with
    ('name = "fp8"\ngranularity = "row"', "broadcast", "compute by torch._scaled_mm"),
    ('name = "fp8"', "broadcast", "compute by dequantize-then-matmul"),  # k/v_proj: 64 rows, a partial block
    ('name = "mxfp8"', "disk", "compute by dequantize-then-matmul"),
    ('name = "nvfp4"', "disk_delta", "compute by dequantize-then-matmul"),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from miles.testing.models import build_tiny_model

    root = tmp_path_factory.mktemp("precision-e2e")
    model = build_tiny_model(root / "model", "qwen2", seed=0, hidden_size=128, intermediate_size=256)
    data = root / "prompts.jsonl"
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "label": str(a + b)}
        for a in range(4)
        for b in range(4)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, data


@pytest.mark.parametrize(("precision", "transport", "compute"), CASES, ids=["fp8-row", "fp8-block", "mxfp8", "nvfp4"])
def test_grpo_with_quantized_rollout_weights(
    tmp_path: Path, tiny: tuple[Path, Path], precision: str, transport: str, compute: str
) -> None:
    model, data = tiny
    run_dir = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text(
        textwrap.dedent(
            f"""
            [cluster]
            trainer_ranks = 1
            num_engines = 1

            [data]
            path = "{data}"

            [rollout]
            rollout_batch_size = 2
            n_samples_per_prompt = 4
            max_new_tokens = 4

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
            {{precision}}

            [algorithm]
            name = "grpo"

            [[reward.functions]]
            name = "length_penalty"
            max_length = 4
            buffer_length = 2
            mode = "linear"

            [transport]
            name = "{transport}"
            randomize_engines_first = true

            [log]
            run_dir = "{run_dir}"

            [checkpoint]
            save_final = false
            export_hf = false
            """
        ).replace("{precision}", precision)
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "miles", "train", str(config)], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    for row in metrics:
        assert row["weight_sync/verified"] == 1.0
        # 27 tensors (2 layers x 7 projections, 3 biases, 2 norms; embeddings, norm, lm_head) + a scale per
        # projection (nvfp4: + a per-tensor scale)
        assert row["weight_sync/verified_tensors"] == 27 + 14 + (14 if "nvfp4" in precision else 0)
        assert 0.0 < row["fidelity/train_rollout_logprob_abs_diff"] < 0.5
    engine_log = "".join(p.read_text() for p in (run_dir / "logs").glob("engine*.log"))
    assert compute in engine_log, engine_log[-2000:]
