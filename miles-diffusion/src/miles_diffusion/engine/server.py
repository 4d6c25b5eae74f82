"""The image engine's HTTP face: SGLang's native ``/generate`` shape, answered with images.

A request is ``{"input_ids": [...], "sampling_params": {...}, "rid"?: ...}`` (a list of prompts in
``input_ids`` is a batch); ``input_ids`` are the prompt tokenizer's ids. Of ``sampling_params`` the
image engine uses ``sampling_seed`` (the image's seed) and ``n`` (images per prompt, seeds ``seed + i``);
the token-decoding keys SGLang defines are accepted and have no meaning for an image; unknown keys are a
400, as in SGLang. Each answer is one "token" per SDE step::

    {"text": "", "output_ids": [step, ...],
     "meta_info": {"output_token_logprobs": [[logprob, step, null], ...], "finish_reason": {"type": "stop"},
                   "weight_version": "3", "prompt_tokens": P, "completion_tokens": S, "cached_tokens": 0,
                   "id": rid, "image": base64 PNG, "trajectory": {name: {dtype, shape, data}}}}

The admin routes are the local engine's, from the same skeleton (:mod:`miles.engine.protocol_app`) over
the image scheduler's operations (:class:`ImageEngine`): ``/pause_generation``, ``/continue_generation``,
``/abort_request``, ``/update_weights_from_disk``, ``/update_weight_version``, ``/weights_checksum``,
``/flush_cache`` (no cache: a no-op), ``/model_info``, ``/server_info``, ``/health``, ``/health_generate``
and, with debug endpoints, ``/debug/randomize_weights``. Errors are SGLang's shapes (HTTP 400). Plugins
may add routes (``miles_engine_routes``, with ``engine`` an :class:`ImageEngine`).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest

from miles.engine.protocol_app import ServedEngine, create_protocol_app
from miles.engine.responses import RequestError, generate_error, json_body
from miles.rollout.protocol import SamplingParams
from miles_diffusion.engine.scheduler import ImageRequest
from miles_diffusion.engine.weights import load_weights_from_disk, randomize_weights, weights_checksum
from miles_diffusion.sampling import Trajectory, png_bytes
from miles_diffusion.wire import tensor_data

if TYPE_CHECKING:
    from miles.plugins.manager import PluginManager
    from miles.types import PauseMode
    from miles_diffusion.engine.scheduler import ImageScheduler

__all__ = ["ImageEngine", "create_app", "trajectory_payload"]

log = logging.getLogger(__name__)

_SAMPLING_KEYS = set(SamplingParams.__dataclass_fields__)


def trajectory_payload(
    traj: Trajectory | None, *, rid: str, version: str, prompt_tokens: int, message: str
) -> dict[str, Any]:
    """One ``/generate`` answer (``traj=None``: aborted, with ``message``)."""
    meta: dict[str, Any] = {
        "id": rid,
        "weight_version": version,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": 0,
    }
    if traj is None:
        meta.update(finish_reason={"type": "abort", "message": message}, completion_tokens=0, output_token_logprobs=[])
        return {"text": "", "output_ids": [], "meta_info": meta}
    meta.update(
        finish_reason={"type": "stop", "matched": None},
        completion_tokens=len(traj.steps),
        output_token_logprobs=[[lp, step, None] for lp, step in zip(traj.logprobs, traj.steps, strict=True)],
        image=base64.b64encode(png_bytes(traj.image)).decode("ascii"),
        trajectory={name: tensor_data(t).to_dict() for name, t in traj.tensors().items()},
    )
    return {"text": "", "output_ids": list(traj.steps), "meta_info": meta}


def _parse(body: Any, decode: Callable[[list[int]], str]) -> tuple[list[list[int]], int | None, int, bool, str | None]:
    """``(prompts, seed, n, batched, rid)`` of a ``/generate`` body; a bad field raises :class:`RequestError`."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    ids = body.get("input_ids")
    batched = isinstance(ids, list) and bool(ids) and all(isinstance(row, list) for row in ids)
    prompts: list[Any] = list(ids) if batched and isinstance(ids, list) else [ids]
    for row in prompts:
        if not isinstance(row, list) or not row or not all(isinstance(t, int) and t >= 0 for t in row):
            raise RequestError("input_ids must be a non-empty list of token ids (or a list of such lists)")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise RequestError("sampling_params must be an object")
    unknown = sorted(set(params) - _SAMPLING_KEYS)
    if unknown:
        raise RequestError(f"unknown sampling_params key(s): {', '.join(unknown)}")
    seed = params.get("sampling_seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise RequestError("sampling_params.sampling_seed must be an integer")
    n = params.get("n", 1)
    if not isinstance(n, int) or n < 1:
        raise RequestError("sampling_params.n must be a positive integer")
    rid = body.get("rid")
    for row in prompts:
        decode(row)  # an id outside the vocabulary fails here, as a 400
    return prompts, seed, n, batched, None if rid is None else str(rid)


class ImageEngine(ServedEngine):
    """The image scheduler's operations behind the protocol's shared routes (weights on its worker thread)."""

    def __init__(self, scheduler: ImageScheduler, *, model_path: str, server_args: dict[str, Any]) -> None:
        self.scheduler = scheduler
        self.model_path = model_path
        self.server_args = server_args

    def _on_worker(self, fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
        return asyncio.wrap_future(self.scheduler.submit(fn, *args))

    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version

    async def generation_healthy(self) -> bool:
        thread = self.scheduler._thread
        return thread is not None and thread.is_alive()

    def model_info(self) -> dict[str, Any]:
        scheduler = self.scheduler
        config = scheduler.pipe.transformer.config
        return {
            "model_path": self.model_path,
            "tokenizer_path": f"{self.model_path}/tokenizer",
            "is_generation": True,
            "modality": "image",
            "weight_version": scheduler.weight_version,
            "model_type": type(scheduler.pipe.transformer).__name__,
            "num_hidden_layers": int(config.num_layers),
            "height": scheduler.sampling.height,
            "width": scheduler.sampling.width,
            "num_steps": scheduler.sampling.num_steps,
        }

    async def server_info(self) -> dict[str, Any]:
        from miles_diffusion import __version__

        scheduler = self.scheduler
        return {
            **self.server_args,
            **scheduler.stats(),
            "version": __version__,
            "weight_version": scheduler.weight_version,
        }

    async def abort(self, rid: str | None, message: str) -> int:
        return self.scheduler.abort(rid, message)

    async def pause(self, mode: PauseMode) -> None:
        await asyncio.to_thread(self.scheduler.pause, mode)

    async def resume(self) -> None:
        self.scheduler.resume()

    async def flush_cache(self) -> str:
        return "the image engine keeps no cache"

    async def load_weights_from_disk(
        self, path: str, *, version: str | None, flush_cache: bool, abort_all_requests: bool
    ) -> tuple[str, str]:
        scheduler = self.scheduler

        def load() -> int:
            count = load_weights_from_disk(scheduler.pipe.transformer, path)
            if version is not None:
                scheduler.weight_version = version
            return count

        count = await self._on_worker(load)
        return f"loaded {count} tensors from {path}", scheduler.weight_version

    async def set_weight_version(self, version: str, *, abort_all_requests: bool) -> None:
        await self._on_worker(setattr, self.scheduler, "weight_version", version)

    async def weights_checksum(self) -> dict[str, Any]:
        report: dict[str, Any] = await self._on_worker(weights_checksum, self.scheduler.pipe.transformer)
        return report

    async def randomize_weights(self, seed: int) -> int:
        count: int = await self._on_worker(randomize_weights, self.scheduler.pipe.transformer, seed)
        return count


def create_app(
    scheduler: ImageScheduler,
    *,
    model_path: str,
    tokenizer: Any,
    server_args: dict[str, Any],
    plugins: PluginManager | None = None,
) -> FastAPI:
    """The FastAPI application over ``scheduler``: the protocol's shared routes, ``/generate`` and the
    plugins' routes (``plugins``: default a new plugin manager, loaded as the CLI's is)."""
    from miles.plugins.manager import PluginManager

    engine = ImageEngine(scheduler, model_path=model_path, server_args=server_args)
    app = create_protocol_app(engine, title="miles image engine", check_api_key=False)  # it takes no API key
    vocab = len(tokenizer)

    def decode(ids: list[int]) -> str:
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise RequestError(f"input_ids: token id {bad} is outside the vocabulary ({vocab})")
        return str(tokenizer.decode(ids, skip_special_tokens=True))

    @app.post("/generate")
    async def generate(request: HTTPRequest) -> Any:
        try:
            prompts, seed, n, batched, rid = _parse(await json_body(request), decode)
        except RequestError as exc:
            return generate_error(str(exc))
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[dict[str, Any]]] = []
        requests: list[ImageRequest] = []
        base = seed if seed is not None else int(uuid.uuid4().int & 0x7FFFFFFF)
        for p, row in enumerate(prompts):
            for i in range(n):
                future: asyncio.Future[dict[str, Any]] = loop.create_future()
                one_rid = rid if rid is not None and len(prompts) * n == 1 else f"{rid or uuid.uuid4().hex}-{p}-{i}"

                def done(
                    traj: Trajectory | None,
                    version: str,
                    message: str,
                    *,
                    f: Any = future,
                    r: str = one_rid,
                    k: int = len(row),
                ) -> None:
                    payload = trajectory_payload(traj, rid=r, version=version, prompt_tokens=k, message=message)
                    loop.call_soon_threadsafe(lambda: f.done() or f.set_result(payload))

                futures.append(future)
                requests.append(ImageRequest(one_rid, decode(row), (base + i) & 0x7FFFFFFF, len(row), done))
        scheduler.add(requests)
        try:
            results = list(await asyncio.gather(*futures))
        except asyncio.CancelledError:  # the client went away: free the engine
            for req in requests:
                scheduler.abort(req.rid, "client disconnected")
            raise
        return results if batched or n > 1 else results[0]

    (plugins if plugins is not None else PluginManager().load()).add_engine_routes(app=app, engine=engine)
    return app
