"""The ``sglang_tensor`` transport: a colocated SGLang engine reads the trainer's GPU tensors in place, through
CUDA IPC and SGLang's ``/update_weights_from_tensor``.

Trainer rank 0 casts each bucket to the engines' dtype on its own GPU, and sends only CUDA IPC handles:
SGLang's ``MultiprocessingSerializer`` (imported from SGLang, its own format) turns the tensors into
handles the engine process opens on the same device; the engine copies them into its parameters before it
answers, after which rank 0 frees them. No tensor data crosses HTTP, and Miles never deserialises
anything. The buckets travel in SGLang's weight-update session (``/begin_weight_update`` ...
``/end_weight_update``); the last one carries the new ``weight_version``.

Scope: one engine, ``tp_size = 1``, on the GPU of trainer rank 0 (``cluster.colocate``). Larger
colocated fleets use the ``broadcast`` transport (NCCL), which needs no IPC.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from miles.errors import SettingsError
from miles.transport.base import WeightTransport
from miles.transport.verify import tensor_checksum
from miles.types import PushReport
from miles_sglang.settings import TensorTransportSettings

if TYPE_CHECKING:
    import torch

    from miles.rollout.client import EngineClient
    from miles.settings.model import MilesSettings
    from miles.training.trainer import DistContext, WeightBucket

__all__ = ["TENSOR_REQUEST_FIELDS", "TensorTransport", "tensor_payload"]

log = logging.getLogger(__name__)

TENSOR_REQUEST_FIELDS = ("serialized_named_tensors", "load_format", "flush_cache", "weight_version")
"""The ``/update_weights_from_tensor`` fields this transport sends (checked against SGLang's request)."""


def tensor_payload(serialized: str, *, last: bool, version: str, flush_cache: bool) -> dict[str, Any]:
    """The ``/update_weights_from_tensor`` body of one bucket (one entry: the engine has one TP rank)."""
    payload: dict[str, Any] = {"serialized_named_tensors": [serialized], "load_format": None, "flush_cache": False}
    if last:
        payload.update(flush_cache=flush_cache, weight_version=version)
    return payload


def _with_last(buckets: Iterable[WeightBucket]) -> Iterator[tuple[WeightBucket, bool]]:
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


class TensorTransport(WeightTransport[TensorTransportSettings]):
    """Pushes weights to a colocated SGLang engine as CUDA IPC handles (``/update_weights_from_tensor``)."""

    name = "sglang_tensor"

    @classmethod
    def check_settings(cls, options: TensorTransportSettings, settings: MilesSettings) -> None:
        """One SGLang engine with ``tp_size = 1``, colocated on CUDA; anything else is refused here."""
        engine = settings.rollout.engine
        problems = []
        if engine.name != "sglang":
            problems.append(f"transport: 'sglang_tensor' needs rollout.engine = 'sglang', got {engine.name!r}")
        if not settings.cluster.colocate:
            problems.append("cluster.colocate: transport 'sglang_tensor' shares GPU memory; set it true")
        if settings.cluster.device != "cuda":
            problems.append(
                f"cluster.device: transport 'sglang_tensor' moves CUDA tensors, got {settings.cluster.device!r}"
            )
        if settings.cluster.num_engines != 1 or int(engine.options.get("tp_size", 1)) != 1:
            problems.append(
                "cluster.num_engines: transport 'sglang_tensor' serves one engine with rollout.engine.tp_size = 1 "
                "(use transport 'broadcast' for more)"
            )
        if problems:
            raise SettingsError("\n".join(problems))

    def __init__(
        self, settings: TensorTransportSettings, *, run_dir: str, model_path: str | None, engine_dtype: str
    ) -> None:
        super().__init__(settings, run_dir=run_dir, model_path=model_path, engine_dtype=engine_dtype)
        self.client: EngineClient | None = None
        self.device = "cuda"

    async def connect(self, client: EngineClient | None, dist: DistContext) -> None:
        if dist.rank != 0:
            return
        if client is None or len(client.urls) != 1:
            raise RuntimeError("sglang_tensor transport: rank 0 needs a client over exactly one engine")
        self.client = client
        self.device = f"cuda:{dist.local_rank}"

    @staticmethod
    def _serialize(tensors: list[tuple[str, torch.Tensor]]) -> str:
        """CUDA IPC handles of ``tensors`` in SGLang's own format (base64), made by SGLang's serializer."""
        from sglang.srt.utils.common import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()  # handles name the device by UUID, as the engine expects
        return str(MultiprocessingSerializer.serialize(tensors, output_str=True))

    async def push(self, buckets: Iterable[WeightBucket], *, version: str, dist: DistContext) -> PushReport:
        import torch

        report = PushReport(version=version)
        if dist.rank != 0:
            for _ in buckets:  # the gather is a collective: every rank walks the buckets
                pass
            return report
        if self.client is None:
            raise RuntimeError("sglang_tensor transport: push before connect()")
        start = time.perf_counter()
        url = self.client.urls[0]
        dtype = getattr(torch, self.engine_dtype)
        await self.client.call(url, "/begin_weight_update", {})
        for bucket, last in _with_last(buckets):
            tensors = [(name, t.detach().to(device=self.device, dtype=dtype).contiguous()) for name, t in bucket]
            payload = tensor_payload(
                self._serialize(tensors), last=last, version=version, flush_cache=self.settings.flush_cache
            )
            await self.client.call(url, "/update_weights_from_tensor", payload)  # the engine copied them
            for name, t in tensors:
                report.checksums[name] = tensor_checksum(t)
                report.num_bytes += t.numel() * t.element_size()
            report.num_tensors += len(tensors)
            del tensors
        await self.client.call(url, "/end_weight_update", {})
        report.seconds = time.perf_counter() - start
        log.info("sglang_tensor: version %s, %d tensors in %.2fs", version, report.num_tensors, report.seconds)
        return report
