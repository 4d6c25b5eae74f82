"""Runs without a trainer's rollout: SFT on data rows with no engine (``miles train`` with an SFT algorithm), and
``miles generate`` writing token-exact samples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.testing.runs import children_of_run, read_metrics, run_miles, write_run_config

pytestmark = pytest.mark.slow


def test_sft_without_engines(tmp_path: Path, tiny_model: Path) -> None:
    data = tmp_path / "sft.jsonl"
    rows = [{"prompt": f"Say {w}.", "label": f"{w} {w} {w}"} for w in ["apple", "river", "stone", "cloud"] * 4]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "sft"
    config = write_run_config(tmp_path, tiny_model, data, run_dir, rollouts=4)
    text = config.read_text().replace("num_engines = 1", "num_engines = 0").replace('name = "grpo"', 'name = "sft"')
    text = text.replace("n_samples_per_prompt = 4", "n_samples_per_prompt = 2").replace(
        "global_batch_size = 8", "global_batch_size = 8"
    )
    config.write_text(text)
    out = run_miles(
        "train",
        str(config),
        "--set",
        "rollout.rollout_batch_size=8",
        "--set",
        "rollout.n_samples_per_prompt=1",
        "--set",
        "train.lr=3e-3",
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    losses = [r["train/loss"] for r in read_metrics(run_dir)]
    assert len(losses) == 4 and losses[-1] < losses[0]


def test_generate_writes_token_exact_samples(tmp_path: Path, tiny_model: Path, prompts: Path) -> None:
    run_dir = tmp_path / "gen"
    config = write_run_config(tmp_path, tiny_model, prompts, run_dir)
    out_file = tmp_path / "samples.jsonl"
    out = run_miles("generate", str(config), "--out", str(out_file), "--num-rollouts", "2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    from miles.types import Sample

    samples = [Sample.from_json(line) for line in out_file.read_text().splitlines()]
    assert len(samples) == 2 * 4 * 4
    for s in samples:
        s.validate()
        assert s.response_length > 0 and len(s.rollout_logprobs) == s.response_length
        assert s.reward is not None and s.weight_versions
    assert children_of_run(run_dir) == []

    out = run_miles("eval", str(config), "--data", str(prompts), "--k", "1", "--k", "4")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert 0.0 <= result["eval/pass@1"] <= result["eval/pass@4"] <= 1.0
