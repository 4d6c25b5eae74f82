"""End to end: the signal checks (issue 40) fire on planted faults in one ``miles train`` run, and stay
quiet on a healthy one (``test_distill.py`` asserts that side). The faults: the teacher is a tiny model whose
final norm is zero (its logits are all 0: uniform logprobs, like a frozen teacher answering for every
token), the reward is a format reward whose pattern cannot match (constant), and the learning rate is so
small that no fp32 weight moves (the engines' logprobs of the probe stay bit for bit the same after every
push while the step had a gradient)."""

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
    import torch
    from safetensors.torch import load_file, save_file

    from miles.testing.models import build_tiny_model

    root = tmp_path_factory.mktemp("signal-models")
    dead = build_tiny_model(root / "dead-teacher", "qwen2", seed=1)
    weights = load_file(dead / "model.safetensors")
    weights["model.norm.weight"] = torch.zeros_like(weights["model.norm.weight"])
    save_file(weights, dead / "model.safetensors", metadata={"format": "pt"})
    return build_tiny_model(root / "student", "qwen2", seed=0), dead


@pytest.fixture(scope="module")
def dead_teacher(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    with EngineProcess(models[1], log_path=tmp_path_factory.mktemp("logs") / "teacher.log") as engine:
        yield engine


def test_planted_faults_fire_their_signal_checks(
    tmp_path: Path, models: tuple[Path, Path], dead_teacher: EngineProcess
) -> None:
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + 3?"}], "label": str(a + 3)} for a in range(8)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text(
        textwrap.dedent(
            f"""
            [data]
            path = "{data}"

            [rollout]
            rollout_batch_size = 2
            n_samples_per_prompt = 2
            max_new_tokens = 6

            [rollout.teacher]
            url = "{dead_teacher.url}"
            top_k = 4

            [train]
            model_path = "{models[0]}"
            num_rollouts = 3
            lr = 1e-30

            [algorithm]
            name = "distill"
            distill_mode = "topk"
            distill_topk = 4

            [[reward.functions]]
            name = "regex"
            pattern = "(?!)"

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
    for m in metrics:
        assert m["signals/teacher_logprobs_uniform"] == m["signals/teacher_logprobs_constant"] == 1.0
        assert m["signals/reward_constant"] == 1.0
        assert m["train/grad_norm"] > 0.0
    for m in metrics:  # (step 1 against the probe taken before it, of the initial weights)
        assert m["signals/probe_logprob_change"] == 0.0 and m["signals/probe_unchanged"] == 1.0
    log = (run_dir / "logs" / "trainer-0.log").read_text()
    for check in ("teacher_logprobs_uniform", "reward_constant", "probe_unchanged"):
        assert f"signal check {check}:" in log, check
