"""The local engine as its HTTP routes see it: the scheduler, the tokenizer, the server's options, and the
operations of SGLang's protocol on them.

A declared public module of the local engine (see :mod:`miles.engine`). A plugin's route group
(``miles_engine_routes``) receives the engine's :class:`EngineState` and may use:

- :meth:`EngineState.on_scheduler`: run a function on the scheduler thread, between forward passes (every
  read or write of the weights, every call below on the scheduler);
- :attr:`EngineState.model` and :attr:`EngineState.device`: the served torch model (its weights by HF name
  through :mod:`miles.engine.weights`) and its device; :meth:`EngineState.weights_written` after writing
  parameters in place;
- :attr:`EngineState.scheduler`'s ``paused`` (``None`` or the pause mode), ``pause(mode)``, ``resume()``,
  ``weight_version``, ``set_weight_version(version)`` and ``flush_cache()``, on the scheduler thread;
- :attr:`EngineState.on_randomize`, :meth:`EngineState.weight_path`, :attr:`EngineState.model_path`,
  :attr:`EngineState.server_args`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from miles.engine.protocol_app import ServedEngine
from miles.engine.weight_paths import WeightDirs

if TYPE_CHECKING:
    import torch

    from miles.engine.multimodal import ImageParser
    from miles.engine.parsing import GenerateBatch
    from miles.engine.request import Request
    from miles.engine.scheduler import Scheduler
    from miles.types import PauseMode

__all__ = ["EngineState", "GenerateCall"]

T = TypeVar("T")

_PROBE = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
"""The ``/generate`` body of ``/health_generate``'s probe."""


@dataclass
class GenerateCall:
    """One ``/generate`` call on the scheduler: its parsed requests and a queue per request of the answer,
    fed ``(payload, done)`` from the scheduler thread."""

    batch: GenerateBatch
    queues: list[asyncio.Queue[tuple[dict[str, Any], bool]]]

    @property
    def requests(self) -> list[Request]:
        return self.batch.requests


@dataclass
class EngineState(ServedEngine):
    """What the routes need: the scheduler, the tokenizer and the server's arguments."""

    scheduler: Scheduler
    tokenizer: Any
    model_path: str
    api_key: str | None = field(default=None, repr=False)
    """Opens every route but ``/health`` (only the generation routes with an admin key)."""
    admin_api_key: str | None = field(default=None, repr=False)
    """Opens the control routes (weights, pause, memory, flush, LoRA, debug), and only them."""
    server_args: dict[str, Any] = field(default_factory=dict)
    return_original_logprob: bool = False
    on_randomize: list[Callable[[int], None]] = field(default_factory=list)
    """Called with the seed by ``/debug/randomize_weights`` (on the scheduler thread): more weight memory
    to overwrite, such as the receive buffers of point-to-point sessions."""
    weight_dirs: WeightDirs | None = None
    """Where weight routes may load from (default: the model's directory only)."""
    generate_requests: int = 0
    """``/generate`` calls answered so far (``/server_info`` reports it: which engine served how much)."""
    generated_samples: int = 0
    """Completions those calls asked for (a call with ``n = 4`` counts 4)."""
    images: ImageParser | None = None
    """Parses ``image_data`` for a vision-language model (``None``: a text model)."""
    instance: str = field(default_factory=lambda: uuid.uuid4().hex)
    """This engine process's identity, in every ``/health`` answer (the ``x-miles-instance`` header): a
    client tells an engine restarted at the same URL from the one it knew, even if it never saw it die."""

    def __post_init__(self) -> None:
        if self.weight_dirs is None:
            self.weight_dirs = WeightDirs([self.model_path])

    def weight_path(self, path: str, *, field: str) -> str:
        """``path`` resolved, if a weight route may load from it (else :class:`PermissionError`)."""
        assert self.weight_dirs is not None
        return str(self.weight_dirs.check(path, field=field))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode_each(self, ids: list[int]) -> list[str]:
        return list(self.tokenizer.batch_decode([[t] for t in ids]))

    # -- what route groups use ------------------------------------------------------------------------
    def on_scheduler(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        """Run ``fn(*args)`` on the scheduler thread between forward passes; await its result (an exception
        it raises is raised here)."""
        return asyncio.wrap_future(self.scheduler.submit(fn, *args))

    @property
    def model(self) -> torch.nn.Module:
        """The served model (read or write its parameters on the scheduler thread only)."""
        model: torch.nn.Module = self.scheduler.runner.model
        return model

    @property
    def device(self) -> torch.device:
        """The device the model runs on."""
        device: torch.device = self.scheduler.runner.device
        return device

    def weights_written(self) -> None:
        """Tell the engine its parameters were written in place (on the scheduler thread): derived copies of
        the weights (the prepacked CPU matrices) are rebuilt from them."""
        self.scheduler.runner.drop_packed()

    # -- /generate ------------------------------------------------------------------------------------
    def start_generate(self, body: Any) -> GenerateCall:
        """Parse a ``/generate`` body and queue its requests on the scheduler (call on the event loop); a bad
        field raises :class:`~miles.engine.parsing.RequestError`."""
        from miles.engine.parsing import RequestError, parse_generate

        loop = asyncio.get_running_loop()
        sched = self.scheduler
        queues: list[asyncio.Queue[tuple[dict[str, Any], bool]]] = []

        def sink_factory(i: int) -> Callable[[Request, bool], None]:
            q: asyncio.Queue[tuple[dict[str, Any], bool]] = asyncio.Queue()
            queues.append(q)

            def sink(req: Request, done: bool) -> None:
                payload = req.to_response(self.decode_each, sched.weight_version)
                loop.call_soon_threadsafe(q.put_nowait, (payload, done))

            return sink

        batch = parse_generate(
            body,
            encode=self.encode,
            vocab_size=sched.runner.vocab_size,
            context_length=sched.context_length,
            sink_factory=sink_factory,
            return_original_logprob_default=self.return_original_logprob,
            images=self.images,
        )
        unknown = sorted(
            {r.lora_name for r in batch.requests if r.lora_name and r.lora_name not in sched.runner.lora.adapters}
        )
        if unknown:
            raise RequestError(
                f"lora_path: LoRA adapter {', '.join(map(repr, unknown))} is not loaded (/load_lora_adapter)"
            )
        sched.add(batch.requests)
        return GenerateCall(batch, queues)

    # -- the protocol's shared routes (miles.engine.protocol_app) -------------------------------------
    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version

    async def generation_healthy(self) -> bool:
        if self.scheduler.paused is not None:  # alive, but generation waits for /continue_generation
            return True
        call = self.start_generate(_PROBE)
        payload, _ = await asyncio.wait_for(call.queues[0].get(), timeout=120)
        return bool(payload["meta_info"]["finish_reason"]["type"] != "abort")

    def model_info(self) -> dict[str, Any]:
        runner = self.scheduler.runner
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "weight_version": self.scheduler.weight_version,
            "model_type": runner.config.model_type,
            "architectures": getattr(runner.config, "architectures", None),
            "num_hidden_layers": len(runner.layers),
            "moe_layers": runner.moe_layers,
            "num_experts_per_tok": runner.topk,
            "vocab_size": runner.vocab_size,
            "is_multimodal": self.images is not None,
            "context_length": self.scheduler.context_length,
        }

    async def server_info(self) -> dict[str, Any]:
        from miles._version import __version__

        sched = self.scheduler
        stats = await self.on_scheduler(sched.stats)
        counters = {"generate_requests": self.generate_requests, "generated_samples": self.generated_samples}
        return {**self.server_args, **stats, **counters, "version": __version__, "weight_version": sched.weight_version}

    async def abort(self, rid: str | None, message: str) -> int:
        return await self.on_scheduler(self.scheduler._abort, rid, message)

    async def pause(self, mode: PauseMode) -> None:
        await self.on_scheduler(self.scheduler.pause, mode)

    async def resume(self) -> None:
        await self.on_scheduler(self.scheduler.resume)

    async def flush_cache(self) -> str:
        await self.on_scheduler(self.scheduler.flush_cache)
        return "cache flushed"

    async def load_weights_from_disk(
        self, path: str, *, version: str | None, flush_cache: bool, abort_all_requests: bool
    ) -> tuple[str, str]:
        path = self.weight_path(path, field="model_path")
        sched = self.scheduler
        new = await self.on_scheduler(sched.update_weights, path, version, flush_cache, abort_all_requests)
        return f"weights loaded from {path}", new

    async def set_weight_version(self, version: str, *, abort_all_requests: bool) -> None:
        if abort_all_requests:
            await self.on_scheduler(self.scheduler._abort, None, "aborted by /update_weight_version")
        await self.on_scheduler(self.scheduler.set_weight_version, version)

    async def weights_checksum(self) -> dict[str, Any]:
        from miles.engine.weights import weights_checksum

        return await self.on_scheduler(weights_checksum, self.model)

    async def randomize_weights(self, seed: int) -> int:
        from miles.engine.weight_sync import randomize_weights

        def go() -> int:
            count = randomize_weights(self.model, seed)
            for hook in self.on_randomize:
                hook(seed)
            self.scheduler.flush_cache()
            return count

        return await self.on_scheduler(go)
