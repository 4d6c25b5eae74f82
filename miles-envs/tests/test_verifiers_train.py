"""A multi-turn verifiers environment trained for real: ``miles train`` on the tiny model with the verifiers data
source, rollout function and reward. The environment's own episode (two turns, the second asked by the
environment) runs through the TITO session server the run starts; GRPO trains on the session's exact tokens. The
rubric's group-level function (``shortest``) scores each GRPO group's episodes together."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verifiers")
pytest.importorskip("miles_fsdp")

from miles.testing.runs import children_of_run, read_metrics, tiny_model  # noqa: F401  (fixture)
from miles.types import Sample

ROOT = Path(__file__).resolve().parents[2]


def _last_reply(messages: list[dict[str, str]]) -> str:
    replies = [m for m in messages if m.get("role") == "assistant"]
    return str(replies[-1].get("content") or "") if replies else ""


@pytest.mark.slow
def test_grpo_on_a_two_turn_verifiers_environment(tmp_path: Path, tiny_model: Path) -> None:  # noqa: F811
    # the example run, as a reader runs it from the repository root, on this module's tiny model
    config = ROOT / "examples" / "verifiers" / "grpo_tiny_verifiers.toml"
    run_dir = tmp_path / "run"
    # float32: the check of trainer / engine agreement below is to float32 rounding on every machine
    overrides = [f"train.model_path={tiny_model}", f"log.run_dir={run_dir}", "precision=fp32"]
    out = subprocess.run(
        [sys.executable, "-m", "miles", "train", str(config), *(a for o in overrides for a in ("--set", o))],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = read_metrics(run_dir)
    # the session server's live check at start: a session's tokens and logprobs equal a direct /generate
    log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert "live check passed: 3 turns equal a direct /generate" in log
    assert "HTTP Request:" not in log  # the episodes' openai client (httpx2) does not log every turn
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        # no turn of any episode re-rendered the history: the tokens trained on are the tokens sampled
        assert row["sessions/episodes"] == 8 and row["sessions/append_only_violations"] == 0
        assert row["sessions/branches"] == 0
        assert 0 < row["sessions/masked_fraction"] < 1  # the environment's turn is in the sample, masked
        assert row["weight_sync/verified"] == 1.0
        assert 0.0 <= row["fidelity/train_rollout_logprob_abs_diff"] < 1e-4
        # the rubric's score is the reward, each function a part
        for part in ("correct", "brief", "shortest", "num_turns"):
            assert f"reward/verifiers/{part}/mean" in row
        assert 1.0 <= row["reward/verifiers/num_turns/mean"] <= 2.0
        assert row["verifiers/error_fraction"] <= 1.0
    steps = []
    for step in (1, 2):
        lines = (run_dir / "samples" / f"rollout_{step:06d}.jsonl").read_text().splitlines()
        samples = [Sample.from_json(x) for x in lines]
        assert len(samples) == 8
        steps.append(samples)
        for s in samples:
            s.validate()
            info = s.metadata["verifiers"]
            parts = {k.removeprefix("verifiers/"): v for k, v in s.reward_parts.items() if "/" in k}
            # the rubric's weights, its group function's value included
            assert s.reward == pytest.approx(parts["correct"] + 0.5 * parts["brief"] + 0.25 * parts["shortest"])
            assert "pending" not in info and info["reward"] == pytest.approx(s.reward)
            assert parts["num_turns"] == info["turns"] == s.metadata["session"]["turns"]
            # loss mask 1 exactly on what the policy sampled: every token of the environment's turn is 0
            mask = [0] * s.response_length
            for a, b in s.metadata["session"]["policy_spans"]:
                mask[a:b] = [1] * (b - a)
            assert s.loss_mask == mask
            messages = s.metadata["messages"]
            assert messages[0] == {"role": "system", "content": "Answer with a number."}
            if info["turns"] == 2:  # the environment asked the follow-up: its tokens are in the response, masked
                follow = next(m for m in messages[2:] if m["role"] == "user")
                assert "Now add one" in follow["content"]
                first_end, second_start = s.metadata["session"]["policy_spans"][0][1], s.request_spans[1][0]
                assert second_start > first_end and not any(s.loss_mask[first_end:second_start])
                assert "Now add one" in s.response
        # the group function saw the whole group: 1 exactly for the group's shortest last replies
        groups: dict[int, list[Sample]] = {}
        for s in samples:
            groups.setdefault(s.group_id, []).append(s)
        assert sorted(len(g) for g in groups.values()) == [4, 4]
        for group in groups.values():
            scored = [s for s in group if s.reward is not None]
            lengths = [len(_last_reply(s.metadata["messages"]).strip()) for s in scored]
            assert [s.reward_parts["verifiers/shortest"] for s in scored] == [float(n == min(lengths)) for n in lengths]
    assert any(s.metadata["verifiers"]["turns"] == 2 for samples in steps for s in samples)
    assert len({s.reward for samples in steps for s in samples}) > 1  # GRPO had different rewards to learn from
    assert children_of_run(run_dir) == []
    print(json.dumps({k: v for k, v in rows[-1].items() if k.startswith(("reward/verifiers", "verifiers/"))}))
