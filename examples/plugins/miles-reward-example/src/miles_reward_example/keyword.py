"""The ``keyword`` reward: the fraction of required keywords that appear in the response.

The keywords come from the reward's settings or, when those list none, from the sample's label (a
string, a list of strings, or a mapping holding such a list under ``label_field``). Useful for
instruction-following data ("mention X, Y and Z") and as a cheap shaping term next to a verifier.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import Field

from miles.components import ComponentSettings
from miles.rewards.base import Reward

if TYPE_CHECKING:
    from miles.types import Sample

__all__ = ["KeywordReward", "KeywordRewardSettings"]

log = logging.getLogger(__name__)


class KeywordRewardSettings(ComponentSettings):
    """Settings of the ``keyword`` reward (the other keys of a ``reward.functions`` entry)."""

    keywords: list[str] = Field(default_factory=list)
    """Keywords every response should contain; empty: take them from each sample's label."""
    case_sensitive: bool = False
    """Match keywords with their exact case (default: case-insensitive)."""
    whole_words: bool = True
    """Match whole words only, so ``cat`` does not match inside ``concatenate``."""
    label_field: str = "keywords"
    """When the label is a mapping, the key of its keyword list."""


class KeywordReward(Reward[KeywordRewardSettings]):
    """Fraction of required keywords present in the response (0.0 to 1.0)."""

    name = "keyword"

    def __init__(self, settings: KeywordRewardSettings) -> None:
        super().__init__(settings)
        self._fixed = self._patterns(settings.keywords) if settings.keywords else None

    def _patterns(self, keywords: Sequence[str]) -> list[re.Pattern[str]]:
        flags = 0 if self.settings.case_sensitive else re.IGNORECASE
        patterns = []
        for keyword in dict.fromkeys(k.strip() for k in keywords):  # de-duplicated, order kept
            if not keyword:
                continue
            body = re.escape(keyword)
            if self.settings.whole_words:
                body = rf"(?<!\w){body}(?!\w)"
            patterns.append(re.compile(body, flags))
        return patterns

    def keywords_of(self, sample: Sample) -> list[re.Pattern[str]]:
        """The compiled keyword patterns for ``sample`` (settings first, else its label)."""
        if self._fixed is not None:
            return self._fixed
        label: Any = sample.label
        if isinstance(label, Mapping):
            label = label.get(self.settings.label_field)
        if isinstance(label, str):
            label = [label]
        if not (isinstance(label, Sequence) and label and all(isinstance(k, str) for k in label)):
            raise ValueError(
                "keyword reward: no keywords for this sample; set `keywords` in the reward's settings or give "
                f"the sample a label that is a string or a list of strings (got {sample.label!r:.80})"
            )
        return self._patterns(label)

    async def score(self, sample: Sample) -> float:
        """The fraction of keywords found in ``sample.response``."""
        patterns = self.keywords_of(sample)
        if not patterns:
            raise ValueError("keyword reward: every keyword is blank")
        found = sum(1 for pattern in patterns if pattern.search(sample.response))
        return found / len(patterns)
