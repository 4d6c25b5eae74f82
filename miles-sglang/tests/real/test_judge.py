"""A generative judge (``[[reward.functions]] name = "model"``, ``kind = "judge"``) on real SGLang 0.5.23 on
this CPU: the session's server (``conftest.server``, a tiny Llama) answers the judge's batched ``/generate``
(a list of token-id prompts, one answer each), every answer is SGLang's own greedy answer to that prompt
asked alone, and each verdict is read from it — a number, a label, or the sample fails with the answer
quoted."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest

from miles.rewards.model import ModelReward, RewardModelSettings
from miles.types import Sample

SAMPLES = [
    ("What is 2 + 3?", "5"),
    ("Name a colour.", "Blue, like the sky."),
    ("What is 7 * 6?", "It is 42."),
]


def judge(server: Any, model: Any, **extra: Any) -> ModelReward:
    settings = RewardModelSettings(
        kind="judge", model_path=str(model), url=server.url, engine={"name": "sglang"}, max_new_tokens=8, **extra
    )  # type: ignore[arg-type]
    return ModelReward(settings)


def score_all(reward: ModelReward, samples: list[Sample]) -> list[Any]:
    async def run() -> list[Any]:
        try:
            return await asyncio.gather(*(reward.score(s) for s in samples), return_exceptions=True)
        finally:
            await reward.close()

    return asyncio.run(run())


def samples() -> list[Sample]:
    return [Sample(prompt=p, response=r, prompt_ids=[1], response_ids=[2]) for p, r in SAMPLES]


def test_the_judge_is_answered_by_sglang_and_its_verdicts_read(server: Any, tiny_llamas: Any) -> None:
    from transformers import AutoTokenizer

    reward = judge(server, tiny_llamas.first, batch_size=8, batch_wait=0.5)  # one request for the three
    batch = samples()
    outcomes = score_all(reward, batch)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llamas.first)
    answers = []
    for sample, outcome in zip(batch, outcomes, strict=True):
        ids = reward.judge_prompt(sample, tokenizer)
        alone = server.post(
            "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
        )
        assert alone.status_code == 200, alone.text
        answer = alone.json()["text"]
        assert sample.metadata["judge_verdict"] == answer  # batched and alone: SGLang's greedy answer
        answers.append(answer)
        if isinstance(outcome, BaseException):  # (a random model rarely answers a number in [0, 10])
            assert repr(answer[:200])[1:-1] in str(outcome), (outcome, answer)
        else:
            assert outcome == reward.parser.parse(answer)
    words = [w for a in answers for w in re.findall(r"[A-Za-z]{2,}", a)]
    if not words:
        pytest.skip(f"the tiny judge answered no word to label: {answers}")
    # a labelled verdict: the first answer's word scores 1, the other labels 0
    labelled = judge(server, tiny_llamas.first, labels={words[0]: 1.0, "zzzqx": 0.0})
    batch = samples()
    outcomes = score_all(labelled, batch)
    first = next(i for i, a in enumerate(answers) if words[0] in a)
    assert outcomes[first] == 1.0, outcomes
