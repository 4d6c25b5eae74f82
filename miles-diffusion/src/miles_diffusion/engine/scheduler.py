"""The image engine's scheduler: one worker thread that owns the pipeline.

Requests queue up; the worker denoises up to ``max_batch_size`` of them together (one at a time with
``enable_deterministic_inference``). Control work — loading weights, checksums, randomising — is
submitted to the same thread and runs between batches, so no image is ever denoised on half-updated
weights. A pause (SGLang's modes) holds the queue: ``abort`` aborts what is queued and running,
``retract`` and ``in_place`` let the running batch finish (a trajectory never spans two weight versions)
and keep the queue for :meth:`ImageScheduler.resume`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from miles_diffusion.sampling import SamplingOptions, Trajectory, sample_trajectories

if TYPE_CHECKING:
    from miles_diffusion.engine.options import ImageServeOptions

__all__ = ["ImageRequest", "ImageScheduler"]

log = logging.getLogger(__name__)


@dataclass
class ImageRequest:
    """One image to sample; ``on_done(trajectory or None, version)`` is called once (``None``: aborted)."""

    rid: str
    text: str
    seed: int
    prompt_tokens: int
    on_done: Callable[[Trajectory | None, str, str], None]
    """``(trajectory or None when aborted, weight version, abort message)``."""
    aborted: str | None = None
    started: bool = field(default=False, repr=False)


class ImageScheduler:
    """Runs :func:`~miles_diffusion.sampling.sample_trajectories` for queued requests on a worker thread."""

    def __init__(self, pipe: Any, options: ImageServeOptions) -> None:
        self.pipe = pipe
        self.options = options
        scale = pipe.vae_scale_factor
        default = pipe.default_sample_size * scale
        self.sampling = SamplingOptions(
            num_steps=options.num_steps,
            height=options.height or default,
            width=options.width or default,
            guidance_scale=options.guidance_scale,
            noise_level=options.noise_level,
            sde_window=options.sde_window,
            max_sequence_length=options.max_sequence_length,
        )
        self.weight_version = options.weight_version
        self.paused: str | None = None
        self.images_done = 0
        self._queue: deque[ImageRequest] = deque()
        self._tasks: deque[tuple[Callable[..., Any], tuple[Any, ...], concurrent.futures.Future[Any]]] = deque()
        self._running: list[ImageRequest] = []
        self._cond = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="miles-image-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            for req in self._queue:
                req.aborted = "engine shutting down"
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        self._finish_aborted()

    # -- requests --------------------------------------------------------------------------------------
    def add(self, requests: list[ImageRequest]) -> None:
        with self._cond:
            if self._stopped:
                for req in requests:
                    req.aborted = "engine shutting down"
            self._queue.extend(requests)
            self._cond.notify_all()
        self._finish_aborted()

    def abort(self, rid: str | None, message: str) -> int:
        """Abort one request (or all, ``rid=None``); returns how many were aborted."""
        count = 0
        with self._cond:
            for req in [*self._queue, *self._running]:
                if (rid is None or req.rid == rid) and req.aborted is None:
                    req.aborted = message
                    count += 1
        self._finish_aborted()
        return count

    def pause(self, mode: str) -> None:
        """Hold the queue; returns once no batch is running (``abort`` first aborts everything)."""
        with self._cond:
            self.paused = mode
        if mode == "abort":
            self.abort(None, "aborted by /pause_generation")
        with self._cond:
            self._cond.wait_for(lambda: not self._running or self._stopped, timeout=600)

    def resume(self) -> None:
        with self._cond:
            self.paused = None
            self._cond.notify_all()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """Run ``fn(*args)`` on the worker thread between batches."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cond:
            if self._stopped:
                future.set_exception(RuntimeError("the engine is shutting down"))
                return future
            self._tasks.append((fn, args, future))
            self._cond.notify_all()
        return future

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {
                "queued": len(self._queue),
                "running": len(self._running),
                "images_done": self.images_done,
                "paused": self.paused,
            }

    # -- the worker ------------------------------------------------------------------------------------
    def _finish_aborted(self) -> None:
        """Answer queued requests that were aborted (running ones are answered by the worker)."""
        with self._cond:
            done = [r for r in self._queue if r.aborted is not None]
            for req in done:
                self._queue.remove(req)
        for req in done:
            req.on_done(None, self.weight_version, req.aborted or "aborted")

    def _next_batch(self) -> list[ImageRequest]:
        limit = 1 if self.options.enable_deterministic_inference else self.options.max_batch_size
        batch: list[ImageRequest] = []
        while self._queue and len(batch) < limit:
            batch.append(self._queue.popleft())
        return batch

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopped or self._tasks or (self._queue and self.paused is None))
                if self._stopped:
                    return
                tasks = list(self._tasks)
                self._tasks.clear()
                batch = [] if tasks or self.paused is not None else self._next_batch()
                self._running = batch
            for fn, args, future in tasks:
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:
                    future.set_exception(exc)
            if batch:
                self._run(batch)

    def _run(self, batch: list[ImageRequest]) -> None:
        version = self.weight_version
        try:
            trajectories = sample_trajectories(
                self.pipe,
                [r.text for r in batch],
                [r.seed for r in batch],
                self.sampling,
                should_abort=lambda: all(r.aborted is not None for r in batch),
            )
        except Exception as exc:
            log.exception("sampling failed")
            for req in batch:
                req.aborted = req.aborted or f"sampling failed: {type(exc).__name__}: {exc}"
            trajectories = []
        with self._cond:
            self._running = []
            self.images_done += sum(r.aborted is None for r in batch)
            self._cond.notify_all()
        for i, req in enumerate(batch):
            if req.aborted is not None or i >= len(trajectories) or trajectories[i].aborted:
                req.on_done(None, version, req.aborted or "aborted")
            else:
                req.on_done(trajectories[i], version, "")
