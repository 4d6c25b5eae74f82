"""Refusing an optimizer step whose loss or gradient is not finite, the same in every backend.

A NaN or infinite loss (a reward or advantage gone NaN, an overflow in the backward) would otherwise be
stepped into the weights and pushed to the engines silently. Trainers call :func:`refuse_non_finite` with
values every rank agrees on (reduced over the world) *before* ``optimizer.step()``; it clears nothing and
raises :class:`~miles.errors.NonFiniteStepError`, so the weights stay those of the step before and the run
stops with the step named (its last checkpoint is intact).
"""

from __future__ import annotations

import math

from miles.errors import NonFiniteStepError

__all__ = ["refuse_non_finite"]


def refuse_non_finite(step: int, **values: float) -> None:
    """Raise :class:`NonFiniteStepError` naming optimizer step ``step`` (1-based) and the first of
    ``values`` (``loss=...``, ``grad_norm=...``) that is NaN or infinite."""
    for name, value in values.items():
        if not math.isfinite(value):
            raise NonFiniteStepError(
                f"train step {step}: {name} is {value} — the optimizer step was refused and the weights stay "
                f"those of step {step - 1} (look for NaN rewards or advantages, a too-high lr, or an overflow "
                "in low precision)"
            )
