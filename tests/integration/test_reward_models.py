"""A GRPO run through ``miles train`` scored by reward models served for the run: a tiny classifier, a tiny
classifier with a zeroed head (a constant reward, flagged ``reward/<name>/degenerate``) and a tiny generative
judge on its own local engine, whose answers are a number for most samples and garbage for some (those
samples fail with the reason; the run goes on and trains on the others). Every server is a process the
launcher started and reaped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.testing.reward_models import build_modulo_judge, build_tiny_classifier
from miles.testing.runs import children_of_run, read_metrics, run_miles, write_run_config

pytestmark = pytest.mark.slow


def test_grpo_with_a_classifier_a_constant_classifier_and_a_judge(
    tmp_path: Path, tiny_model: Path, prompts: Path
) -> None:
    classifier = build_tiny_classifier(tmp_path / "classifier", seed=1)
    constant = build_tiny_classifier(tmp_path / "constant", seed=2, constant=True)
    judge = build_modulo_judge(tmp_path / "judge")
    run_dir = tmp_path / "run"
    rewards = f"""
    [reward]
    timeout = 120

    [[reward.functions]]
    name = "model"
    kind = "classifier"
    model_path = "{classifier}"

    [[reward.functions]]
    name = "model"
    kind = "classifier"
    model_path = "{constant}"
    weight = 0.5

    [[reward.functions]]
    name = "model"
    kind = "judge"
    model_path = "{judge}"
    template = "Q: {{prompt}} A: {{response}}"
    chat_template = false
    max_new_tokens = 1
    score_range = [0, 1]
    """
    # (the length reward of write_run_config is replaced: reward functions are appended, so override the list)
    config = write_run_config(tmp_path, tiny_model, prompts, run_dir, ranks=1, rollouts=2)
    text = config.read_text()
    head, _, tail = text.partition("[[reward.functions]]")
    tail = tail[tail.index("\n[transport]") :]
    config.write_text(head + tail + rewards.replace("\n    ", "\n"))

    out = run_miles("train", str(config))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["reward/model_2/degenerate"] == 1.0 and row["reward/model_2/mean"] == 0.0
        assert row["reward/model/degenerate"] == 0.0 and row["reward/model/std"] > 0.0
        assert 0.0 < row["rollout/failed_fraction"] < 1.0  # some garbage verdicts, not all
        assert row["train/grad_norm"] > 0.0  # it trained on the scored samples
    assert any(r["reward/model_3/degenerate"] == 0.0 for r in rows)  # the judge's numbers differ between samples
    files = sorted((run_dir / "samples").glob("rollout_*.jsonl"))
    samples = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    failed = [s for s in samples if s["status"] == "failed"]
    assert failed and all("reward 'model_3' raised VerdictError" in s["status_reason"] for s in failed)
    assert all("holds no number" in s["status_reason"] for s in failed)
    scored = [s for s in samples if s["status"] != "failed"]
    assert {s["reward_parts"]["model_3"] for s in scored} <= {0.0, 1.0}
    logs = sorted(p.name for p in (run_dir / "logs").glob("reward-*.log"))
    assert logs == ["reward-model.log", "reward-model_2.log", "reward-model_3.log"], logs
    settings = json.loads((run_dir / "settings.json").read_text())
    assert all(f["url"].startswith("http://127.0.0.1:") for f in settings["reward"]["functions"])
    assert children_of_run(tmp_path) == []  # (the reward servers' command lines name their models under tmp_path)
