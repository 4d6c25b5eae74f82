"""The engine client interface: the one way the rest of Miles talks to rollout engines.

One implementation (HTTP, SGLang's native protocol) serves the local engine and SGLang servers alike;
it routes session- and group-affine across several engines. Transports and the rollout manager take an
:class:`EngineClient`; tests may drive a real local engine through it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from miles.rollout.protocol import GenerateOutput, PauseMode, SamplingParams

__all__ = ["MEMORY_TAGS", "EngineClient"]


MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
"""What an engine gives back while a colocated trainer trains: SGLang's memory tags (its
``GPU_MEMORY_TYPE_*``), which Miles' own engine takes too."""


class EngineClient(ABC):
    """Async client over one or more engines speaking SGLang's protocol."""

    lora_path: str | None = None
    """SGLang's ``lora_path`` sent with every generate request: the LoRA adapter the rollouts run (set by
    the ``lora`` transport once the engines serve it; ``None``: the base model)."""
    return_sampling_mask: bool = False
    """SGLang's ``return_sampling_mask`` sent with every generate request: each output token's kept set under
    top-k / top-p / min-p and its behaviour logprob (``GenerateOutput.sampling_mask`` and
    ``sampling_logprobs``; set by the rollout manager for ``rollout.replay_sampling_mask``)."""

    @property
    @abstractmethod
    def urls(self) -> Sequence[str]:
        """Base URLs of the engines behind this client."""

    @abstractmethod
    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
        routing_key: str | None = None,
        rid: str | None = None,
        image_data: Sequence[str] | None = None,
    ) -> list[GenerateOutput]:
        """Generate ``sampling_params.n`` completions of one prompt.

        :param routing_key: requests with the same key go to the same engine (a group, a session), so
            they share its prefix cache; ``None`` routes to the least-loaded engine.
        :param rid: request id, for :meth:`abort`.
        :param image_data: the prompt's images (SGLang's ``image_data``: paths, ``file://`` or ``data:`` URLs,
            base64), for a vision-language model; its ``input_ids`` hold their placeholders.
        """

    @abstractmethod
    async def abort(self, rid: str | None = None) -> None:
        """Abort one request (``rid``) or, with ``None``, every request on every engine."""

    @abstractmethod
    async def pause_generation(self, mode: PauseMode = "abort") -> None:
        """Pause every engine (before a weight update)."""

    @abstractmethod
    async def continue_generation(self) -> None:
        """Resume every engine after :meth:`pause_generation`."""

    @abstractmethod
    async def flush_cache(self) -> None:
        """Empty every engine's prefix cache."""

    @abstractmethod
    async def model_info(self) -> list[dict[str, Any]]:
        """``/model_info`` of each engine (includes ``weight_version``)."""

    @abstractmethod
    async def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        """Make every engine load the safetensors directory ``model_path`` and report ``weight_version``."""

    @abstractmethod
    async def call(self, url: str, endpoint: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
        """POST ``payload`` to ``endpoint`` of one engine and return the JSON body.

        Raises :class:`miles.errors.EngineError` with the engine's ``message`` on HTTP >= 400. Used by
        transports for the weight-update endpoints (``/init_weights_update_group`` ...).
        """

    async def server_info(self) -> list[dict[str, Any]]:
        """``/server_info`` of each engine (in :attr:`urls` order): its launch settings, such as SGLang's
        ``tp_size``.

        .. versionadded:: 0.1 (not abstract: the default reports nothing for every engine)
        """
        return [{} for _ in self.urls]

    async def models(self, url: str) -> list[dict[str, Any]]:
        """``GET /v1/models`` of one engine (SGLang's OpenAI-compatible list): the base model and each LoRA
        adapter it serves (``id``: the adapter's name, ``root``: where it was loaded from).

        .. versionadded:: 0.1 (not abstract: the default reports none)
        """
        return []

    async def update_weight_version(self, weight_version: str) -> None:
        """Make every engine report ``weight_version`` (SGLang's ``/update_weight_version``; requests in
        flight keep running: ``abort_all_requests`` is sent false, SGLang's default is true).

        .. versionadded:: 0.1 (not abstract: the default posts through :meth:`call`)
        """
        for url in self.urls:
            await self.call(url, "/update_weight_version", {"new_version": weight_version, "abort_all_requests": False})

    async def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Make every engine free the memory of ``tags`` (SGLang's ``/release_memory_occupation``: its KV cache,
        weights and CUDA graphs while a colocated trainer trains).

        .. versionadded:: 0.1 (not abstract: the default posts through :meth:`call`)
        """
        for url in self.urls:
            await self.call(url, "/release_memory_occupation", {"tags": list(tags)})

    async def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Make every engine take back the memory of ``tags`` (``/resume_memory_occupation``).

        .. versionadded:: 0.1 (not abstract: the default posts through :meth:`call`)
        """
        for url in self.urls:
            await self.call(url, "/resume_memory_occupation", {"tags": list(tags)})

    async def randomize_weights(self, *, seed: int) -> None:
        """Test mode: every engine fills its weights with random values (``/debug/randomize_weights``, served
        with debug routes on), so a tensor a push misses shows in its verification.

        .. versionadded:: 0.1 (not abstract: the default posts through :meth:`call`)
        """
        for url in self.urls:
            await self.call(url, "/debug/randomize_weights", {"seed": seed})

    async def health(self) -> list[bool]:
        """Whether each engine answers ``/health`` (in :attr:`urls` order).

        .. versionadded:: 0.1 (not abstract: the default reports every engine healthy if
           :meth:`model_info` answers)
        """
        try:
            await self.model_info()
        except Exception:
            return [False] * len(self.urls)
        return [True] * len(self.urls)

    async def wait_until_healthy(self, timeout: float, *, interval: float = 0.5) -> None:
        """Wait until every engine answers ``/health`` (engines may still be starting); raise
        :class:`~miles.errors.EngineError` naming the ones that did not within ``timeout`` seconds.

        .. versionadded:: 0.1
        """
        import asyncio
        import time

        from miles.errors import EngineError

        deadline = time.monotonic() + timeout
        while True:
            healthy = await self.health()
            if all(healthy):
                return
            if time.monotonic() >= deadline:
                down = [url for url, ok in zip(self.urls, healthy, strict=True) if not ok]
                raise EngineError(f"engines {', '.join(down)} did not answer /health within {timeout:g} s")
            await asyncio.sleep(interval)

    async def check_engines(self) -> list[str]:
        """Probe the engines: mark the ones that do not answer down, let the ones back up rejoin at the next
        weight push (:mod:`miles.rollout.failover`); returns the rejoining engines.

        .. versionadded:: 0.1 (not abstract: the default knows of no failures)
        """
        return []

    def serving(self) -> list[str]:
        """Engines that take generation (:attr:`urls` but those that rejoin).

        .. versionadded:: 0.1 (not abstract: the default knows of no failures)
        """
        return list(self.urls)

    def wait_for_restarts(self, *, restarts: int, timeout: float) -> None:
        """When every engine is lost, make generation wait up to ``timeout`` seconds for an engine to serve
        again instead of raising :class:`~miles.rollout.failover.NoEngineLeftError`, as long as a lost
        engine may still be restarted (each up to ``restarts`` times, ``rollout.engine_restarts``). Whoever
        calls this brings a restarted engine the weights (:meth:`check_engines`, a push,
        :meth:`weights_reached`). The default client never waits.

        .. versionadded:: 0.1
        """

    async def wait_for_a_restart(self) -> list[str]:
        """No engine takes control calls (the last one died during a weight push): when
        :meth:`wait_for_restarts` was asked and a lost engine may still be restarted, probe the engines
        (:meth:`check_engines`) until one answers again, up to its timeout. Returns the rejoining engines
        (empty: none may come back, or none did in time). The default client never waits.

        .. versionadded:: 0.1
        """
        return []

    def rejoining(self) -> list[str]:
        """Engines back up (:meth:`check_engines`) that take control calls but wait for a weight push before
        they serve. A restarted engine has none of the channels a transport set up with it before (a process
        group, a session): the transport sets them up again, and the push brings it the whole version.

        .. versionadded:: 0.1 (not abstract: the default knows of no failures)
        """
        return []

    def weights_reached(self, version: str) -> list[str]:
        """Weight version ``version`` reached every engine that takes control calls: the rejoining ones serve
        again; returns them.

        .. versionadded:: 0.1
        """
        return []

    def failover_metrics(self) -> dict[str, float]:
        """Engine failures and re-sent requests since the last call (``rollout/engine_failures`` ...).

        .. versionadded:: 0.1
        """
        return {}

    @abstractmethod
    async def close(self) -> None:
        """Close connections (engines keep running; the launcher owns their processes)."""
