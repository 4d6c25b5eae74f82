"""Rollout metrics of agent episodes, from the ``session`` record each session sample carries."""

from __future__ import annotations

from collections.abc import Sequence

from miles.types import Sample

__all__ = ["session_metrics"]


def session_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """``sessions/*`` metrics of the samples that came from sessions (empty when none did).

    ``append_only_violations`` must stay 0: a violation is a request the server refused because the chat
    template re-rendered the history (see ``docs/how-to/agents.md``).
    """
    infos = [s.metadata["session"] for s in samples if isinstance(s.metadata.get("session"), dict)]
    if not infos:
        return {}
    n = len(infos)
    turns = [float(i["turns"]) for i in infos]
    masked = sum(float(i["masked_tokens"]) for i in infos)
    policy = sum(float(i["policy_tokens"]) for i in infos)
    return {
        "sessions/episodes": float(n),
        "sessions/turns_per_episode_mean": sum(turns) / n,
        "sessions/turns_per_episode_max": max(turns),
        "sessions/tool_calls_per_episode_mean": sum(float(i["tool_calls"]) for i in infos) / n,
        "sessions/append_only_violations": sum(float(i["append_only_violations"]) for i in infos),
        "sessions/branches": sum(float(i["branches"]) for i in infos),
        "sessions/masked_tokens_mean": masked / n,
        "sessions/masked_fraction": masked / max(masked + policy, 1.0),
        "sessions/prefix_cache_hit_rate": sum(float(i["cached_tokens"]) for i in infos)
        / max(sum(float(i["prompt_tokens"]) for i in infos), 1.0),
    }
