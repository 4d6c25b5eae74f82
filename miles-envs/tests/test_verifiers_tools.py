"""A verifiers tool environment (``vf.ToolEnv``) played through the session server against a real engine: the
tool definitions verifiers derives from a Python function reach the policy's chat template, the policy's tool
calls come back to verifiers parsed, the tool's results go into the session as tool messages, and none of
their tokens is trained on; how an environment's errors end an episode; and a rubric's group functions scoring
a group one of whose episodes failed. The policy is the test kit's tiny
model fine-tuned to call a calculator.
(``MILES_LONG_RUNS=1``: the engine and the tool model cost about a minute; the training test shows the
connector in the default run.)"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verifiers")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("MILES_LONG_RUNS") != "1", reason="an engine and the tool model: runs with MILES_LONG_RUNS=1"
    ),
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from miles.testing.engine import EngineProcess
    from miles.testing.tool_model import tool_model_for

    model = tool_model_for("qwen2.5")
    with EngineProcess(model, log_path=tmp_path_factory.mktemp("logs") / "engine.log") as proc:
        yield proc


class _Prompts:
    def __init__(self, prompts: list[Any]) -> None:
        self.prompts = prompts

    def next_batch(self, n: int) -> list[Any]:
        return self.prompts[:n]


def _rollout(engine: Any, env_file: Path, settings: Any, scorer: Any, seed: int) -> tuple[Any, Any]:
    """One rollout of ``env_file``'s first prompts (``settings.rollout_batch_size``) through the rollout manager
    and the ``verifiers`` rollout function against ``engine``: the result, and the policy's tokenizer."""
    from transformers import AutoTokenizer

    from miles.rollout.http_client import HttpEngineClient
    from miles.rollout.manager import RolloutManager
    from miles_envs.verifiers.data import VerifiersDataSource
    from miles_envs.verifiers.rollout import VERIFIERS_ROLLOUT

    tokenizer = AutoTokenizer.from_pretrained(Path(engine.model_path))
    source = VerifiersDataSource(VerifiersDataSource.Settings(), path=str(env_file), seed=0, shuffle=False)
    prompts = source.next_batch(settings.rollout_batch_size)
    for p in prompts:
        p.prompt_ids = tokenizer.apply_chat_template(
            p.prompt, add_generation_prompt=True, tokenize=True, return_dict=False
        )

    async def run() -> Any:
        async with HttpEngineClient([engine.url]) as client:
            manager = RolloutManager(client, settings, scorer=scorer, rollout_function=VERIFIERS_ROLLOUT, seed=seed)
            try:
                return await manager.rollout(_Prompts(prompts))
            finally:
                await manager.close()

    return asyncio.run(run()), tokenizer


def test_tool_environment_episodes_mask_every_tool_token(engine: Any, envs_dir: Path) -> None:
    from miles.rewards.scoring import score_samples
    from miles.settings.model import RolloutSettings
    from miles.types import Sample
    from miles_envs.verifiers.reward import VerifiersReward

    reward = VerifiersReward(VerifiersReward.Settings())

    async def score(samples: Sequence[Sample]) -> None:
        await score_samples(samples, [("verifiers", reward, 1.0)], timeout=60)

    settings = RolloutSettings(rollout_batch_size=2, n_samples_per_prompt=4, max_new_tokens=64, temperature=0.7)
    result, tokenizer = _rollout(engine, envs_dir / "calculator_tools.py", settings, score, seed=3)
    samples = result.samples
    assert len(samples) == 8
    calls = 0
    for s in samples:
        s.validate()
        assert s.metadata["session"]["append_only_violations"] == 0 and s.reward is not None
        info = s.metadata["verifiers"]
        assert info["turns"] == s.metadata["session"]["turns"] and info["error"] is None
        mask = [0] * s.response_length
        for a, b in s.metadata["session"]["policy_spans"]:
            mask[a:b] = [1] * (b - a)
        assert s.loss_mask == mask
        tools = [m for m in s.metadata["messages"] if m["role"] == "tool"]
        calls += len(tools)
        # verifiers' own count of the policy's tool calls is the session's, and the rubric's metric
        assert s.reward_parts["verifiers/total_tool_calls"] == s.metadata["session"]["tool_calls"] == len(tools)
        # each tool result lies in the tokens between the policy's turns (loss mask 0)
        spans = s.metadata["session"]["policy_spans"]
        gaps = [tokenizer.decode(s.response_ids[a:b]) for (_, a), (b, _) in pairwise(spans)]
        assert all(m["content"] in "".join(gaps) for m in tools) and len(gaps) == len(spans) - 1
    assert calls >= 4  # the policy really calls the tool that verifiers defined from a Python function
    assert result.metrics["sessions/append_only_violations"] == 0.0
    assert result.metrics["verifiers/error_fraction"] == 0.0


@pytest.mark.parametrize("kind", ["infra", "tool"])
def test_environment_errors_fail_the_sample_only_when_they_are_infrastructure(
    engine: Any, envs_dir: Path, kind: str
) -> None:
    """``vf.InfraError`` (a sandbox gone): the sample fails with the reason, the run goes on; any other error
    verifiers records (a tool that crashed): the episode ends as verifiers ends it and is scored."""
    from transformers import AutoTokenizer

    from miles.rollout.http_client import HttpEngineClient
    from miles.rollout.protocol import SamplingParams
    from miles.types import Sample, SampleStatus
    from miles_envs.verifiers.data import VerifiersDataSource
    from miles_envs.verifiers.rollout import VERIFIERS_ROLLOUT

    tokenizer = AutoTokenizer.from_pretrained(Path(engine.model_path))
    path = str(envs_dir / "failing.py")
    prompt = VerifiersDataSource(VerifiersDataSource.Settings(args={"kind": kind}), path=path, seed=0, shuffle=False)
    p = prompt.next_batch(1)[0]
    ids = tokenizer.apply_chat_template(p.prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
    sample = Sample(prompt_ids=ids, prompt_messages=p.messages, label=p.label, metadata=dict(p.metadata))

    async def run() -> Sample:
        async with HttpEngineClient([engine.url]) as client:
            try:
                return await VERIFIERS_ROLLOUT(client, sample, SamplingParams(max_new_tokens=8, sampling_seed=1))
            finally:
                await VERIFIERS_ROLLOUT.aclose()

    out = asyncio.run(run())
    if kind == "infra":
        assert out.status == SampleStatus.FAILED
        assert "SandboxError: the sandbox is gone" in out.status_reason and "failing.py" in out.status_reason
    else:
        assert out.status != SampleStatus.FAILED and out.response_ids
        info = out.metadata["verifiers"]
        assert info["error"] == "ToolCallError: the tool crashed" and info["stop_condition"] == "has_error"
        assert info["reward"] == 1.0 and info["turns"] == 1


def test_group_functions_score_the_group_without_its_failed_episode(engine: Any, envs_dir: Path) -> None:
    """One episode of the group fails (its sandbox is gone): it stays failed with the reason, and the rubric's
    group functions score the group's other episodes together, each sample's value depending on the others'."""
    from miles.rewards.scoring import RewardScorer
    from miles.settings.model import RolloutSettings
    from miles.types import SampleStatus
    from miles_envs.verifiers.groups import PENDING
    from miles_envs.verifiers.loading import forget_envs
    from miles_envs.verifiers.reward import VerifiersReward

    forget_envs()  # a fresh environment: its first episode to reach a second turn fails
    scorer = RewardScorer(
        [("verifiers", VerifiersReward(VerifiersReward.Settings()), 1.0)], timeout=60, max_concurrency=8
    )
    settings = RolloutSettings(rollout_batch_size=1, n_samples_per_prompt=4, max_new_tokens=16, temperature=1.0)
    try:
        samples = _rollout(engine, envs_dir / "grouped.py", settings, scorer, seed=5)[0].samples
    finally:
        forget_envs()
    assert len(samples) == 4
    failed = [s for s in samples if s.status == SampleStatus.FAILED]
    assert len(failed) == 1 and "SandboxError: the sandbox is gone" in failed[0].status_reason
    assert failed[0].reward is None and failed[0].reward_parts == {}
    scored = [s for s in samples if s.status != SampleStatus.FAILED]
    lengths = [sum(len(m["content"] or "") for m in s.metadata["messages"] if m["role"] == "assistant") for s in scored]
    for s, n in zip(scored, lengths, strict=True):
        parts = s.reward_parts
        assert parts["verifiers/group_size"] == 3.0  # the group functions saw the three episodes that reached scoring
        assert parts["verifiers/length_rank"] == float(sum(other < n for other in lengths))
        assert s.reward == pytest.approx(parts["verifiers/replied"] + 0.5 * parts["verifiers/length_rank"])
        assert s.metadata["verifiers"]["turns"] == 2 and "pending" not in s.metadata["verifiers"]
    assert len(PENDING) == 0  # every state was scored and cleaned up, the failed one's when it failed
