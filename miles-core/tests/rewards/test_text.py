"""The text rewards on real-format (chat-style) responses, with the numbers written out."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from miles.rewards.answers import extract_boxed, math_equal
from miles.rewards.base import RewardOutput
from miles.rewards.text import (
    ExactMatchReward,
    ExactMatchSettings,
    LengthPenaltyReward,
    LengthPenaltySettings,
    MathReward,
    MathSettings,
    RegexReward,
    RegexSettings,
)
from miles.testing import check_reward
from miles.types import Sample, SampleStatus

CHAT = (
    "<|im_start|>assistant\n<think>\n6 times 7: 6 * 7 = 42, and half of that is 21.\n</think>\n"
    "First, 6 x 7 = 42. Halving gives $\\frac{42}{2} = 21$.\n\nThe answer is $\\boxed{\\frac{42}{2}}$.<|im_end|>"
)


def sample(response: str, label: object = None, n_tokens: int = 5) -> Sample:
    return Sample(
        prompt_ids=[1, 2, 3],
        response_ids=list(range(n_tokens)),
        rollout_logprobs=[-1.0] * n_tokens,
        loss_mask=[1] * n_tokens,
        status=SampleStatus.COMPLETED,
        response=response,
        label=label,
    )


def score(reward: object, s: Sample) -> float | RewardOutput:
    return asyncio.run(reward.score(s))  # type: ignore[attr-defined]


def test_extract_boxed() -> None:
    assert extract_boxed(CHAT) == "\\frac{42}{2}"
    assert extract_boxed("a \\boxed{1} then \\boxed{\\sqrt{\\frac{3}{4}}} end") == "\\sqrt{\\frac{3}{4}}"
    assert extract_boxed("\\fbox{ 7 }") == "7"
    assert extract_boxed("no box here") is None
    assert extract_boxed("\\boxed{unclosed") is None
    assert extract_boxed("\\boxed{2} and \\boxed{unclosed") == "2"


def test_math_equal_is_symbolic() -> None:
    assert math_equal("\\frac{42}{2}", "21")
    assert math_equal("\\frac{1}{2}", "0.5")
    assert math_equal("2\\sqrt{2}", "\\sqrt{8}")
    assert math_equal("(x+1)^2", "x^2+2x+1")
    assert not math_equal("22", "21")
    assert not math_equal("\\frac{1}{3}", "0.33")


def test_math_reward_on_chat_answers() -> None:
    reward = MathReward(MathSettings())
    assert score(reward, sample(CHAT, "21")) == RewardOutput(1.0, {"has_answer": 1.0})
    assert score(reward, sample(CHAT, {"answer": "\\boxed{21}", "source": "gsm8k"})) == RewardOutput(
        1.0, {"has_answer": 1.0}
    )
    assert score(reward, sample(CHAT, ["20", "21"])) == RewardOutput(1.0, {"has_answer": 1.0})
    assert score(reward, sample(CHAT, 22)) == RewardOutput(0.0, {"has_answer": 1.0})
    no_box = CHAT.replace("$\\boxed{\\frac{42}{2}}$", "21")
    custom = MathReward(MathSettings(no_answer=-0.5, incorrect=-1.0))
    assert score(custom, sample(no_box, "21")) == RewardOutput(-0.5, {"has_answer": 0.0})
    assert score(custom, sample(CHAT, "22")) == RewardOutput(-1.0, {"has_answer": 1.0})
    assert score(reward, sample(CHAT, None)) == RewardOutput(0.0, {"has_answer": 1.0, "has_label": 0.0})
    with pytest.raises(ValueError, match="label_key"):
        score(reward, sample(CHAT, {"solution": "21"}))


def test_exact_match() -> None:
    boxed = ExactMatchReward(ExactMatchSettings())
    assert score(boxed, sample("The capital is \\boxed{ Paris }.", "paris")) == 1.0
    assert score(boxed, sample("The capital is \\boxed{Lyon}.", "paris")) == 0.0
    assert score(boxed, sample("Paris", "paris")) == 0.0  # no box, no answer
    case = ExactMatchReward(ExactMatchSettings(case_sensitive=True))
    assert score(case, sample("\\boxed{Paris}", "paris")) == 0.0
    last = ExactMatchReward(ExactMatchSettings(extract="last_line"))
    assert score(last, sample("Let me think.\n\n  Paris.  \n", "Paris")) == 1.0
    rx = ExactMatchReward(ExactMatchSettings(extract="regex", pattern=r"Answer:\s*(\w+)"))
    assert score(rx, sample("blah\nAnswer: B\n", {"answer": "b"})) == 1.0
    assert score(rx, sample("I am not sure", "b")) == 0.0
    whole = ExactMatchReward(ExactMatchSettings(extract="none"))
    assert score(whole, sample("  yes \n", "YES")) == 1.0
    with pytest.raises(ValidationError, match="pattern does not compile"):
        ExactMatchSettings(pattern="(unclosed")


def test_regex_format_reward() -> None:
    fmt = RegexReward(RegexSettings(pattern=r"<think>.+</think>.*\\boxed\{.+\}"))
    assert score(fmt, sample(CHAT)) == 1.0
    assert score(fmt, sample("The answer is \\boxed{21}")) == 0.0
    full = RegexReward(RegexSettings(pattern=r"[A-D]", mode="fullmatch", ignore_case=True, no_match_reward=-1.0))
    assert score(full, sample(" c\n")) == 1.0
    assert score(full, sample("C because")) == -1.0
    with pytest.raises(ValidationError, match="pattern does not compile"):
        RegexSettings(pattern="[")


def test_length_penalty() -> None:
    # DAPO: max 10, buffer 4 -> free up to 6 tokens, -0.25 per token after, -1 from 10 on
    overlong = LengthPenaltyReward(LengthPenaltySettings(max_length=10, buffer_length=4))
    assert [score(overlong, sample("x", n_tokens=n)) for n in (0, 6, 7, 8, 10, 15)] == [
        0.0,
        0.0,
        -0.25,
        -0.5,
        -1.0,
        -1.0,
    ]
    # linear: -0.5 * min(n, 10) / 10
    linear = LengthPenaltyReward(LengthPenaltySettings(max_length=10, penalty=0.5, mode="linear"))
    assert [score(linear, sample("x", n_tokens=n)) for n in (0, 4, 12)] == [0.0, -0.2, -0.5]
    with pytest.raises(ValidationError, match="buffer_length"):
        LengthPenaltySettings(max_length=4, buffer_length=5)


def test_conformance() -> None:
    assert check_reward(MathReward) == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert check_reward(ExactMatchReward) == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert check_reward(RegexReward, settings={"pattern": r"\d+"}) == [1.0, 0.0, 1.0, 0.0, 0.0]
    # the example responses have 8, 0, 6, 2 and 5 tokens; free up to 4, -0.5 per token after, -1 from 6 on
    assert check_reward(LengthPenaltyReward, settings={"max_length": 6, "buffer_length": 2}) == [
        -1.0,
        0.0,
        -1.0,
        0.0,
        -0.5,
    ]
