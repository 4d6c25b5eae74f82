"""Custom rollout functions: replace the default single-turn generate (agents, tools, multi-turn)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from miles.rollout.client import EngineClient
    from miles.rollout.protocol import SamplingParams
    from miles.types import Sample

__all__ = ["RolloutFunction"]


class RolloutFunction(Protocol):
    """``async (client, sample, sampling_params) -> Sample``: fill in one sample's response.

    The function receives a sample with ``prompt_ids`` (and ``label`` / ``metadata``) and returns it with
    ``response_ids``, ``rollout_logprobs``, ``loss_mask``, ``weight_versions`` and ``status`` set. It
    must keep the tokens exact: multi-turn tool output is appended as token ids with ``loss_mask`` 0.

    A function that serves from something it must start (a session server) may also define
    ``async start(client, settings)`` (``settings``: the ``rollout`` section; called once before the
    first sample, must be idempotent), ``async aclose()`` (called when the run ends, also when nothing
    was started) and ``metrics(samples) -> dict[str, float]`` (added to each rollout's metrics);
    :class:`miles.sessions.rollout.SessionRollout` does.

    A function registered as a :class:`~miles.components.Component` class gets its settings from the
    ``[rollout.function]`` table, and may define ``server()`` returning a
    :class:`~miles.rewards.base.RewardServer` with a ``module`` (an environment server): ``miles train`` starts it
    through the launcher before the trainer ranks, as it starts a reward model's server, and sets the function's
    ``url`` setting to it (its settings model needs a ``url`` field; ``server()`` answers ``None`` once it is set).
    """

    async def __call__(self, client: EngineClient, sample: Sample, sampling_params: SamplingParams) -> Sample: ...
