"""Settings of the signal checks (``[log.signals]``; the checks are :mod:`miles.driver.signals`)."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["SIGNAL_CHECKS", "SignalCheck", "SignalSettings"]

SignalCheck = Literal[
    "teacher_logprobs_uniform",
    "teacher_logprobs_constant",
    "ref_logprobs_uniform",
    "ref_logprobs_constant",
    "reward_constant",
    "reward_uncorrelated",
    "probe_unchanged",
    "grad_zero",
]
"""The name of a check (its metric is ``signals/<name>``, 1 in a step where it fired)."""

SIGNAL_CHECKS: tuple[SignalCheck, ...] = get_args(SignalCheck)


class SignalSettings(BaseModel):
    """Cheap checks, every step, that the run's signals are alive (see ``docs/how-to/fidelity.md``).

    Each check that fires sets its metric ``signals/<check>`` to 1 (0 otherwise) and logs a warning that
    names it; with ``stop`` the run stops instead, with an error naming the check.
    """

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    enabled: bool = True
    """Run the checks (``false``: none of them, and no ``signals/*`` metrics)."""
    stop: bool = False
    """Stop the run when a check fires (an error naming the check and its setting) instead of warning."""
    disable: list[SignalCheck] = Field(default_factory=list)
    """Checks not to run (e.g. ``["reward_uncorrelated"]`` for a reward that is known to be unrelated to
    length and confidence)."""
    uniform_tolerance: float = Field(0.01, ge=0.0)
    """``*_logprobs_uniform``: a teacher's or reference's logprobs are uniform when the root mean square of
    ``logprob + log(vocabulary size)`` over the step's response tokens is at most this (a dead model that
    outputs equal logits gives exactly 0; a randomly initialised tiny model about 0.3)."""
    constant_tolerance: float = Field(1e-6, ge=0.0)
    """``*_logprobs_constant``: the logprobs are constant when their standard deviation over the step's
    response tokens is at most this."""
    reward_window: int = Field(8, ge=2)
    """``reward_uncorrelated``: the number of steps whose samples are pooled to correlate the reward with the
    samples' features (response length, prompt length, mean rollout logprob)."""
    reward_min_correlation: float = Field(0.02, ge=0.0)
    """``reward_uncorrelated``: fires when, over the last ``reward_window`` steps, the reward's largest
    absolute Pearson correlation with any feature is at most this."""
    probe_min_change: float = Field(0.0, ge=0.0)
    """``probe_unchanged``: after the push of a step that trained (gradient norm above 0), fires when the mean
    |change| of each engine's logprobs of a fixed probe sequence since the previous push is at most this
    (0: fires only when they are bit for bit the same: a learning rate too small for the weights' dtype, a
    frozen model, weights that never reach the engines)."""
    grad_zero_tolerance: float = Field(0.0, ge=0.0)
    """``grad_zero``: fires when the gradient norm is at most this while the step's advantages are not all 0
    (parameters that receive no gradient: a frozen model, a detached loss)."""
