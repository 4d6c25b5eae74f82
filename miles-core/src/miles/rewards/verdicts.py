"""Reading a judge's verdict: a number or a label out of a generative model's answer.

A judge answers free text ("Score: 7", "The answer is correct. Verdict: yes"). :class:`VerdictParser` finds the
verdict in it — the first group of ``pattern`` (or all of it), then the first number, or the first of the
``labels`` named there (whole words, any case) — and checks it against ``score_range``. An answer that holds no
verdict raises :class:`VerdictError` with the answer quoted: the reward scoring turns it into a failed sample
with that reason, never a made-up score.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["TEMPLATE_FIELDS", "VerdictError", "VerdictParser", "check_template"]

TEMPLATE_FIELDS = ("prompt", "response", "label")
"""What a judge template may name: ``{prompt}``, ``{response}``, ``{label}``."""

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


class VerdictError(ValueError):
    """A judge's answer that holds no verdict (or one outside the score range)."""


def check_template(template: str) -> str:
    """``template`` if it is a valid :meth:`str.format` template naming only :data:`TEMPLATE_FIELDS` and at
    least ``{response}``; else :class:`ValueError` saying what is wrong."""
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as exc:
        raise ValueError(f"not a format template ({exc}); write a literal brace as {{{{ or }}}}") from None
    unknown = sorted(n for n in names if n not in TEMPLATE_FIELDS)
    if unknown:
        raise ValueError(
            f"names {', '.join('{' + n + '}' for n in unknown)}; a template may name {{prompt}}, {{response}} "
            "and {label} (a literal brace is {{ or }})"
        )
    if "response" not in names:
        raise ValueError("does not name {response}: the judge would never see what it judges")
    return template


@dataclass(frozen=True)
class VerdictParser:
    """How a verdict is read from a judge's answer.

    :param labels: verdicts as words and their scores (``{"yes": 1, "no": 0}``); ``None``: a number.
    :param pattern: a regular expression whose first group (or whole match) holds the verdict.
    :param score_range: the numbers a verdict may be (inclusive); ``None``: any finite number.
    :param normalize: map ``score_range`` onto ``[0, 1]``.
    """

    labels: Mapping[str, float] | None = None
    pattern: str | None = None
    score_range: tuple[float, float] | None = None
    normalize: bool = False
    _labels: re.Pattern[str] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.labels:
            words = sorted(self.labels, key=len, reverse=True)  # "not bad" before "bad"
            alternatives = "|".join(re.escape(w) for w in words)
            object.__setattr__(self, "_labels", re.compile(rf"(?<!\w)(?:{alternatives})(?!\w)", re.IGNORECASE))

    def parse(self, answer: str) -> float:
        """The score of ``answer``; :class:`VerdictError` (quoting it) when it holds no valid verdict."""
        quoted = repr(answer[:200] + ("..." if len(answer) > 200 else ""))
        text = answer
        if self.pattern is not None:
            match = re.search(self.pattern, answer, re.DOTALL)
            if match is None:
                raise VerdictError(f"the judge's answer {quoted} does not match pattern {self.pattern!r}")
            text = match.group(1) if match.groups() else match.group(0)
            text = text or ""
        if self._labels is not None:
            assert self.labels is not None
            found = self._labels.search(text)
            if found is None:
                raise VerdictError(f"the judge's answer {quoted} names none of the labels {', '.join(self.labels)}")
            lowered = {k.lower(): v for k, v in self.labels.items()}
            return float(lowered[found.group(0).lower()])
        number = _NUMBER.search(text)
        if number is None:
            raise VerdictError(f"the judge's answer {quoted} holds no number")
        value = float(number.group(0))
        if not math.isfinite(value):
            raise VerdictError(f"the judge's answer {quoted} gives {value}, not a finite number")
        if self.score_range is not None:
            low, high = self.score_range
            if not low <= value <= high:
                raise VerdictError(f"the judge's verdict {value:g} (answer {quoted}) is outside [{low:g}, {high:g}]")
            if self.normalize:
                value = (value - low) / (high - low)
        return value
