"""The learning-rate schedule every trainer follows: a linear warm-up, then constant, cosine or linear decay."""

from __future__ import annotations

import math

from miles.errors import SettingsError

__all__ = ["lr_factor"]


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, schedule: str, lr: float, min_lr: float) -> float:
    """Multiplier of the peak ``lr`` for optimizer step ``step`` (0-based).

    Warm-up rises linearly to 1 over ``warmup_steps`` (step 0 already trains at ``lr / warmup_steps``);
    afterwards ``constant`` stays at 1, ``cosine`` / ``linear`` decay to ``min_lr / lr`` at ``total_steps``.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    floor = min_lr / lr
    span = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / span, 1.0)
    if schedule == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    raise SettingsError(f"train.lr_schedule: unknown schedule {schedule!r} (expected constant, cosine or linear)")
