"""End to end: ``miles train`` with top-k on-policy distillation. A second tiny model (same tokenizer,
other weights) is the teacher, served by its own engine process; the run's rollout manager scores every
sample against it and the fsdp trainer trains on the top-k reverse KL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles.testing.engine import EngineProcess

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from miles.testing.models import build_tiny_model

    root = tmp_path_factory.mktemp("distill-models")
    return build_tiny_model(root / "student", "qwen2", seed=0), build_tiny_model(root / "teacher", "qwen2", seed=1)


@pytest.fixture(scope="module")
def teacher(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    with EngineProcess(models[1], log_path=tmp_path_factory.mktemp("logs") / "teacher.log") as engine:
        yield engine


def test_topk_distillation_trains_against_a_teacher_server(
    tmp_path: Path, models: tuple[Path, Path], teacher: EngineProcess
) -> None:
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + 3?"}], "label": str(a + 3)} for a in range(8)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
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
            n_samples_per_prompt = 2
            max_new_tokens = 6
            temperature = 1.0

            [rollout.teacher]
            url = "{teacher.url}"
            top_k = 4

            [train]
            model_path = "{models[0]}"
            num_rollouts = 3
            lr = 5e-3

            [algorithm]
            name = "distill"
            distill_mode = "topk"
            distill_topk = 4

            [[reward.functions]]
            name = "length_penalty"
            max_length = 6
            buffer_length = 4
            mode = "linear"

            # (every response has all 6 tokens: the length reward alone is constant; whether a response has
            # an "o" varies within each of the three steps of this seeded run)
            [[reward.functions]]
            name = "regex"
            pattern = "o"

            [log]
            run_dir = "{run_dir}"
            """
        )
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "miles", "train", str(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    keys = [k for k in metrics[0] if k.endswith("distill_topk_reverse_kl")]
    assert keys, sorted(metrics[0])
    values = [m[keys[0]] for m in metrics]
    assert all(0.0 < v < 50.0 for v in values)  # a KL between different models, finite
    # a healthy run: every signal check measured, none fired (test_signals.py plants the faults)
    for m in metrics:
        assert m["signals/teacher_logprobs_uniform"] == m["signals/teacher_logprobs_constant"] == 0.0
        assert m["signals/reward_constant"] == 0.0
    assert all(m["signals/probe_unchanged"] == 0.0 and m["signals/probe_logprob_change"] > 0.0 for m in metrics)
    assert "signal check" not in (run_dir / "logs" / "trainer-0.log").read_text()
    norms = [k for k in metrics[0] if k.endswith("grad_norm")]
    assert norms and all(m[norms[0]] > 0.0 for m in metrics)
    # the exported policy moved away from the initial weights
    import torch
    from safetensors.torch import load_file

    before = {k: v for f in sorted(models[0].glob("*.safetensors")) for k, v in load_file(f).items()}
    after = {k: v for f in sorted((run_dir / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)
