"""The viewer's data and routes over a run directory written the way a run writes it (samples JSONL, the
trainer's logprobs, metrics), with a real tokenizer: tokens decoded one by one, turns split at the loss
mask, trainer logprobs attached per token, steps and curves summarised."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from miles.types import Sample, SampleStatus, WeightSpan
from miles.viewer.app import create_app
from miles.viewer.data import RunData


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from miles.testing.models import build_tiny_model

    root = tmp_path_factory.mktemp("viewed")
    model = build_tiny_model(root / "model", "qwen2", seed=0)
    run = root / "run"
    (run / "samples").mkdir(parents=True)
    (run / "settings.json").write_text(json.dumps({"train": {"model_path": str(model)}}))
    episode = Sample(
        prompt_ids=[5, 6, 7],
        response_ids=[20, 21, 13, 14, 22],
        rollout_logprobs=[-0.5, -1.0, 0.0, 0.0, -2.0],
        loss_mask=[1, 1, 0, 0, 1],
        reward=1.0,
        reward_parts={"exact_match": 1.0},
        status=SampleStatus.COMPLETED,
        group_id=3,
        index=1,
        label="12",
        weight_versions=[WeightSpan(0, 5, 2)],
    )
    plain = Sample(prompt_ids=[5], response_ids=[30], rollout_logprobs=[-0.1], loss_mask=[1], reward=0.0, group_id=3)
    plain.status = SampleStatus.TRUNCATED
    (run / "samples" / "rollout_000002.jsonl").write_text(plain.to_json() + "\n" + episode.to_json() + "\n")
    (run / "samples" / "rollout_000001.jsonl").write_text(plain.to_json() + "\n")
    (run / "samples" / "trainer_logprobs_000002.jsonl").write_text(
        json.dumps({"group_id": 3, "index": 1, "logprobs": [-0.5, -1.001, -9.0, -9.0, -2.0]}) + "\n"
    )
    rows = [
        {"step": 1, "rollout/reward_mean": 0.25},
        {"step": 2, "rollout/reward_mean": 0.5, "fidelity/train_rollout_logprob_abs_diff": 3e-4},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "roll')
    return run


def test_a_step_is_shown_token_by_token(run_dir: Path) -> None:
    data = RunData(run_dir)
    step = data.step(2)
    assert step["has_trainer_logprobs"] and [g["group_id"] for g in step["groups"]] == [3]
    plain, episode = step["groups"][0]["samples"]
    assert plain["status"] == "truncated" and plain["turns"][0]["by"] == "policy"
    assert episode["reward"] == 1.0 and episode["label"] == "12" and episode["masked_tokens"] == 2
    assert [t["by"] for t in episode["turns"]] == ["policy", "environment", "policy"]
    first, tool, last = episode["turns"]
    assert [t["id"] for t in last["tokens"]] == [22]
    assert [t["id"] for t in first["tokens"]] == [20, 21] and [t["m"] for t in tool["tokens"]] == [0, 0]
    assert first["tokens"][1]["tlp"] == -1.001 and first["tokens"][1]["lp"] == -1.0
    tokenizer = data.tokenizer()
    assert first["tokens"][0]["t"] == tokenizer.decode([20]) and episode["prompt"] == "".join(
        tokenizer.decode([t]) for t in [5, 6, 7]
    )
    assert "tlp" not in plain["turns"][0]["tokens"][0]  # no trainer logprobs recorded for it


def test_the_summary_and_the_routes(run_dir: Path) -> None:
    client = TestClient(create_app(RunData(run_dir)))
    summary = client.get("/api/run").json()
    assert [s["step"] for s in summary["steps"]] == [1, 2]
    assert summary["steps"][1] == {"step": 2, "reward_mean": 0.5, "logprob_diff": 3e-4, "has_trainer_logprobs": True}
    assert summary["curves"]["rollout/reward_mean"] == [[1.0, 0.25], [2.0, 0.5]]  # the half-written line skipped
    assert client.get("/api/steps/2").json()["step"] == 2
    missing = client.get("/api/steps/9")
    assert missing.status_code == 404 and "no samples for step 9" in missing.json()["detail"]
    page = client.get("/")
    assert page.status_code == 200 and "miles view" in page.text and "/api/run" in page.text
    with pytest.raises(FileNotFoundError, match="no such run directory"):
        RunData(run_dir / "nope")
