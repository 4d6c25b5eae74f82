"""Two real trainer ranks (gloo, spawned with ``torch.multiprocessing``) holding an FSDP2-sharded model push
through the ``p2p`` transport into real engine processes, one scenario after another, and write what they
saw to ``--out`` (the test asserts on it):

1. ``v1``: the engines' weights randomized first; both engines must then serve the trainer's weights;
2. ``v2``: every rank changes its own shards (a training step's worth); pushed and verified again;
3. ``skip``: rank 1 leaves one slice of ``model.norm.weight`` out (a faulty data path); must fail by name;
4. ``v4``: a normal push after the failure;
5. ``kill``: engine B is killed as rank 0 starts moving data; the push must fail naming B's URL and
   engine A keep serving version 4 (with ``shm-direct``: stay paused on partial weights);
6. ``again``: the client finds B down; the next push opens sessions on engine A alone, which must serve
   it (from randomized weights) and generate again (``shm-direct``: its pause ends with the complete
   version).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


class Shards:
    """The trainer as the transport sees it: an FSDP2-sharded HF model's ``iter_weight_shards``."""

    precision = None

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def iter_weight_shards(self, bucket_bytes: int = 0) -> Any:
        from miles_fsdp.weights import iter_weight_shards

        return iter_weight_shards(self.model)


def sharded_model(path: str) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    from miles_fsdp.model import load_causal_lm, shard_model

    model = load_causal_lm(path, seed=0, attn_implementation="eager")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return shard_model(
        model,
        mesh,
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
        reshard_after_forward=True,
        cpu_offload=False,
        activation_checkpointing=False,
    )


def full_checksums(model: torch.nn.Module) -> dict[str, str]:
    """Checksums (bf16) of the full weights: a gather every rank joins (the test's reference only)."""
    from miles.transport.verify import tensor_checksum
    from miles_fsdp.weights import hf_name

    out = {}
    for name, p in model.named_parameters():
        full = p.detach().full_tensor()
        out[hf_name(name)] = tensor_checksum(full, torch.bfloat16)
    return out


async def scenario(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from miles.errors import EngineError, WeightVerificationError
    from miles.rollout.http_client import HttpEngineClient
    from miles.training.trainer import DistContext
    from miles.transport.verify import verify_engines
    from miles_p2p.settings import P2PTransportSettings
    from miles_p2p.transport import P2PTransport

    model = sharded_model(args.model)
    urls = args.urls.split(",")
    direct = args.datapath == "shm-direct"
    settings = P2PTransportSettings(
        datapath="shm" if direct else args.datapath, write_into_weights=direct, timeout=args.timeout
    )
    transport = P2PTransport(settings, run_dir=args.out, model_path=args.model, engine_dtype="bfloat16")
    transport.attach(Shards(model))  # type: ignore[arg-type]
    ctx = DistContext(rank=rank, world_size=world)
    client = HttpEngineClient(urls, max_retries=1, backoff=0.1) if rank == 0 else None
    results: dict[str, Any] = {}

    def served() -> list[dict[str, Any]]:
        return [httpx.post(u + "/weights_checksum", json={}, timeout=60).json() for u in urls]

    async def randomize(seed: int) -> None:
        if rank == 0:
            assert client is not None
            for url in urls:
                await client.call(url, "/debug/randomize_weights", {"seed": seed})
        dist.barrier()

    async def randomize_a(seed: int) -> None:
        if rank == 0:
            assert client is not None
            await client.call(urls[0], "/debug/randomize_weights", {"seed": seed})
        dist.barrier()

    async def push(version: str) -> dict[str, Any]:
        report = await transport.push([], version=version, dist=ctx)
        expected = full_checksums(model)
        out: dict[str, Any] = {"metrics": report.metrics, "num_bytes": report.num_bytes}
        if rank == 0:
            assert client is not None
            out["verification"] = await verify_engines(
                client, version=version, checksums_by_dtype={"bfloat16": report.checksums}
            )
            out["served"] = served()
            out["expected"] = expected
            out["report_checksums"] = report.checksums
        return out

    try:
        await transport.connect(client, ctx)
        await randomize(1)
        results["v1"] = await push("1")
        # the staged shm buffers are already unlinked: mapped by every process, named nowhere (nothing can leak)
        results["v1"]["shm_names"] = sorted(p.name for p in Path("/dev/shm").glob(f"{transport.session_id}-*"))
        with torch.no_grad():  # a training step's worth of change, different on each rank's shards
            gen = torch.Generator().manual_seed(100 + rank)
            for p in model.parameters():
                local = p.to_local()
                local.add_(1e-2 * torch.randn(local.shape, generator=gen))
        results["v2"] = await push("2")

        # 3. a faulty data path on rank 1: one slice of model.norm.weight is never sent
        original = transport._send

        def skipping(routes: Any, sources: Any) -> Any:
            keep = [(r, s) for r, s in zip(routes, sources, strict=True) if r.name != "model.norm.weight"]
            outcome = original([r for r, _ in keep], [s for _, s in keep])
            if args.datapath != "torch":  # a data path that claims it wrote what it did not
                for r in routes:
                    if r.name == "model.norm.weight":
                        outcome.written.setdefault(r.engine, []).append(r.id)
            return outcome

        if rank == 1:
            transport._send = skipping  # type: ignore[method-assign]
        await randomize(3)
        try:
            await transport.push([], version="3", dist=ctx)
            results["skip"] = {"error": None}
        except (WeightVerificationError, EngineError) as exc:
            results["skip"] = {"error": str(exc), "type": type(exc).__name__}
        transport._send = original  # type: ignore[method-assign]
        dist.barrier()

        await randomize(4)
        results["v4"] = await push("4")

        # 5. engine B dies as rank 0 starts moving data
        def killing(routes: Any, sources: Any) -> Any:
            os.kill(args.kill_pid, signal.SIGKILL)
            time.sleep(0.5)
            return original(routes, sources)

        if rank == 0:
            transport._send = killing  # type: ignore[method-assign]
        try:
            await transport.push([], version="5", dist=ctx)
            results["kill"] = {"error": None}
        except (WeightVerificationError, EngineError) as exc:
            results["kill"] = {"error": str(exc), "type": type(exc).__name__}
        transport._send = original  # type: ignore[method-assign]
        if rank == 0:
            results["kill"]["a_after"] = httpx.post(urls[0] + "/weights_checksum", json={}, timeout=60).json()
            results["kill"]["a_paused"] = httpx.get(urls[0] + "/server_info", timeout=60).json()["paused"]

        # 6. the version again: the client finds B down, the sessions follow it to engine A alone
        if rank == 0:
            assert client is not None
            await client.check_engines()
        await randomize_a(6)
        report = await transport.push([], version="6", dist=ctx)
        expected = full_checksums(model)
        if rank == 0:
            results["again"] = {
                "engines": list(transport.urls),
                "served": httpx.post(urls[0] + "/weights_checksum", json={}, timeout=60).json(),
                "paused": httpx.get(urls[0] + "/server_info", timeout=60).json()["paused"],
                "expected": expected,
                "report_checksums": report.checksums,
            }
    finally:
        await transport.close()
        if client is not None:
            await client.close()
    return results


def _rank(rank: int, world: int, args: argparse.Namespace) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = asyncio.run(scenario(rank, world, args))
        Path(args.out, f"rank{rank}.json").write_text(json.dumps(results))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--urls", required=True, help="engine A,engine B")
    parser.add_argument("--kill-pid", type=int, required=True, help="engine B's process id")
    parser.add_argument("--datapath", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=20.0)
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(2, args), nprocs=2, join=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
