"""Answer extraction and mathematical equivalence, shared by the ``math`` and ``exact_match`` rewards.

Extraction finds the last ``\\boxed{...}`` (or ``\\fbox{...}``) of a response with balanced braces, the
way graders of MATH / GSM8K-style data do. Equivalence is decided by ``math-verify`` (Hugging Face's
LaTeX / expression parser on sympy): ``\\frac{1}{2}`` equals ``0.5``, ``2\\sqrt{2}`` equals ``\\sqrt{8}``;
it is an optional dependency (``pip install "miles-core[math]"``).
"""

from __future__ import annotations

import logging
import re

from miles.components import Requirement

__all__ = ["MATH_VERIFY", "extract_boxed", "math_equal", "normalize_text"]

MATH_VERIFY = Requirement("math_verify", extra="math", package="math-verify")
"""What :func:`math_equal` decides equivalence with."""

logger = logging.getLogger(__name__)

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text`` (nested braces kept), or ``None``."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            ch = text[i]
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
        # unbalanced: try an earlier box
    return None


def normalize_text(text: str, *, case_sensitive: bool = False) -> str:
    """Collapse whitespace, strip surrounding spaces and a trailing period; lower-case unless asked not to."""
    out = " ".join(text.split()).strip()
    out = out.rstrip(".").strip()
    return out if case_sensitive else out.lower()


class _DropTimeoutNotice(logging.Filter):
    """math-verify warns once that its signal timeouts are off; here the reward timeout bounds the time."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


_QUIET = _DropTimeoutNotice()


def math_equal(prediction: str, reference: str, *, float_rounding: int = 6) -> bool:
    """Whether ``prediction`` and ``reference`` (LaTeX or plain expressions, no ``\\boxed``) denote the
    same mathematical object. CPU-bound (sympy): call from a worker thread. Parse failures are ``False``.

    Signal-based timeouts of ``math-verify`` are off (they only work on the main thread); the caller
    bounds the time with the reward timeout.
    """
    math_verify = MATH_VERIFY.load("the math reward's math_equal")
    parse, verify = math_verify.parse, math_verify.verify

    for name in ("math_verify.parser", "math_verify.grader"):
        target = logging.getLogger(name)
        if _QUIET not in target.filters:
            target.addFilter(_QUIET)

    def wrap(s: str) -> str:
        s = s.strip()
        return s if s.startswith("$") else f"${s}$"

    gold = parse(wrap(reference), parsing_timeout=None)
    pred = parse(wrap(prediction), parsing_timeout=None)
    if not gold or not pred:
        logger.debug("math_equal: could not parse %r or %r", prediction, reference)
        return normalize_text(prediction) == normalize_text(reference)
    return bool(verify(gold, pred, float_rounding=float_rounding, timeout_seconds=None))
