"""The ``disk_delta`` transport against real local engines (bfloat16 weights): deltas that the engines
serve bit for bit, full snapshots when they are due (first push, a new engine, an engine whose weights are
not the delta's base, every ``full_every``), folders that are never half written, and refusals that leave
an engine serving its version unchanged."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from miles.errors import EngineError
from miles.rollout.http_client import HttpEngineClient
from miles.testing.engine import EngineProcess
from miles.training.trainer import DistContext
from miles.transport.disk_delta import DiskDeltaTransport, DiskDeltaTransportSettings
from miles.transport.verify import verify_engines

pytestmark = pytest.mark.slow  # two engine processes


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from miles.testing.models import build_tiny_model

    torch.set_num_threads(1)
    return build_tiny_model(
        tmp_path_factory.mktemp("delta-model") / "qwen2", "qwen2", seed=0, hidden_size=128, intermediate_size=256
    )


@pytest.fixture(scope="module")
def engines(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EngineProcess]]:
    logs = tmp_path_factory.mktemp("delta-logs")
    args = ["--dtype", "bfloat16", "--enable-debug-endpoints", "--attention-backend", "sdpa"]
    with (
        EngineProcess(model, extra_args=args, log_path=logs / "a.log") as a,
        EngineProcess(model, extra_args=args, log_path=logs / "b.log") as b,
    ):
        yield [a, b]


class Weights:
    """fp32 "trainer" weights that take Adam-sized steps (each element moves by ``lr``)."""

    def __init__(self, model: Path) -> None:
        from safetensors.torch import load_file

        self.state = load_file(str(model / "model.safetensors"))
        self.generator = torch.Generator().manual_seed(0)

    def step(self, lr: float) -> None:
        for t in self.state.values():
            t.add_(lr * torch.randn(t.shape, generator=self.generator).sign())

    def buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        items = list(self.state.items())
        yield items[: len(items) // 2]
        yield items[len(items) // 2 :]


def served(url: str) -> dict:
    return httpx.post(url + "/weights_checksum", json={}, timeout=60).json()


async def push(transport: DiskDeltaTransport, weights: Weights, version: str, client: HttpEngineClient) -> dict:
    report = await transport.push(weights.buckets(), version=version, dist=DistContext())
    await verify_engines(client, version=version, checksums_by_dtype={"bfloat16": report.checksums})
    return {**report.metrics, "num_bytes": report.num_bytes}


def test_deltas_full_snapshots_and_refusals(engines: list[EngineProcess], model: Path, tmp_path: Path) -> None:
    a, b = engines
    settings = DiskDeltaTransportSettings(dir=str(tmp_path / "w"), full_every=4, keep_versions=1)
    transport = DiskDeltaTransport(settings, run_dir=str(tmp_path), model_path=str(model), engine_dtype="bfloat16")
    weights = Weights(model)

    async def run() -> list[dict]:
        rows = []
        only_a = HttpEngineClient([a.url])
        both = HttpEngineClient([a.url, b.url])
        try:
            await transport.connect(only_a, DistContext())
            weights.step(1e-5)
            rows.append(await push(transport, weights, "1", only_a))  # first push: full
            for v in ("2", "3"):
                weights.step(1e-5)
                rows.append(await push(transport, weights, v, only_a))  # deltas
            await transport.connect(both, DistContext())  # engine b joins
            weights.step(1e-5)
            rows.append(await push(transport, weights, "4", both))  # a: delta; b (new): full
            weights.step(1e-5)
            rows.append(await push(transport, weights, "5", both))  # the 5th push (full_every=4): full for both
            await both.call(b.url, "/debug/randomize_weights", {"seed": 3})  # b's weights are no longer v5
            weights.step(1e-5)
            rows.append(await push(transport, weights, "6", both))  # b refuses the delta, rolls back, gets full
        finally:
            await only_a.close()
            await both.close()
        return rows

    rows = asyncio.run(run())
    full_bytes = rows[0]["num_bytes"]
    assert [r["weight_sync/full_snapshots"] for r in rows] == [1.0, 0.0, 0.0, 1.0, 2.0, 1.0]
    assert rows[0]["weight_sync/written_fraction"] > 1.0  # the whole model, plus config and tokenizer
    for r in (rows[1], rows[2]):
        assert 0 < r["weight_sync/bytes_written"] < 0.25 * full_bytes
    assert full_bytes < rows[3]["weight_sync/bytes_written"] < 1.25 * rows[0]["weight_sync/bytes_written"]
    # what the engines serve is the trainer's bf16 weights, bit for bit (a full push would give the same)
    expected = {n: t.to(torch.bfloat16) for n, t in weights.state.items()}
    for url in (a.url, b.url):
        report = served(url)
        assert report["weight_version"] == "6"
        from miles.transport.verify import tensor_checksum

        assert report["checksums"] == {n: tensor_checksum(t) for n, t in expected.items()}
    # only the last version stays on disk, and no half-written folder anywhere
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["delta-v6", "full-v6"]
    asyncio.run(transport.close())  # the versions are scratch: gone with the run
    assert not (tmp_path / "w").exists()


def test_broken_or_foreign_versions_are_refused_and_change_nothing(
    engines: list[EngineProcess], model: Path, tmp_path: Path
) -> None:
    a = engines[0]
    settings = DiskDeltaTransportSettings(dir=str(tmp_path / "w"), full_every=100, keep_versions=3, sync=False)
    transport = DiskDeltaTransport(settings, run_dir=str(tmp_path), model_path=str(model), engine_dtype="bfloat16")
    weights = Weights(model)

    async def run() -> None:
        async with HttpEngineClient([a.url], max_retries=0) as client:
            await transport.connect(client, DistContext())
            await push(transport, weights, "10", client)
            weights.step(1e-4)
            await push(transport, weights, "11", client)

    asyncio.run(run())
    before = served(a.url)
    root = tmp_path / "w"
    delta = root / "delta-v11"
    manifest = json.loads((delta / "manifest.json").read_text())
    assert manifest["kind"] == "delta" and manifest["base_version"] == "10"

    def load(path: Path) -> httpx.Response:
        return httpx.post(a.url + "/update_weights_from_delta", json={"path": str(path)}, timeout=60)

    # a delta against another base than the served one
    resp = load(delta)
    assert resp.status_code == 400 and "a delta against version '10'; this engine serves '11'" in resp.json()["message"]
    # a crash mid-write leaves a folder without its manifest or with a short data file
    partial = root / "delta-v12.partial"
    shutil.copytree(delta, partial)
    (partial / "manifest.json").unlink()
    assert "no manifest" in load(partial).json()["message"]
    shutil.copy2(delta / "manifest.json", partial / "manifest.json")
    with open(partial / "delta.bin", "r+b") as f:
        f.truncate(manifest["files"]["delta.bin"] // 2)
    assert "incomplete version" in load(partial).json()["message"]
    # a full snapshot whose data does not match the manifest's checksums
    full = root / "full-v10"
    bad = root / "full-bad"
    shutil.copytree(full, bad)
    data = bytearray((bad / "model.safetensors").read_bytes())
    data[-3] ^= 0x40
    (bad / "model.safetensors").write_bytes(bytes(data))
    assert "does not match its manifest checksum" in load(bad).json()["message"]
    assert served(a.url) == before  # every refusal left the engine serving version 11 bit for bit
    with pytest.raises(EngineError, match="update_weights_from_delta: HTTP 400"):

        async def direct() -> None:
            async with HttpEngineClient([a.url], max_retries=0) as client:
                await client.call(a.url, "/update_weights_from_delta", {"path": str(root / "nowhere")})

        asyncio.run(direct())
