"""Rewards on the response text: ``math`` (boxed answer, symbolic equivalence), ``exact_match``,
``regex`` (format) and ``length_penalty`` (DAPO's soft overlong punishment or a linear length cost)."""

from __future__ import annotations

import asyncio
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator

from miles.components import ComponentSettings
from miles.rewards.answers import MATH_VERIFY, extract_boxed, math_equal, normalize_text
from miles.rewards.base import Reward, RewardOutput
from miles.types import Sample

__all__ = [
    "ExactMatchReward",
    "ExactMatchSettings",
    "LengthPenaltyReward",
    "LengthPenaltySettings",
    "MathReward",
    "MathSettings",
    "RegexReward",
    "RegexSettings",
    "reference_answers",
]


def reference_answers(sample: Sample, key: str | None) -> list[str]:
    """The reference answer(s) of ``sample.label``: a string, a number, a list of them, or a dict's ``key``.

    No label gives no references (the sample scores as incorrect, with a ``has_label`` part of 0); a dict
    label without ``key`` is a configuration error and raises.
    """
    label: Any = sample.label
    if isinstance(label, dict):
        if key is None or key not in label:
            raise ValueError(
                f"sample {sample.group_id}/{sample.index}: label is a dict without key {key!r} "
                f"(keys: {', '.join(map(str, label))}); set label_key"
            )
        label = label[key]
    if label is None:
        return []
    if isinstance(label, (list, tuple)):
        return [str(v) for v in label]
    return [str(label)]


def _compiles(value: str) -> str:
    try:
        re.compile(value)
    except re.error as exc:
        raise ValueError(f"pattern does not compile: {exc}") from None
    return value


RegexPattern = Annotated[str, AfterValidator(_compiles)]
"""A regular expression, checked to compile when the settings load."""


class MathSettings(ComponentSettings):
    """Settings of the ``math`` reward."""

    correct: float = 1.0
    """Reward of a response whose final answer equals the reference."""
    incorrect: float = 0.0
    """Reward of a response with a wrong final answer."""
    no_answer: float = 0.0
    """Reward of a response without a ``\\boxed{}`` answer (a format failure)."""
    label_key: str | None = "answer"
    """Key of the reference answer when the label is a dict."""
    float_rounding: int = Field(6, ge=0)
    """Decimal places numbers are rounded to before comparing."""


class MathReward(Reward[MathSettings]):
    """Math answer checking: the last ``\\boxed{}`` of the response against the label, by math-verify."""

    name = "math"
    requires = (MATH_VERIFY,)

    async def score(self, sample: Sample) -> RewardOutput:
        s = self.settings
        references = reference_answers(sample, s.label_key)
        answer = extract_boxed(sample.response)
        if answer is None:
            return RewardOutput(s.no_answer, {"has_answer": 0.0})
        if not references:
            return RewardOutput(s.incorrect, {"has_answer": 1.0, "has_label": 0.0})
        refs = [extract_boxed(r) or r for r in references]

        def check() -> bool:
            return any(math_equal(answer, ref, float_rounding=s.float_rounding) for ref in refs)

        ok = await asyncio.to_thread(check)
        return RewardOutput(s.correct if ok else s.incorrect, {"has_answer": 1.0})


class ExactMatchSettings(ComponentSettings):
    """Settings of the ``exact_match`` reward."""

    extract: Literal["none", "boxed", "last_line", "regex"] = "boxed"
    """What of the response is compared: all of it, the last ``\\boxed{}``, the last non-empty line, or
    the first group of ``pattern``."""
    pattern: RegexPattern | None = None
    """Regular expression whose first group (or whole match) is the answer, for ``extract = "regex"``."""
    case_sensitive: bool = False
    """Compare with case (whitespace is always collapsed, a trailing period dropped)."""
    label_key: str | None = "answer"
    """Key of the reference answer when the label is a dict."""
    correct: float = 1.0
    """Reward of a match."""
    incorrect: float = 0.0
    """Reward of a mismatch or of a response without an answer."""


class ExactMatchReward(Reward[ExactMatchSettings]):
    """Exact match of the (extracted) answer with the label, after whitespace / case normalisation."""

    name = "exact_match"

    def extract(self, text: str) -> str | None:
        s = self.settings
        if s.extract == "none":
            return text
        if s.extract == "boxed":
            return extract_boxed(text)
        if s.extract == "last_line":
            lines = [line for line in text.splitlines() if line.strip()]
            return lines[-1] if lines else None
        if s.pattern is None:
            raise ValueError("exact_match: extract = 'regex' needs pattern")
        match = re.search(s.pattern, text, flags=re.DOTALL)
        if match is None:
            return None
        return match.group(1) if match.groups() else match.group(0)

    async def score(self, sample: Sample) -> float:
        s = self.settings
        answer = self.extract(sample.response)
        if answer is None:
            return s.incorrect
        got = normalize_text(answer, case_sensitive=s.case_sensitive)
        refs = {normalize_text(r, case_sensitive=s.case_sensitive) for r in reference_answers(sample, s.label_key)}
        return s.correct if got in refs else s.incorrect


class RegexSettings(ComponentSettings):
    """Settings of the ``regex`` (format) reward."""

    pattern: RegexPattern
    """Regular expression the response must match (e.g. ``(?s)<think>.*</think>.*\\\\boxed\\{.+\\}``)."""
    mode: Literal["search", "fullmatch"] = "search"
    """``search``: anywhere in the response; ``fullmatch``: the whole (stripped) response."""
    ignore_case: bool = False
    """Match without case."""
    dotall: bool = True
    """``.`` also matches newlines."""
    match_reward: float = 1.0
    """Reward when the response matches."""
    no_match_reward: float = 0.0
    """Reward when it does not."""


class RegexReward(Reward[RegexSettings]):
    """Format reward: whether the response matches a regular expression."""

    name = "regex"

    def __init__(self, settings: RegexSettings) -> None:
        super().__init__(settings)
        flags = (re.IGNORECASE if settings.ignore_case else 0) | (re.DOTALL if settings.dotall else 0)
        self._regex = re.compile(settings.pattern, flags)

    async def score(self, sample: Sample) -> float:
        s = self.settings
        text = sample.response
        matched = self._regex.fullmatch(text.strip()) if s.mode == "fullmatch" else self._regex.search(text)
        return s.match_reward if matched else s.no_match_reward


class LengthPenaltySettings(ComponentSettings):
    """Settings of the ``length_penalty`` reward (in response tokens)."""

    max_length: int = Field(..., ge=1)
    """The generation budget in tokens."""
    buffer_length: int = Field(0, ge=0)
    """``overlong`` mode: the penalty ramps from 0 at ``max_length - buffer_length`` tokens to
    ``-penalty`` at ``max_length`` (DAPO's soft overlong punishment). ``linear`` mode ignores it."""
    penalty: float = Field(1.0, ge=0.0)
    """The largest penalty (a response of ``max_length`` tokens or more)."""
    mode: Literal["overlong", "linear"] = "overlong"
    """``overlong``: DAPO's ramp over the buffer; ``linear``: ``-penalty * min(length, max_length) / max_length``."""

    @field_validator("buffer_length")
    @classmethod
    def _fits(cls, value: int, info: Any) -> int:
        max_length = info.data.get("max_length")
        if max_length is not None and value > max_length:
            raise ValueError(f"buffer_length ({value}) must not exceed max_length ({max_length})")
        return value


class LengthPenaltyReward(Reward[LengthPenaltySettings]):
    """Length penalty (0 or negative), DAPO's soft overlong punishment by default."""

    name = "length_penalty"

    async def score(self, sample: Sample) -> float:
        from miles.algorithms.advantages import overlong_penalty

        s = self.settings
        n = sample.response_length
        if s.mode == "linear":
            return -s.penalty * min(n, s.max_length) / s.max_length
        return overlong_penalty(n, max_length=s.max_length, buffer_length=s.buffer_length, factor=s.penalty)
