"""Progress on the launching host: the rows of a growing metrics file, followed as they land, each step
handed on (to the contention check), and what a reward of 0 everywhere means, said once."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console

from miles.host.progress import ZeroRewardNote, follow_metrics


def test_a_reward_of_zero_everywhere_is_explained_once() -> None:
    note = ZeroRewardNote(after=2)
    zero = {"rollout/reward_mean": 0.0, "rollout/reward_std": 0.0}
    assert note.see({"step": 1, **zero}) is None
    said = note.see({"step": 2, **zero})
    assert said is not None and "every sample of the first 2 steps scored 0" in said and "random model" in said
    assert note.see({"step": 3, **zero}) is None  # once
    learning = ZeroRewardNote(after=2)
    assert learning.see({"step": 1, **zero}) is None
    assert learning.see({"step": 2, "rollout/reward_mean": 0.25, "rollout/reward_std": 0.4}) is None
    assert learning.see({"step": 3, **zero}) is None  # a run that scored once is not told


def test_follow_metrics_prints_each_step_and_hands_it_on(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    rows = [
        {"step": i, "rollout/reward_mean": 0.0, "rollout/reward_std": 0.0, "time/step_seconds": 1.5} for i in (1, 2)
    ]
    out = io.StringIO()
    steps: list[int] = []
    with follow_metrics(Console(file=out, width=200), path, 2, interval=0.05, on_step=steps.append):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = out.getvalue().splitlines()
    assert lines[0] == "step 1/2  reward 0.000  1.5 s/step"
    assert lines[1] == "step 2/2  reward 0.000  1.5 s/step"
    assert lines[2].startswith("note: every sample of the first 2 steps scored 0")
    assert steps == [1, 2]
    # without a console the steps are still handed on
    seen: list[int] = []
    with follow_metrics(None, path, 2, interval=0.05, on_step=seen.append), open(path, "a") as f:
        f.write(json.dumps({"step": 3}) + "\n")
    assert seen == [3]
