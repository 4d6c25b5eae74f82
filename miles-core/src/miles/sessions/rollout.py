"""Agent episodes as a rollout function: one session per sample, the session's exact tokens as the sample.

An *episode* is an async function that gets an :class:`EpisodeContext` — above all ``base_url``, the
OpenAI ``base_url`` of a fresh session — and drives any OpenAI-compatible client or agent framework
against it; it may return a dict that is merged into the sample's ``metadata`` (for rewards). Wrap it in
:class:`SessionRollout` and register that as a rollout function::

    @miles.hookimpl
    def miles_register_rollout_functions(register):
        register(SessionRollout(my_episode), name="my_agent")

The rollout manager calls it once per sample, so a prompt's ``n_samples_per_prompt`` episodes are its
GRPO group; they share the group's routing key, so the group's prompt and every episode's history stay in
one engine's prefix cache. The session server is started on loopback when the first rollout begins (the
manager calls :meth:`SessionRollout.start` with the rollout settings; ``[rollout.sessions]`` configures
it, ``url`` points at an external one) and stopped by :meth:`SessionRollout.aclose` at the end of the run.
The sample returned is the session's latest trajectory: the first request's prompt as ``prompt_ids``,
every later token as response, ``loss_mask`` 1 exactly on what the policy sampled. Sampling follows the
run (``rollout.temperature`` / ``top_p`` / ``top_k``, ``max_new_tokens`` per turn, a seed per turn derived
from the sample's seed), whatever the agent asks for.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from miles.auth import ServiceKeys
from miles.sessions.client import SessionClient
from miles.sessions.metrics import session_metrics
from miles.sessions.session import SessionSampling
from miles.settings.sessions import SessionSettings
from miles.types import Sample, SampleStatus

if TYPE_CHECKING:
    from miles.rollout.client import EngineClient
    from miles.rollout.protocol import SamplingParams
    from miles.sessions.server import SessionServer
    from miles.settings.model import RolloutSettings

__all__ = ["Episode", "EpisodeContext", "SessionRollout"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EpisodeContext:
    """What an episode needs: where to send chat requests, and the sample it plays out."""

    base_url: str
    """OpenAI ``base_url`` of this episode's session (``openai.AsyncOpenAI(base_url=..., api_key=...)``)."""
    session_id: str
    sample: Sample
    """The pending sample: ``prompt`` (the data's text), ``prompt_messages``, ``label``, ``metadata``,
    ``group_id``, ``index``."""
    max_tokens: int
    """The run's per-turn token budget (``rollout.max_new_tokens``)."""
    api_key: str = "miles"
    """The key the session server checks: the run's API key (:data:`miles.auth.API_KEY_ENV`), or any string
    where the run has none (OpenAI clients require one)."""

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The conversation the data set gives this episode, to start the chat from (a new list each time):
        the prompt's chat messages (``data.system_prompt`` first, when set), or one user message holding a
        plain-text prompt."""
        if self.sample.prompt_messages is not None:
            return [dict(m) for m in self.sample.prompt_messages]
        return [{"role": "user", "content": self.sample.prompt}]


Episode = Callable[[EpisodeContext], Awaitable[dict[str, Any] | None]]
"""An agent episode: drives a session through ``base_url``; returns metadata for the sample (or ``None``)."""


class SessionRollout:
    """A rollout function that plays one agent episode per sample through the TITO session server.

    :param episode: the agent (see the module docstring).
    :param description: shown by ``miles plugins list`` (default: the episode's docstring).
    """

    def __init__(self, episode: Episode, *, description: str | None = None) -> None:
        self.episode = episode
        self.__doc__ = description or episode.__doc__ or type(self).__doc__
        self._lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self._server: SessionServer | None = None
        self._client: SessionClient | None = None
        self._engines: EngineClient | None = None

    @property
    def url(self) -> str | None:
        """The session server in use (``None`` before :meth:`start`)."""
        return None if self._client is None else self._client.url

    def _guard(self) -> asyncio.Lock:
        """A lock of the running event loop (a run may use several loops one after the other)."""
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock[0] is not loop:
            self._lock = (loop, asyncio.Lock())
        return self._lock[1]

    async def start(self, client: EngineClient, settings: RolloutSettings | None = None) -> None:
        """Start (or reach) the session server for ``client``'s engines; idempotent."""
        async with self._guard():
            if self._client is not None and self._engines is client:
                return
            await self._stop()
            options = settings.sessions if settings is not None else SessionSettings()
            key = ServiceKeys.from_env().api_key
            if options.url is not None:
                self._client = SessionClient(options.url, api_key=key)
            else:
                from miles.sessions.server import SessionServer

                self._server = await SessionServer.for_engines(client, options)
                self._client = SessionClient(await self._server.start(), api_key=key)
            self._engines = client

    async def __call__(self, client: EngineClient, sample: Sample, sampling_params: SamplingParams) -> Sample:
        await self.start(client)
        assert self._client is not None
        sessions = self._client
        sampling = SessionSampling(
            temperature=sampling_params.temperature,
            top_p=sampling_params.top_p,
            top_k=sampling_params.top_k,
            max_tokens=sampling_params.max_new_tokens,
            seed=sampling_params.sampling_seed,
            override=True,
        )
        session_id = await sessions.create(
            sampling=sampling,
            routing_key=str(sample.metadata.get("routing_key", f"group-{sample.group_id}")),
            metadata={"group_id": sample.group_id, "index": sample.index},
        )
        context = EpisodeContext(
            sessions.base_url(session_id),
            session_id,
            sample,
            sampling_params.max_new_tokens,
            sessions.api_key or "miles",
        )
        error: BaseException | None = None
        result: dict[str, Any] | None = None
        try:
            result = await self.episode(context)
        except Exception as exc:  # the episode's failure is the sample's, with what the session recorded
            error = exc
        finally:
            trajectories = await sessions.samples(session_id)
            await sessions.delete(session_id)
        if not trajectories:
            reason = (
                f"episode failed: {error}"
                if error is not None
                else "the episode recorded no turn (it made no chat request, or its first prompt was over the "
                "context length)"
            )
            return replace(sample, status=SampleStatus.FAILED, status_reason=reason)
        main = trajectories[-1]
        out = replace(
            sample,
            prompt_ids=main.prompt_ids,
            response_ids=main.response_ids,
            rollout_logprobs=main.rollout_logprobs,
            loss_mask=main.loss_mask,
            response=main.response,
            status=main.status,
            status_reason=main.status_reason,
            weight_versions=main.weight_versions,
            request_spans=main.request_spans,
            routed_experts=main.routed_experts,
            routed_experts_shape=main.routed_experts_shape,
            sampling_mask=main.sampling_mask,
            metadata={**sample.metadata, **main.metadata, **(result or {})},
        )
        if error is not None:
            log.warning("episode of sample %d/%d failed: %s", sample.group_id, sample.index, error)
            out = replace(out, status=SampleStatus.FAILED, status_reason=f"episode failed: {error}")
        return out

    def metrics(self, samples: Sequence[Sample]) -> dict[str, float]:
        """``sessions/*`` rollout metrics (turns, append-only violations, branches, masked tokens)."""
        return session_metrics(samples)

    async def _stop(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None
        if self._server is not None:
            await self._server.stop()
            self._server = None
        self._engines = None

    async def aclose(self) -> None:
        """Stop the session server this function started."""
        async with self._guard():
            await self._stop()
