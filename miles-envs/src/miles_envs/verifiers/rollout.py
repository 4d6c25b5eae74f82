"""The ``verifiers`` rollout function: a verifiers environment's own episode, played through Miles' session server.

For each sample, the environment the sample names (``metadata["verifiers_env"]``, written by the ``verifiers``
data source) runs its ``rollout`` — its multi-turn protocol: ``env_response`` after each model turn, tools,
stop conditions, ``max_turns`` — with an OpenAI chat-completions client whose ``base_url`` is the sample's
session. The session server records the exact tokens the policy sampled and masks every token it did not
(environment, tool and template tokens), so the sample trains on what was sampled (TITO); verifiers' own view
of the episode (its messages) is used only for scoring. When the episode ends, the environment's rubric
scores it (as verifiers scores a rollout: the weighted sum of its reward functions, each function's value as a
metric) and the result goes to ``metadata["verifiers"]``, which the ``verifiers`` reward hands on. A rubric with
group-level reward functions scores the episodes of a group together instead, when the group is played: the
episode's state waits for it (:mod:`miles_envs.verifiers.groups`).

An episode that verifiers ends with an infrastructure error (``vf.InfraError``: a sandbox, a tunnel) fails
its sample with the reason; any other error verifiers records (an empty reply, a tool error, a timeout) ends
the episode as verifiers ends it, and the rubric scores what was played, as in verifiers' own training.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from miles.rewards.scoring import reaches_scoring
from miles.sessions.rollout import EpisodeContext, SessionRollout
from miles.types import Sample
from miles_envs.verifiers.groups import PENDING, held_states, hold, release, rubric_scores
from miles_envs.verifiers.loading import EnvSpec, VerifiersEnvError, load_env

if TYPE_CHECKING:
    from miles.rollout.client import EngineClient
    from miles.rollout.protocol import SamplingParams

__all__ = ["VERIFIERS_ROLLOUT", "VerifiersRollout", "verifiers_episode"]

log = logging.getLogger(__name__)

MODEL = "policy"
"""The model name the environment's client asks for (the session server serves the run's policy whatever the
name)."""


class VerifiersEpisodeError(VerifiersEnvError):
    """verifiers ended an episode with an infrastructure error (the sample fails with it)."""


def rollout_input(ctx: EpisodeContext) -> dict[str, Any]:
    """verifiers' ``RolloutInput`` of the sample: the data set row (its label) with the sample's conversation
    as ``prompt`` (``data.system_prompt`` included when the run sets one)."""
    label = ctx.sample.label
    row: dict[str, Any] = dict(label) if isinstance(label, dict) else {"answer": "" if label is None else str(label)}
    row["prompt"] = ctx.messages
    row.setdefault("example_id", ctx.sample.group_id)
    return row


def _error_text(error: Any) -> str | None:
    if error is None:
        return None
    return f"{type(error).__name__}: {error}"


async def verifiers_episode(ctx: EpisodeContext) -> dict[str, Any]:
    """Play the sample's environment through the session at ``ctx.base_url``; score it with its rubric, or, when
    the rubric has group-level functions, hold its state for its group's scoring."""
    import openai
    from verifiers.legacy.clients import OpenAIChatCompletionsClient
    from verifiers.legacy.errors import InfraError

    sample = ctx.sample
    spec = EnvSpec.from_metadata(sample.metadata, f"sample {sample.group_id}/{sample.index}")
    env = load_env(spec)
    client = OpenAIChatCompletionsClient(openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0))
    sampling_args = {**env.sampling_args, "max_tokens": ctx.max_tokens}
    pending = False
    try:
        state = await env.rollout(rollout_input(ctx), client, MODEL, sampling_args)
        error = state.get("error")
        if isinstance(error, InfraError):
            raise VerifiersEpisodeError(f"verifiers environment {spec.id!r}: {_error_text(error)}")
        if env.score_rollouts and env.rubric.has_group_rewards:
            pending = hold(env, state)  # scored with its group (the verifiers reward), cleaned up then
            if not pending:
                raise VerifiersEnvError(
                    f"verifiers environment {spec.id!r}: its rubric has group-level reward functions; its episodes "
                    "are scored as groups only when played by the 'verifiers' rollout function"
                )
        elif env.score_rollouts:
            await env.rubric.score_group([state])  # the individual functions, as score_rollout runs them
        else:
            await env.rubric.dummy_score_group([state])
        if not pending:
            await env.rubric.cleanup(state)
    finally:
        await client.close()
    scores = {"reward": None, "metrics": {}} if pending else rubric_scores(state)
    return {
        "verifiers": {
            **scores,
            "turns": len(state.get("trajectory") or []),
            "stop_condition": state.get("stop_condition"),
            "truncated": bool(state.get("is_truncated")),
            "error": _error_text(error),
        }
    }


class VerifiersRollout(SessionRollout):
    """:class:`~miles.sessions.rollout.SessionRollout` over :func:`verifiers_episode`, with ``verifiers/*``
    rollout metrics besides the sessions' own."""

    def __init__(self) -> None:
        super().__init__(
            verifiers_episode,
            description="A verifiers environment's multi-turn episode through the TITO session server, scored by "
            "its rubric (data.source = 'verifiers').",
        )

    async def __call__(self, client: EngineClient, sample: Sample, sampling_params: SamplingParams) -> Sample:
        """The session's sample of the episode; an episode whose rubric scores groups leaves its state held for
        its group's scoring (the key in ``metadata["verifiers"]["pending"]``) when the sample reaches scoring,
        and cleaned up otherwise."""
        played, token = held_states()
        try:
            out = await super().__call__(client, sample, sampling_params)
        except BaseException:
            for env, state in played:
                await env.rubric.cleanup(state)
            raise
        finally:
            release(token)
        info = out.metadata.get("verifiers")
        for env, state in played:
            if reaches_scoring(out) and isinstance(info, dict) and "pending" not in info:
                info["pending"] = PENDING.put(env, state)
            else:
                await env.rubric.cleanup(state)
        return out

    async def aclose(self) -> None:
        """Stop the session server; clean up the states of episodes whose group was never scored."""
        try:
            await super().aclose()
        finally:
            await PENDING.clear()

    def metrics(self, samples: Sequence[Sample]) -> dict[str, float]:
        """The sessions' metrics, and ``verifiers/turns_mean``, ``verifiers/error_fraction`` (episodes that
        verifiers ended with an error) and ``verifiers/truncated_fraction``."""
        out = super().metrics(samples)
        infos = [s.metadata["verifiers"] for s in samples if isinstance(s.metadata.get("verifiers"), dict)]
        if infos:
            n = len(infos)
            out["verifiers/turns_mean"] = sum(float(i["turns"]) for i in infos) / n
            out["verifiers/error_fraction"] = sum(i["error"] is not None for i in infos) / n
            out["verifiers/truncated_fraction"] = sum(bool(i["truncated"]) for i in infos) / n
        return out


VERIFIERS_ROLLOUT = VerifiersRollout()
"""The rollout function the plugin registers as ``verifiers``."""
