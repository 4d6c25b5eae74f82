"""The reasoning-gym example as a reader runs it, from the repository root: its settings resolved as ``miles train``
resolves them (the task generated from its seed, the verifier scoring a right and a wrong answer), and the run
itself — ``miles train examples/reasoning-gym/grpo_smollm2_arithmetic.toml`` on the tiny random model (built here,
as ``examples/tiny/build_model.py`` builds it) for two small GRPO steps: the generated tasks, the engine, the
task's verifier and the trainer in one loop. (A random model writes no ``<answer>`` tag: its reward is 0; the
SmolLM2 run the file names is the one that learns.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.testing.runs import read_metrics, run_miles, tiny_model  # noqa: F401  (a fixture)
from miles.types import Sample

pytest.importorskip("reasoning_gym")
pytest.importorskip("miles_fsdp")

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "reasoning-gym" / "grpo_smollm2_arithmetic.toml"


def test_the_reasoning_gym_example_is_a_valid_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its settings resolve as ``miles train`` resolves them; the tasks are one-digit sums and differences, and
    the reward is the task's own verifier (1 for the answer in its tag, 0 for another or none)."""
    import asyncio

    from miles.components import ComponentKind
    from miles.compose import build_run
    from miles.plugins.manager import PluginManager
    from miles.rewards.scoring import score_samples
    from miles.settings.loader import load_settings
    from miles.types import SampleStatus

    monkeypatch.chdir(ROOT)
    plugins = PluginManager(entry_points=False, disabled=(), only=())
    run = build_run(load_settings(CONFIG), plugins, kinds=[ComponentKind.DATA_SOURCE, ComponentKind.REWARD])
    source = run.data_source(None)  # type: ignore[attr-defined]
    assert len(source) == 512
    prompts = source.next_batch(8)
    samples = []
    for p in prompts:
        question = p.messages[0]["content"]
        assert question.startswith("Calculate ") and question.endswith("between <answer> and </answer>.")
        answer = p.label["answer"]
        assert abs(int(answer)) <= 18  # two one-digit terms
        responses = (f"so <answer>{answer}</answer>", f"<answer>{int(answer) + 1}</answer>", answer)
        samples += [
            Sample(prompt_ids=[1], response_ids=[2], status=SampleStatus.COMPLETED, response=r, label=p.label)
            for r in responses
        ]
    asyncio.run(score_samples(samples, run.rewards(), timeout=30.0))  # type: ignore[attr-defined]
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0] * 8


@pytest.mark.slow
def test_the_reasoning_gym_example_trains(tmp_path: Path, tiny_model: Path) -> None:  # noqa: F811
    run_dir = tmp_path / "run"
    small = {
        "train.model_path": f'"{tiny_model}"', "log.run_dir": f'"{run_dir}"', "train.num_rollouts": "2",
        "rollout.rollout_batch_size": "2", "rollout.n_samples_per_prompt": "4", "rollout.max_new_tokens": "8",
        "train.global_batch_size": "8", "train.lr": "1e-3",
    }  # fmt: skip
    sets = [arg for key, value in small.items() for arg in ("--set", f"{key}={value}")]
    out = run_miles("train", str(CONFIG), *sets, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["rollout/reward_reasoning_gym_mean"] == 0.0 and row["rollout/failed_fraction"] == 0.0
    lines = (run_dir / "samples" / "rollout_000002.jsonl").read_text().splitlines()
    assert len(lines) == 8
    for line in lines:
        s = Sample.from_json(line)
        s.validate()
        assert "Calculate " in s.prompt and "between <answer> and </answer>." in s.prompt  # the rendered chat
        assert s.label["entry"]["metadata"]["source_dataset"] == "basic_arithmetic"
        assert s.reward == 0.0 and s.reward_parts["reasoning_gym/has_answer"] == 0.0
    assert json.loads((run_dir / "settings.json").read_text())["data"]["source"]["name"] == "reasoning_gym"
