"""The ``tensor_ipc`` transport: colocated engines read the trainer's tensors in place, each engine TP rank
from the trainer rank on its own device (CUDA IPC on GPUs; shared memory on a CPU), through
``/update_weights_from_tensor`` — the path slime takes for colocated SGLang, for any number of engines and
any TP size.

Colocated, trainer rank ``r`` and engine ``r // tp_size``'s TP rank ``r % tp_size`` share a device. Every
rank keeps the full tensors the gather of each bucket gives it (:attr:`~miles.training.trainer.Trainer.weights_on_every_rank`),
casts them to the engines' dtype on its own device and makes *handles* of them
(:mod:`miles.transport.tensor_ipc`: a few hundred bytes a tensor, no data); rank 0 gathers the handles and
sends each engine the list of its TP ranks' payloads, all engines at once. An engine copies the tensors into
its parameters before it answers; the ranks then free them. The buckets travel inside
``/begin_weight_update`` ... ``/end_weight_update``; the last one carries the new ``weight_version``.

Serves Miles' local engine and SGLang (both answer ``/update_weights_from_tensor``; SGLang's CUDA handles
come from its own serializer: :class:`miles_sglang.tensor_transport.TensorTransport`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from miles.components import ComponentSettings
from miles.errors import SettingsError
from miles.transport.base import WeightTransport
from miles.transport.verify import tensor_checksum
from miles.types import PushReport

if TYPE_CHECKING:
    import torch

    from miles.rollout.client import EngineClient
    from miles.settings.model import MilesSettings
    from miles.training.trainer import DistContext, Trainer, WeightBucket

__all__ = ["TensorIpcTransport", "TensorIpcTransportSettings", "tensor_payload", "with_last"]

log = logging.getLogger(__name__)


class TensorIpcTransportSettings(ComponentSettings):
    """Settings of the ``tensor_ipc`` transport."""

    flush_cache: bool = True
    """Empty the engines' prefix caches with the last bucket of a push (their KV was computed by old weights)."""


def tensor_payload(payloads: list[str], *, last: bool, version: str, flush_cache: bool) -> dict[str, Any]:
    """The ``/update_weights_from_tensor`` body of one bucket for one engine: a payload per TP rank."""
    body: dict[str, Any] = {"serialized_named_tensors": payloads, "load_format": None, "flush_cache": False}
    if last:
        body.update(flush_cache=flush_cache, weight_version=version)
    return body


def with_last(buckets: Iterable[WeightBucket]) -> Iterator[tuple[WeightBucket, bool]]:
    """Each non-empty bucket and whether it is the last one."""
    previous: WeightBucket | None = None
    for bucket in buckets:
        if not bucket:
            continue
        if previous is not None:
            yield previous, False
        previous = bucket
    if previous is not None:
        yield previous, True


class TensorIpcTransport(WeightTransport[TensorIpcTransportSettings]):
    """Pushes weights to colocated engines as tensor handles, each engine TP rank from its own trainer rank."""

    name = "tensor_ipc"
    engine_needs: ClassVar[tuple[str, ...]] = ("update_weights_from_tensor", "miles_weight_routes")
    """The route, taking Miles' JSON handles (SGLang takes only its own serializer's: ``sglang_tensor``)."""

    @classmethod
    def check_settings(cls, options: TensorIpcTransportSettings, settings: MilesSettings) -> None:
        """Colocated engines, one engine TP rank per trainer rank, the full weights (no adapter), a trainer
        that can give every rank the full tensors; anything else is refused here, naming the field."""
        cluster, engine = settings.cluster, settings.rollout.engine
        tp = int(engine.options.get("tp_size", 1))
        problems = []
        if not cluster.colocate:
            problems.append(
                f"cluster.colocate: transport {cls.name!r} hands each engine the tensors of the trainer rank on "
                "its device; set it true (engines of their own take 'broadcast' or 'p2p')"
            )
        if cluster.num_engines * tp != cluster.trainer_ranks:
            problems.append(
                f"cluster.num_engines: transport {cls.name!r} pairs each engine TP rank with the trainer rank on "
                f"its device: {cluster.num_engines} engines x rollout.engine.tp_size {tp} must equal "
                f"cluster.trainer_ranks ({cluster.trainer_ranks})"
            )
        if cls.name == "tensor_ipc" and engine.name == "sglang":
            problems.append(
                "transport.name: SGLang reads tensor handles only in its own serializer's format; use transport "
                "'sglang_tensor' with rollout.engine 'sglang'"
            )
        if settings.train.adapter is not None:
            problems.append(
                f"train.adapter: transport {cls.name!r} loads full weights; adapters travel by transport 'lora'"
            )
        if settings.train.backend.name not in ("fsdp",):
            problems.append(
                f"train.backend: transport {cls.name!r} needs every trainer rank to hold the full tensors of a "
                f"push (the fsdp trainer does); {settings.train.backend.name!r} does not"
            )
        if problems:
            raise SettingsError("\n".join(problems))

    def __init__(
        self, settings: TensorIpcTransportSettings, *, run_dir: str, model_path: str | None, engine_dtype: str
    ) -> None:
        super().__init__(settings, run_dir=run_dir, model_path=model_path, engine_dtype=engine_dtype)
        self.client: EngineClient | None = None
        self.device = "cpu"

    def attach(self, trainer: Trainer) -> None:
        if not trainer.supports_weights_on_every_rank:
            raise SettingsError(
                f"train.backend: transport {self.name!r} needs every trainer rank to hold the full tensors; "
                f"{type(trainer).__name__} does not give them"
            )
        trainer.weights_on_every_rank = True

    async def connect(self, client: EngineClient | None, dist: DistContext) -> None:
        self.device = "cpu" if dist.device == "cpu" else f"cuda:{dist.local_rank}"
        if dist.rank != 0:
            return
        if client is None or not client.urls or dist.world_size % len(client.urls):
            count = 0 if client is None else len(client.urls)
            raise RuntimeError(
                f"{self.name} transport: {dist.world_size} trainer ranks cannot pair with {count} engines"
            )
        self.client = client

    def dump(self, tensors: list[tuple[str, torch.Tensor]]) -> str:
        """The payload of this rank's tensors (:func:`miles.transport.tensor_ipc.dump_handles`)."""
        from miles.transport.tensor_ipc import dump_handles

        return dump_handles(tensors)

    async def _each_engine(self, endpoint: str, bodies: list[dict[str, Any]]) -> None:
        assert self.client is not None
        client = self.client
        await asyncio.gather(*(client.call(url, endpoint, body) for url, body in zip(client.urls, bodies, strict=True)))

    async def push(self, buckets: Iterable[WeightBucket], *, version: str, dist: DistContext) -> PushReport:
        import torch

        from miles.training.comm import all_gather_json, broadcast_json

        report = PushReport(version=version)
        start = time.perf_counter()
        dtype = getattr(torch, self.engine_dtype)
        copy = self.device == "cpu"  # (sharing a CPU storage moves it to shared memory: never a live parameter's)
        engines = len(self.client.urls) if self.client is not None else 0
        if dist.rank == 0:
            await self._each_engine("/begin_weight_update", [{}] * engines)
        for bucket, last in with_last(buckets):
            tensors = [(n, t.detach().to(device=self.device, dtype=dtype, copy=copy).contiguous()) for n, t in bucket]
            payloads = all_gather_json(self.dump(tensors))
            if dist.rank == 0:
                tp = len(payloads) // engines
                bodies = [
                    tensor_payload(
                        payloads[e * tp : (e + 1) * tp],
                        last=last,
                        version=version,
                        flush_cache=self.settings.flush_cache,
                    )
                    for e in range(engines)
                ]
                await self._each_engine("/update_weights_from_tensor", bodies)  # every engine copied them
                for name, t in tensors:
                    report.checksums[name] = tensor_checksum(t)
                    report.num_bytes += t.numel() * t.element_size()
                report.num_tensors += len(tensors)
            broadcast_json(True)  # (the other ranks keep their tensors until the engines have copied them)
            del tensors
        if dist.rank == 0:
            await self._each_engine("/end_weight_update", [{}] * engines)
        report.seconds = time.perf_counter() - start
        if dist.rank == 0:
            log.info(
                "%s: version %s, %d tensors to %d engines in %.2fs",
                self.name,
                version,
                report.num_tensors,
                engines,
                report.seconds,
            )
        return report
