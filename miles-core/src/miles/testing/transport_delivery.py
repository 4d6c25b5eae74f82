"""The conformance check of a weight transport's delivery: pushes into a real local engine, verified.

:func:`check_transport` checks a transport class against the interface; :func:`check_transport_delivery`
runs it for real: a local engine process (``miles serve`` with its debug endpoints) serves a tiny model,
this process plays trainer rank 0 of a one-rank world, and:

1. the engine's weights are overwritten with random values (``/debug/randomize_weights``), then a push of
   weights that differ from the model the engine loaded must make the engine serve exactly them — checked
   with :func:`~miles.transport.verify.verify_engines` against the transport's own checksums, and against
   checksums this check computes itself from the weights it pushed;
2. randomized again, a push that leaves one tensor out must be caught naming that tensor: either the
   transport refuses the push, or verification fails.

The weights reach the transport both as buckets (``push``) and, for transports that read the trainer's own
slices (``attach``: ``p2p``), as :class:`~miles.training.trainer.WeightShard` objects of a stand-in trainer::

    from miles.testing import check_transport_delivery
    from miles_my_transport.transport import MyTransport

    def test_delivers(tmp_path):
        check_transport_delivery(MyTransport, tmp_path, settings={"dir": str(tmp_path / "w")})
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from pydantic import BaseModel

from miles.components import ComponentKind
from miles.testing.component_checks import check_transport
from miles.testing.conformance import component_settings, describe, failure, run_coroutine

if TYPE_CHECKING:
    import torch

    from miles.training.trainer import Trainer, WeightShard

__all__ = ["check_transport_delivery"]

LEFT_OUT = "model.norm.weight"
"""The tensor the second push leaves out."""


class _StandInTrainer:
    """The trainer side of the check: fixed weights as buckets and as whole-tensor shards on rank 0."""

    precision = None

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = weights

    def iter_weights(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, t in self.weights.items():
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    def iter_weight_shards(self, bucket_bytes: int = 0) -> Iterator[WeightShard]:
        from miles.training.trainer import WeightShard

        for name, t in self.weights.items():
            yield WeightShard(name, tuple(t.shape), (0,) * t.dim(), t)


def check_transport_delivery(
    cls: Any,
    tmp_path: str | Path,
    *,
    settings: BaseModel | Mapping[str, Any] | None = None,
    engine_dtype: str = "float32",
    bucket_bytes: int = 64 << 10,
    startup_timeout: float = 300.0,
    engine_args: Sequence[str] = (),
    trainer_device: str = "cpu",
    **init_kwargs: Any,
) -> dict[str, float]:
    """Push through transport ``cls`` into a real local engine and verify (see the module docstring).

    :param tmp_path: a scratch folder (the model, the engine's log, the transport's ``run_dir``).
    :param settings: the transport's settings (default: its settings model's defaults).
    :param engine_dtype: the dtype the engine serves (``float32`` / ``bfloat16``).
    :param bucket_bytes: bucket size of the pushes (small: several buckets even for the tiny model).
    :param engine_args: more ``miles serve`` flags (``["--device", "cuda"]`` on a GPU).
    :param trainer_device: where the pushed weights live (``cuda``: the transport's GPU path).
    :param init_kwargs: more constructor keywords of the transport.
    :returns: ``push_seconds`` of the verified push and the engine's ``verified_tensors``.
    """
    import torch
    from safetensors.torch import load_file

    from miles.errors import WeightVerificationError
    from miles.rollout.http_client import HttpEngineClient
    from miles.testing.engine import EngineProcess
    from miles.testing.models import build_tiny_model
    from miles.training.trainer import DistContext
    from miles.transport.base import weight_dirs
    from miles.transport.verify import tensor_checksum, verify_engines

    check_transport(cls, tmp_path, settings=settings, **init_kwargs)
    where = describe(ComponentKind.TRANSPORT, cls)
    root = Path(tmp_path)
    model = build_tiny_model(root / "delivery-model", "qwen2", seed=0)
    generator = torch.Generator().manual_seed(11)
    weights = {
        n: t + 0.01 * torch.randn(t.shape, generator=generator)
        for n, t in load_file(str(model / "model.safetensors")).items()
    }
    if LEFT_OUT not in weights:
        raise AssertionError(f"the check's model has no {LEFT_OUT!r}")
    dtype = getattr(torch, engine_dtype)
    expected = {n: tensor_checksum(t, dtype) for n, t in weights.items()}
    weights = {n: t.to(trainer_device) for n, t in weights.items()}
    options = component_settings(ComponentKind.TRANSPORT, cls, settings)
    kwargs = {"run_dir": str(root / "delivery-run"), "model_path": str(model), "engine_dtype": engine_dtype}
    allowed = os.pathsep.join(weight_dirs(kwargs["run_dir"], options))  # as `miles train` allows them
    args = ["--enable-debug-endpoints", "--attention-backend", "sdpa", "--dtype", engine_dtype, *engine_args]
    engine = EngineProcess(
        model,
        extra_args=[*args, "--allowed-weight-dirs", allowed],
        log_path=root / "delivery-engine.log",
        startup_timeout=startup_timeout,
    )
    transport = cls(options, **kwargs, **init_kwargs)
    dist = DistContext(device=trainer_device)

    async def run(client: HttpEngineClient) -> dict[str, float]:
        stand_in = _StandInTrainer(weights)
        transport.attach(cast("Trainer", stand_in))
        await transport.connect(client, dist)
        try:
            await client.call(engine.url, "/debug/randomize_weights", {"seed": 1})
            start = time.perf_counter()
            report = await transport.push(stand_in.iter_weights(bucket_bytes), version="1", dist=dist)
            seconds = time.perf_counter() - start
            try:
                metrics = await verify_engines(client, version="1", checksums_by_dtype={engine_dtype: report.checksums})
            except WeightVerificationError as exc:
                raise failure(where, f"a full push did not verify: {exc}") from exc
            served = await client.call(engine.url, "/weights_checksum", {})
            wrong = sorted(n for n, c in expected.items() if served["checksums"].get(n) != c)
            if wrong:
                raise failure(where, f"after a verified push the engine serves other values of {wrong[0]!r}")
            # a push with one tensor left out must be caught, naming it
            partial = _StandInTrainer({n: t for n, t in weights.items() if n != LEFT_OUT})
            transport.attach(cast("Trainer", partial))
            await client.call(engine.url, "/debug/randomize_weights", {"seed": 2})
            try:
                report = await transport.push(partial.iter_weights(bucket_bytes), version="2", dist=dist)
                await verify_engines(client, version="2", checksums_by_dtype={engine_dtype: report.checksums})
            except Exception as exc:
                if LEFT_OUT not in str(exc):
                    raise failure(where, f"a push without {LEFT_OUT!r} failed without naming it: {exc}") from exc
            else:
                raise failure(where, f"a push that left {LEFT_OUT!r} out was verified (nothing caught it)")
            return {"push_seconds": seconds, "verified_tensors": metrics["weight_sync/verified_tensors"]}
        finally:
            await transport.close()

    async def main() -> dict[str, float]:
        async with HttpEngineClient([engine.url], max_retries=1) as client:
            return await run(client)

    with engine:
        return run_coroutine(main)
