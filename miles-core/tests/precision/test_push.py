"""Quantized rollout weights through every core transport into a real engine process: ``broadcast`` (gloo,
float8 bytes as uint8), ``disk`` (safetensors with F8_E4M3 / U8 / F32 parts) and ``disk_delta`` (XOR
deltas of the quantized bytes), each push verified against randomized engine weights; then the engine
generates with them. ``p2p`` (miles-p2p) refuses a converting recipe by design."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchao", reason="torchao (miles-core[quant]) is not installed")

from miles.precision.quantized import NVFP4
from miles.rollout.http_client import HttpEngineClient
from miles.testing.engine import EngineProcess
from miles.training.trainer import DistContext
from miles.transport.broadcast import BroadcastTransport, BroadcastTransportSettings
from miles.transport.disk import DiskTransport, DiskTransportSettings
from miles.transport.disk_delta import DiskDeltaTransport, DiskDeltaTransportSettings
from miles.transport.verify import verify_engines

pytestmark = pytest.mark.slow  # an engine process


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from miles.testing.models import build_tiny_model

    torch.set_num_threads(1)
    return build_tiny_model(
        tmp_path_factory.mktemp("push-model") / "qwen2", "qwen2", seed=0, hidden_size=128, intermediate_size=256
    )


@pytest.fixture(scope="module")
def engine(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    args = ["--dtype", "bfloat16", "--quantization", "nvfp4", "--enable-debug-endpoints", "--attention-backend", "sdpa"]
    log = tmp_path_factory.mktemp("push-logs") / "engine.log"
    with EngineProcess(model, extra_args=args, log_path=log) as process:
        yield process


def test_nvfp4_pushes_through_every_transport_verified(engine: EngineProcess, model: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    recipe = NVFP4(NVFP4.Settings())
    weights = load_file(str(model / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    common = {"run_dir": str(tmp_path), "model_path": str(model), "engine_dtype": "bfloat16"}
    transports = [
        BroadcastTransport(BroadcastTransportSettings(), **common),
        DiskTransport(DiskTransportSettings(dir=str(tmp_path / "disk")), **common),
        DiskDeltaTransport(DiskDeltaTransportSettings(dir=str(tmp_path / "delta")), **common),
    ]

    def buckets() -> Iterator[list[tuple[str, torch.Tensor]]]:
        items = list(recipe.rollout_weights(iter(weights.items())))
        yield items[: len(items) // 2]
        yield items[len(items) // 2 :]

    async def run() -> list[dict[str, float]]:
        rows = []
        async with HttpEngineClient([engine.url]) as client:
            version = 0
            for transport in transports:
                await transport.connect(client, DistContext())
                try:
                    for i in range(2):  # disk_delta: a full snapshot, then a delta of the quantized bytes
                        version += 1
                        for name in weights:
                            weights[name] = weights[name] + 1e-3 * torch.randn(weights[name].shape, generator=g)
                        if i == 0:  # the first push of each transport must overwrite every tensor
                            await client.call(engine.url, "/debug/randomize_weights", {"seed": version})
                        report = await transport.push(buckets(), version=str(version), dist=DistContext())
                        checksums = {"bfloat16": report.checksums}
                        verified = await verify_engines(client, version=str(version), checksums_by_dtype=checksums)
                        rows.append({**verified, **report.metrics, "bytes": float(report.num_bytes)})
                finally:
                    await transport.close()
            body = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 4, "min_new_tokens": 4}}
            answer = await client.call(engine.url, "/generate", body)
            rows.append({"generated": float(len(answer["output_ids"]))})
        return rows

    rows = asyncio.run(run())
    scales = sum(1 for n, _ in recipe.rollout_weights(iter(weights.items())) if n.endswith("_scale"))
    assert scales == 14  # 2 layers x 7 projections, each with its block scales (+ a per-tensor scale)
    assert all(r["weight_sync/verified"] == 1.0 for r in rows[:-1])
    assert all(r["weight_sync/verified_tensors"] == len(weights) + 2 * scales for r in rows[:-1])
    bf16_bytes = sum(t.numel() * 2 for t in weights.values())
    assert rows[0]["bytes"] < 0.6 * bf16_bytes  # the embeddings stay bf16; the projections go at ~0.28x
    assert rows[5].get("weight_sync/full_snapshots") == 0.0  # the second disk_delta push was a delta
    assert rows[-1]["generated"] == 4
