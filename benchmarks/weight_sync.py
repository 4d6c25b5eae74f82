"""Weight-sync bandwidth of each transport against this host's memcpy, for models of 10M-500M parameters.

For Llama configs of about 9M, 25M, 83M, 200M and 470M parameters (random weights, no training) a local
engine (``python -m miles.engine --model DIR``) serves the model, and this process plays trainer rank 0:
it pushes the full fp32 state dict in 256 MiB buckets (the ``transport.bucket_bytes`` default) through
the real transport classes of ``miles.transport`` with a real :class:`~miles.rollout.http_client.HttpEngineClient`:

- ``disk``: safetensors shards written to a folder, then ``/update_weights_from_disk``;
- ``broadcast``: a gloo (CPU) / NCCL (GPU) group spanning this process and the engine,
  ``/update_weights_from_distributed`` per bucket, then ``/update_weight_version``.

A push is timed from the first byte to the engine serving the new version (checked with
``/get_weight_version`` after the clock stops). One warm-up push, then the median of ``--repeats``.
Bandwidth is bytes of weights per second, set against the same process's memcpy bandwidth (one large
``torch`` tensor copy, measured in the same run). Push time against parameters is fitted with a line:
slope (the per-parameter cost), intercept (the fixed cost of a push) and R^2::

    python -m benchmarks.weight_sync                  # 5 sizes, both transports
    python -m benchmarks.weight_sync --quick          # 3 sizes up to ~83M
    python -m benchmarks.weight_sync --device cuda    # engine on the GPU, NCCL broadcast

Prints a markdown table and writes ``benchmarks/results/weight_sync.json``.
"""

from __future__ import annotations

import argparse
import asyncio
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

SIZES: dict[str, dict[str, int]] = {
    "9M": {"hidden_size": 128, "num_hidden_layers": 4, "intermediate_size": 512, "num_attention_heads": 4},
    "25M": {"hidden_size": 256, "num_hidden_layers": 8, "intermediate_size": 1024, "num_attention_heads": 4},
    "83M": {"hidden_size": 512, "num_hidden_layers": 12, "intermediate_size": 2048, "num_attention_heads": 8},
    "200M": {"hidden_size": 768, "num_hidden_layers": 16, "intermediate_size": 3072, "num_attention_heads": 12},
    "470M": {"hidden_size": 1024, "num_hidden_layers": 24, "intermediate_size": 4096, "num_attention_heads": 16},
}
"""Llama shapes (32,000-token vocabulary, untied embeddings) named by their approximate size."""

BUCKET_BYTES = 256 << 20


def build_model(path: Path, shape: dict[str, int], seed: int = 0) -> tuple[Path, int]:
    """A randomly initialised Llama of ``shape`` saved as safetensors with a small tokenizer; returns
    the directory and the parameter count."""
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
    del model
    return path, params


def buckets_of(state: dict[str, Any], bucket_bytes: int) -> list[list[tuple[str, Any]]]:
    """The state dict as (name, tensor) buckets of at most ``bucket_bytes`` (a larger tensor goes alone)."""
    out: list[list[tuple[str, Any]]] = [[]]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if out[-1] and size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, tensor))
        size += nbytes
    return out


async def _has_route(client: Any, url: str, endpoint: str) -> bool:
    """Whether the engine serves ``endpoint`` (a 404 says it does not; a 4xx on an empty body says it does)."""
    from miles.errors import EngineError

    try:
        await client.call(url, endpoint, {})
    except EngineError as exc:
        return "HTTP 404" not in str(exc)
    return True


async def _served_version(url: str) -> str:
    import httpx

    async with httpx.AsyncClient(timeout=60.0) as http:
        resp = await http.get(url + "/get_weight_version")
        resp.raise_for_status()
        return str(resp.json()["weight_version"])


async def _measure_transport(
    name: str, engine_url: str, model: Path, workdir: Path, state: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    import torch

    from miles.rollout.http_client import HttpEngineClient
    from miles.training.trainer import DistContext
    from miles.transport.broadcast import BroadcastTransport, BroadcastTransportSettings
    from miles.transport.disk import DiskTransport, DiskTransportSettings

    client = HttpEngineClient([engine_url], timeout=1800.0)
    dist = DistContext(rank=0, world_size=1, device=args.device)
    try:
        needed = "/update_weights_from_disk" if name == "disk" else "/init_weights_update_group"
        if not await _has_route(client, engine_url, needed):
            return {"unavailable": f"the engine has no {needed} route at this commit (HTTP 404)"}
        if name == "disk":
            transport: Any = DiskTransport(
                DiskTransportSettings(dir=str(workdir / "pushed")),
                run_dir=str(workdir),
                model_path=str(model),
                engine_dtype="float32",
            )
        else:
            transport = BroadcastTransport(
                BroadcastTransportSettings(timeout=600.0),
                run_dir=str(workdir),
                model_path=str(model),
                engine_dtype="float32",
            )
        await transport.connect(client, dist)
        buckets = buckets_of(state, BUCKET_BYTES)
        times: list[float] = []
        num_bytes = 0
        for i in range(1 + args.repeats):
            version = f"{name}-{i + 1}"
            if args.device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            report = await transport.push(iter(buckets), version=version, dist=dist)
            elapsed = time.perf_counter() - start
            served = await _served_version(engine_url)
            if served != version:
                raise RuntimeError(f"{name}: after pushing version {version} the engine serves {served!r}")
            num_bytes = report.num_bytes
            if i > 0:
                times.append(elapsed)
        await transport.close()
        seconds = median(times)
        return {
            "seconds": seconds,
            "times": times,
            "bytes": num_bytes,
            "gbps": num_bytes / seconds / 1e9,
            "buckets": len(buckets),
        }
    finally:
        await client.close()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument(
        "--sizes", default=None, help=f"comma-separated of {', '.join(SIZES)} (default all; --quick the first 3)"
    )
    parser.add_argument("--transports", default="disk,broadcast")
    parser.add_argument("--repeats", type=int, default=None, help="timed pushes per size (default 3; --quick 2)")
    args = parser.parse_args(argv)
    sizes = (args.sizes or ",".join(list(SIZES)[: 3 if args.quick else len(SIZES)])).split(",")
    transports = args.transports.split(",")
    args.repeats = args.repeats or (2 if args.quick else 3)
    pin_threads(args.threads)

    from safetensors.torch import load_file

    from miles.engine.process import EngineProcess

    memcpy = memcpy_gbps(device=args.device, megabytes=256 if args.quick else 1024)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="miles-bench-sync-") as tmp:
        for size in sizes:
            if size not in SIZES:
                raise SystemExit(f"--sizes: unknown size {size!r} (expected one of {', '.join(SIZES)})")
            workdir = Path(tmp) / size
            model, params = build_model(workdir / "model", SIZES[size])
            state = {}
            for shard in sorted(model.glob("*.safetensors")):
                state.update(load_file(str(shard), device="cuda" if args.device == "cuda" else "cpu"))
            entry: dict[str, Any] = {"params": params}
            engine = EngineProcess(
                model,
                threads=args.threads,
                extra_args=["--device", args.device],
                log_path=workdir / "engine.log",
                startup_timeout=600,
            )
            with engine:
                for name in transports:
                    try:
                        entry[name] = asyncio.run(_measure_transport(name, engine.url, model, workdir, state, args))
                    except Exception as exc:  # one transport failing must not hide the others' figures
                        entry[name] = {"failed": f"{type(exc).__name__}: {exc}"}
                        print(f"{name} at {size}: FAILED: {exc}", file=sys.stderr, flush=True)
            del state
            results[size] = entry

    rows = []
    fits: dict[str, dict[str, float]] = {}
    for name in transports:
        measured = [(r["params"], r[name]) for r in results.values() if "seconds" in r[name]]
        for params, r in measured:
            rows.append(
                (
                    name,
                    f"{params / 1e6:.0f}M",
                    f"{r['bytes'] / 1e9:.2f}",
                    f"{r['seconds']:.3f}",
                    f"{r['gbps']:.2f}",
                    f"{100 * r['gbps'] / memcpy:.1f}%",
                )
            )
        if len(measured) >= 2:
            fits[name] = linear_fit([p for p, _ in measured], [r["seconds"] for _, r in measured])
    header = (
        f"## Weight sync\n\nfp32 weights, {args.device}, {args.threads} threads per process, one local engine, "
        f"{BUCKET_BYTES >> 20} MiB buckets, median of {args.repeats} pushes after 1 warm-up; "
        f"memcpy of this host in the same run: {memcpy:.1f} GB/s\n"
    )
    print(header)
    print(markdown_table(["transport", "params", "GB pushed", "push s (median)", "GB/s", "of memcpy"], rows))
    for name, fit in fits.items():
        per_gb = fit["slope"] * 1e9 / 4  # seconds per GB of fp32 weights
        print(
            f"\n{name}: push_s = {fit['slope'] * 1e9:.2f} s per 1B params x params + {fit['intercept']:.3f} s, "
            f"R^2 = {fit['r2']:.4f} (marginal rate {1 / per_gb:.2f} GB/s)"
        )
    for name in transports:
        for key, what in (("unavailable", "not measured"), ("failed", "FAILED")):
            missing = {size: r[name][key] for size, r in results.items() if key in r[name]}
            if missing:
                print(f"\n- {name}: {what} at {', '.join(missing)}: {next(iter(missing.values()))}")
    payload = {
        "machine": machine_info(args.device),
        "versions": versions(("safetensors", "httpx")),
        "config": {k: v for k, v in vars(args).items() if k != "results_dir"},
        "memcpy_gbps": memcpy,
        "bucket_bytes": BUCKET_BYTES,
        "results": results,
        "fits": fits,
    }
    path = write_result("weight_sync", payload, args.results_dir)
    print(f"\n(written {path})")
    return payload


if __name__ == "__main__":
    main()
