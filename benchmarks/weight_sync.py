"""Weight-sync time of every transport at 2 trainer ranks x 1, 2 and 4 engines on this host, against memcpy.

A Llama of about 83M parameters (``--size``; random weights, fp32 trainer and engines) is served by four
local engine processes (``python -m miles.engine``, one thread each). Two trainer ranks (a gloo world,
spawned here, one thread each) hold it sharded with FSDP2 (``fully_shard``, as the ``fsdp`` trainer does)
and push it through the real transport classes with a real :class:`~miles.rollout.http_client.HttpEngineClient`
to the first 1, 2 and 4 engines:

- ``broadcast``: rank 0 gathers every parameter (``DTensor.full_tensor``) into 256 MiB buckets and
  broadcasts them over a gloo group spanning it and the engines;
- ``disk``: rank 0 gathers, writes safetensors shards, the engines load them (``/update_weights_from_disk``);
- ``disk_delta``: rank 0 gathers, writes the XOR + zstd delta against the previous push (fsync'd, atomic);
- ``p2p-torch`` / ``p2p-mooncake`` / ``p2p-shm``: the ``p2p`` transport (``miles-p2p``): each rank sends
  its own shards, over ``torch.distributed`` send/recv (gloo), the Mooncake Transfer Engine (TCP on
  loopback), or shared memory (``/dev/shm``, one buffer for all the engines of the host), into receive
  buffers that the engines copy into their weights at the commit;
- ``p2p-shm-direct``: ``p2p`` over shared memory with ``write_into_weights``: the ranks write into the
  paused engines' weights themselves (one copy; a failed push leaves the engines paused on partial weights);
- ``shm-example``: the example third-party transport (``examples/plugins/miles-shm-transport``), when installed.

Every case gets ``--repeats`` timed pushes (default 5) after one warm-up; the tables show medians.

Before each push every rank moves its shards by an Adam-sized step (every element by 1e-5), so each push
carries a new version (fp32 deltas are therefore large: ``disk_delta`` pays off with bf16 engines, see
``benchmarks/disk_delta.py``). **push s** runs from the push call to every engine serving the new
version (for ``broadcast`` and ``disk`` that includes the trainer's checksums, which they compute inside
the push); **checks s** is the verification after it (``p2p``: the chunk check inside its push; all: the
driver's ``verify_engines``, a SHA-256 per tensor on every engine). GB/s is one copy of the model's bytes
over push s, set against this process's memcpy (one large tensor copy, measured in the same run). One
warm-up push, then the median of ``--repeats``.

From the measured figures a model of T(n) for n nodes per side is fitted (:func:`fit_scaling`), and where
p2p overtakes broadcast as nodes grow is set beside the seed's published numbers::

    python -m benchmarks.weight_sync                   # 83M, all transports, 1/2/4 engines
    python -m benchmarks.weight_sync --quick           # 25M, 1/2 engines, 2 repeats
    python -m benchmarks.weight_sync --transports p2p-shm,broadcast --engines 1,4

Prints markdown tables and writes ``benchmarks/results/weight_sync.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    add_common_args,
    linear_fit,
    machine_info,
    markdown_table,
    median,
    memcpy_gbps,
    pin_threads,
    versions,
    write_result,
)
from miles.net import free_port

SIZES: dict[str, dict[str, int]] = {
    "9M": {"hidden_size": 128, "num_hidden_layers": 4, "intermediate_size": 512, "num_attention_heads": 4},
    "25M": {"hidden_size": 256, "num_hidden_layers": 8, "intermediate_size": 1024, "num_attention_heads": 4},
    "83M": {"hidden_size": 512, "num_hidden_layers": 12, "intermediate_size": 2048, "num_attention_heads": 8},
    "200M": {"hidden_size": 768, "num_hidden_layers": 16, "intermediate_size": 3072, "num_attention_heads": 12},
}
"""Llama shapes (32,000-token vocabulary, untied embeddings) named by their approximate size."""

TRANSPORTS = (
    "broadcast",
    "disk",
    "disk_delta",
    "p2p-torch",
    "p2p-mooncake",
    "p2p-shm",
    "p2p-shm-direct",
    "shm-example",
)
BUCKET_BYTES = 256 << 20
SEED_PUBLISHED = {
    "GLM-5 744B, 16 nodes per side": {"broadcast_s": 58.30, "p2p_s": 8.48},
    "Kimi K2 1T, 32 nodes per side": {"broadcast_s": 53.28, "p2p_s": 7.23},
    "single node": {"p2p_slower_than_broadcast": "up to ~70%"},
}
"""The seed's published figures (radixark/miles, P2P weight transfer), quoted, not measured here."""


def build_model(path: Path, shape: dict[str, int], seed: int = 0) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from miles.testing.models import build_tokenizer

    config = LlamaConfig(
        vocab_size=32000,
        num_key_value_heads=shape["num_attention_heads"],
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        **shape,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer().save_pretrained(path)
    return params


# -- the trainer ranks -------------------------------------------------------------------------------
class Shards:
    """What the ``p2p`` transport reads: the FSDP2 model's own shards."""

    precision = None

    def __init__(self, model: Any) -> None:
        self.model = model

    def iter_weight_shards(self, bucket_bytes: int = 0) -> Any:
        from miles_fsdp.weights import iter_weight_shards

        return iter_weight_shards(self.model)


def make_transport(name: str, work: Path, model_path: str) -> Any:
    common = {"run_dir": str(work), "model_path": model_path, "engine_dtype": "float32"}
    if name == "broadcast":
        from miles.transport.broadcast import BroadcastTransport, BroadcastTransportSettings

        return BroadcastTransport(BroadcastTransportSettings(), **common)
    if name == "disk":
        from miles.transport.disk import DiskTransport, DiskTransportSettings

        return DiskTransport(DiskTransportSettings(dir=str(work / "disk")), **common)
    if name == "disk_delta":
        from miles.transport.disk_delta import DiskDeltaTransport, DiskDeltaTransportSettings

        return DiskDeltaTransport(DiskDeltaTransportSettings(dir=str(work / "delta"), full_every=1000), **common)
    if name.startswith("p2p-"):
        from miles_p2p.settings import P2PTransportSettings
        from miles_p2p.transport import P2PTransport

        direct = name.endswith("-direct")
        datapath = name.removeprefix("p2p-").removesuffix("-direct")
        settings = P2PTransportSettings(datapath=datapath, write_into_weights=direct)  # type: ignore[arg-type]
        return P2PTransport(settings, **common)
    if name == "shm-example":
        from miles_shm_transport.transport import ShmTransport, ShmTransportSettings

        return ShmTransport(ShmTransportSettings(), **common)
    raise SystemExit(f"--transports: unknown transport {name!r} (expected one of {', '.join(TRANSPORTS)})")


async def measure(rank: int, args: dict[str, Any], urls: list[str], model: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from miles.rollout.http_client import HttpEngineClient
    from miles.training.comm import all_gather_json
    from miles.training.trainer import DistContext
    from miles.transport.verify import verify_engines
    from miles_fsdp.weights import iter_full_weights

    ctx = DistContext(rank=rank, world_size=dist.get_world_size())
    work = Path(args["work"])
    results: dict[str, Any] = {}
    generator = torch.Generator().manual_seed(rank)
    step = 0

    def adam_step() -> None:
        with torch.no_grad():
            for p in model.parameters():
                local = p.to_local()
                local.add_(1e-5 * torch.randn(local.shape, generator=generator).sign())

    for engines in args["engines"]:
        client = HttpEngineClient(urls[:engines], timeout=1800.0) if rank == 0 else None
        for name in args["transports"]:
            key = f"{name}/{engines}"
            try:
                transport = make_transport(name, work / key.replace("/", "-"), args["model"])
                if name.startswith("p2p-"):
                    transport.attach(Shards(model))
                await transport.connect(client, ctx)
                rows: list[dict[str, float]] = []
                for i in range(1 + args["repeats"]):
                    adam_step()
                    step += 1
                    version = str(step)
                    buckets = iter_full_weights(model, BUCKET_BYTES, rank=rank)
                    dist.barrier()
                    start = time.perf_counter()
                    failure: str | None = None
                    try:  # a push that fails on one rank only (an engine refusing rank 0's load) fails on all
                        report = await transport.push(buckets, version=version, dist=ctx)
                    except Exception as exc:
                        failure = f"{type(exc).__name__}: {exc}"
                    failures = [f for f in all_gather_json(failure) if f]
                    if failures:
                        raise RuntimeError(failures[0])
                    pushed = time.perf_counter() - start
                    served = report.metrics.get("weight_sync/served_seconds", pushed)
                    verify = 0.0
                    if rank == 0:
                        assert client is not None
                        check = time.perf_counter()
                        await verify_engines(client, version=version, checksums_by_dtype={"float32": report.checksums})
                        verify = time.perf_counter() - check
                    dist.barrier()
                    if i > 0:
                        rows.append(
                            {
                                "push_s": served,
                                "checks_s": pushed - served + verify,
                                "bytes": float(report.num_bytes),
                                **{k: v for k, v in report.metrics.items() if isinstance(v, float)},
                            }
                        )
                await transport.close()
                results[key] = {
                    "transport": name,
                    "engines": engines,
                    "rows": rows,
                    **{k: median([r[k] for r in rows]) for k in rows[0] if all(k in r for r in rows)},
                }
            except Exception as exc:  # one transport failing must not hide the others' figures
                results[key] = {"transport": name, "engines": engines, "failed": f"{type(exc).__name__}: {exc}"}
                print(f"{key}: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        if client is not None:
            await client.close()
    return results


def _rank(rank: int, args: dict[str, Any], urls: list[str]) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args["port"])
    pin_threads(args["threads"])
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from miles_fsdp.model import load_causal_lm, shard_model

    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = load_causal_lm(args["model"], seed=0, attn_implementation="eager")
        model = shard_model(
            model,
            init_device_mesh("cpu", (2,)),
            param_dtype=torch.float32,
            reduce_dtype=torch.float32,
            reshard_after_forward=True,
            cpu_offload=False,
            activation_checkpointing=False,
        )
        results = asyncio.run(measure(rank, args, urls, model))
        if rank == 0:
            Path(args["out"]).write_text(json.dumps(results))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# -- the fitted model --------------------------------------------------------------------------------
def fit_scaling(results: dict[str, Any], model_bytes: float) -> dict[str, Any]:
    """A model of push time for ``n`` nodes per side, fitted from the per-link figures measured here.

    Setting (the seed's): one model of ``M`` bytes, trained on ``n`` trainer nodes (each holds ``M / n``)
    and served by one engine replica sharded over ``n`` engine nodes.

    - ``p2p``: every trainer node sends its ``M / n`` over its own link, in parallel:
      ``T_p(n) = c + (M / n) / R``. ``R`` is the per-link rate measured here: one rank moved its half of
      the model to one engine in ``T_p(1 engine) - c``; ``c`` (the fixed cost: layouts, the commit's HTTP
      round trips) is the intercept of ``T_p`` against the engine count, clipped to ``[0, T_p(1)]``.
    - ``broadcast``: rank 0 gathers all ``M`` and sends it into one group of every engine node, so it does
      not shrink with ``n``; each group member adds ``b`` (the slope of ``T_b`` against the engine count,
      clipped at 0): ``T_b(n) = T_b(1) + b (n - 1)``.

    Also the same laws calibrated to the seed's single node (p2p 1.7x broadcast there): the relative
    growth per node ``b / T_b(1)`` and the fixed fraction of p2p ``c / T_p(1)`` from this host.
    """
    out: dict[str, Any] = {}
    by: dict[str, dict[int, float]] = {}
    for r in results.values():
        if "push_s" in r:
            by.setdefault(r["transport"], {})[r["engines"]] = r["push_s"]
    if "broadcast" not in by or 1 not in by["broadcast"]:
        return out
    bc = by["broadcast"]
    b1 = bc[1]
    slope = linear_fit(list(bc), list(bc.values()))["slope"] if len(bc) >= 2 else 0.0
    per_node = max(slope, 0.0)
    for name, points in by.items():
        if not name.startswith("p2p-") or 1 not in points:
            continue
        one = points[1]
        intercept = linear_fit(list(points), list(points.values()))["intercept"] if len(points) >= 2 else 0.0
        fixed = min(max(intercept, 0.0), 0.9 * one)
        rate = (model_bytes / 2) / (one - fixed)

        def t_p(n: int, fixed: float = fixed, rate: float = rate) -> float:
            return fixed + (model_bytes / n) / rate

        def t_b(n: int) -> float:
            return b1 + per_node * (n - 1)

        f = fixed / t_p(1)
        g = per_node / b1

        def seed_ratio(n: int, f: float = f, g: float = g) -> float:  # broadcast / p2p, seed: T_p(1) = 1.7 T_b(1)
            return (1 + g * (n - 1)) / (1.7 * (f + (1 - f) / n))

        out[name] = {
            "link_gbps": rate / 1e9,
            "fixed_s": fixed,
            "broadcast_1_s": b1,
            "broadcast_per_node_s": per_node,
            "ratio_at": {n: t_b(n) / t_p(n) for n in (1, 2, 4, 16, 32)},
            "crossover_nodes": next((n for n in range(1, 4097) if t_p(n) < t_b(n)), None),
            "seed_calibrated_ratio_at": {n: seed_ratio(n) for n in (1, 2, 4, 16, 32)},
            "seed_calibrated_crossover_nodes": next((n for n in range(1, 4097) if seed_ratio(n) > 1), None),
        }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--size", default=None, help=f"one of {', '.join(SIZES)} (default 83M; --quick 25M)")
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    parser.add_argument("--engines", default=None, help="comma-separated engine counts (default 1,2,4; --quick 1,2)")
    parser.add_argument("--repeats", type=int, default=None, help="timed pushes per case (default 3; --quick 2)")
    args = parser.parse_args(argv)
    size = args.size or ("25M" if args.quick else "83M")
    if size not in SIZES:
        raise SystemExit(f"--size: unknown size {size!r} (expected one of {', '.join(SIZES)})")
    engines = [int(e) for e in (args.engines or ("1,2" if args.quick else "1,2,4")).split(",")]
    transports = args.transports.split(",")
    if "shm-example" in transports:
        try:
            import miles_shm_transport  # noqa: F401
        except ImportError:
            transports.remove("shm-example")
            print("(shm-example not installed: pip install -e examples/plugins/miles-shm-transport)", file=sys.stderr)
    repeats = args.repeats or (2 if args.quick else 5)
    pin_threads(args.threads)

    from miles.testing.engine import EngineProcess

    memcpy = memcpy_gbps(megabytes=256)
    with tempfile.TemporaryDirectory(prefix="miles-bench-sync-") as tmp:
        work = Path(tmp)
        model = work / "model"
        params = build_model(model, SIZES[size])
        model_bytes = params * 4
        procs = [
            EngineProcess(
                model,
                threads=args.threads,
                extra_args=[
                    "--device",
                    args.device,
                    "--attention-backend",
                    "sdpa",
                    "--allowed-weight-dirs",
                    os.pathsep.join([tmp, "/dev/shm"]),
                ],  # shm-example's files
                log_path=work / f"engine-{i}.log",
                startup_timeout=600,
            )
            for i in range(max(engines))
        ]
        try:
            for p in procs:
                p.start(wait=False)
            for p in procs:
                p.wait_ready()
            port = free_port()
            job = {
                "work": str(work),
                "model": str(model),
                "engines": engines,
                "transports": transports,
                "repeats": repeats,
                "threads": args.threads,
                "port": port,
                "out": str(work / "results.json"),
            }
            import torch.multiprocessing as mp

            mp.spawn(_rank, args=(job, [p.url for p in procs]), nprocs=2, join=True)
            results = json.loads((work / "results.json").read_text())
        finally:
            for p in procs:
                p.stop()

    rows = []
    for r in results.values():
        if "failed" in r:
            rows.append((r["transport"], r["engines"], "FAILED", "", "", "", r["failed"][:80]))
            continue
        gbps = model_bytes / r["push_s"] / 1e9
        notes = ""
        if "weight_sync/bytes_written" in r:
            notes = f"{r['weight_sync/bytes_written'] / 1e6:.0f} MB written"
        rows.append(
            (
                r["transport"],
                r["engines"],
                f"{r['push_s']:.3f}",
                f"{gbps:.2f}",
                f"{100 * gbps / memcpy:.1f}%",
                f"{r['checks_s']:.3f}",
                notes,
            )
        )
    print(
        f"## Weight sync\n\n{params / 1e6:.0f}M-parameter Llama, fp32 ({model_bytes / 1e9:.2f} GB), {args.device}, "
        f"2 trainer ranks (FSDP2) and 1-{max(engines)} local engines, {args.threads} thread(s) per process, "
        f"median of {repeats} pushes after 1 warm-up; memcpy of this host in the same run: {memcpy:.1f} GB/s\n"
    )
    print(markdown_table(["transport", "engines", "push s", "GB/s", "of memcpy", "checks s", "notes"], rows))
    breakdown = []
    for r in results.values():
        if r.get("transport", "").startswith("p2p-") and "push_s" in r:
            layout = r.get("weight_sync/layout_seconds", 0.0) + r.get("weight_sync/begin_seconds", 0.0)
            send = r.get("weight_sync/send_seconds", 0.0)
            commit = r.get("weight_sync/commit_seconds", 0.0)
            breakdown.append(
                (
                    r["transport"],
                    r["engines"],
                    f"{layout:.3f}",
                    f"{send:.3f}",
                    f"{commit:.3f}",
                    f"{r['push_s'] - layout - send - commit:.3f}",
                    f"{r.get('weight_sync/slice_check_seconds', 0):.3f}",
                )
            )
    if breakdown:
        print("\n### Where a p2p push goes (medians on rank 0, s)\n")
        print(
            markdown_table(
                [
                    "transport",
                    "engines",
                    "layouts + plan key (+ pause, direct)",
                    "send (rank 0's chunks)",
                    "commit (engines copy in)",
                    "gathers, ready check, HTTP",
                    "chunk checks (after)",
                ],
                breakdown,
            )
        )
    fits = fit_scaling(results, model_bytes)
    if fits:
        print("\n### p2p against broadcast as nodes grow (a model fitted from the figures above; on paper)\n")
        model_rows = []
        for name, fit in fits.items():
            ratio = fit["ratio_at"]
            seed = fit["seed_calibrated_ratio_at"]
            model_rows.append(
                (
                    name,
                    f"{fit['link_gbps']:.2f}",
                    f"{fit['fixed_s']:.3f}",
                    f"{fit['broadcast_per_node_s']:.3f}",
                    " / ".join(f"{ratio[n]:.1f}" for n in (1, 16, 32)),
                    str(fit["crossover_nodes"]),
                    " / ".join(f"{seed[n]:.1f}" for n in (1, 16, 32)),
                    str(fit["seed_calibrated_crossover_nodes"]),
                )
            )
        print(
            markdown_table(
                [
                    "p2p data path",
                    "per-link GB/s",
                    "p2p fixed s",
                    "broadcast s per node",
                    "broadcast/p2p at n = 1 / 16 / 32",
                    "p2p faster from n",
                    "same, from the seed's n = 1",
                    "p2p faster from n (seed-calibrated)",
                ],
                model_rows,
            )
        )
    print(
        "\nSeed (published, not measured here): GLM-5 744B 58.30 s -> 8.48 s at 16 nodes per side (6.9x); "
        "Kimi K2 1T 53.28 s -> 7.23 s at 32 (7.4x); p2p up to ~70% slower than broadcast on a single node (0.6x)."
    )
    payload = {
        "machine": machine_info(args.device),
        "versions": versions(("safetensors", "httpx", "miles-p2p", "mooncake-transfer-engine-non-cuda", "zstandard")),
        "config": {k: v for k, v in vars(args).items() if k != "results_dir"},
        "size": size,
        "params": params,
        "model_bytes": model_bytes,
        "memcpy_gbps": memcpy,
        "results": results,
        "fits": fits,
        "seed_published": SEED_PUBLISHED,
    }
    path = write_result("weight_sync", payload, args.results_dir)
    print(f"\n(written {path})")
    return payload


if __name__ == "__main__":
    main()
