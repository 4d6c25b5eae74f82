"""Images per second of the Miles image engine against the diffusers pipeline's own sampling.

Same model (the tiny SD3-style policy of ``miles_diffusion.policy``), same number of steps, same image
size and batch, threads pinned, one run:

- ``diffusers StableDiffusion3Pipeline``: ``pipe(prompts, num_inference_steps=S, generator=[...])`` in this
  process (ODE sampling, images only);
- ``engine loop, in process``: :func:`miles_diffusion.sampling.sample_trajectories` (Flow-GRPO's SDE on every
  step, per-step log-probs and the recorded latents for training);
- ``engine over HTTP, batched`` / ``deterministic``: ``python -m miles_diffusion.engine`` answering one
  ``/generate`` request per image (B at once), each answer a PNG plus the trajectory in base64; batched
  mode denoises the B images together, deterministic mode one at a time.

``python -m benchmarks.diffusion [--batch 8] [--steps 10] [--repeats 3] [--threads 1]``; prints a markdown
table and writes ``benchmarks/results/diffusion.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import add_common_args, machine_info, markdown_table, median, pin_threads, write_result

PROMPTS = ["a red square", "a green cat", "a blue sky", "a white house"]


def _rate(seconds: list[float], images: int) -> float:
    return images / median(seconds)


def bench_pipeline(pipe: Any, batch: int, steps: int, repeats: int) -> list[float]:
    import torch

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    times = []
    for r in range(repeats + 1):
        generators = [torch.Generator().manual_seed(r * batch + i) for i in range(batch)]
        start = time.perf_counter()
        pipe(
            prompts, num_inference_steps=steps, guidance_scale=1.0, height=32, width=32, generator=generators,
            max_sequence_length=16, output_type="pil",
        )  # fmt: skip
        if r:  # the first run warms up
            times.append(time.perf_counter() - start)
    return times


def bench_loop(pipe: Any, batch: int, steps: int, repeats: int) -> list[float]:
    from miles_diffusion.sampling import SamplingOptions, sample_trajectories

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    options = SamplingOptions(num_steps=steps, height=32, width=32, max_sequence_length=16)
    times = []
    for r in range(repeats + 1):
        start = time.perf_counter()
        sample_trajectories(pipe, prompts, [r * batch + i for i in range(batch)], options)
        if r:
            times.append(time.perf_counter() - start)
    return times


def bench_engine(
    policy: Path, pipe: Any, batch: int, steps: int, repeats: int, threads: int, *, deterministic: bool
) -> list[float]:
    import httpx

    from miles_diffusion.testing import ImageEngineProcess

    flags = ["--num-steps", str(steps), "--height", "32", "--width", "32", "--max-sequence-length", "16"]
    flags += ["--max-batch-size", str(batch)] + (["--enable-deterministic-inference"] if deterministic else [])
    ids = [list(pipe.tokenizer(PROMPTS[i % len(PROMPTS)])["input_ids"]) for i in range(batch)]

    async def one_round(url: str, r: int) -> float:
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:
            start = time.perf_counter()
            answers = await asyncio.gather(
                *(
                    http.post(
                        "/generate", json={"input_ids": ids[i], "sampling_params": {"sampling_seed": r * batch + i}}
                    )
                    for i in range(batch)
                )
            )
            elapsed = time.perf_counter() - start
        if any(a.status_code != 200 or a.json()["meta_info"]["finish_reason"]["type"] != "stop" for a in answers):
            raise RuntimeError("the engine did not answer every request")
        return elapsed

    with ImageEngineProcess(policy, extra_args=flags, threads=threads) as engine:
        return [t for r, t in enumerate(asyncio.run(one_round(engine.url, r)) for r in range(repeats + 1)) if r]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--batch", type=int, default=8, help="images per round (default 8)")
    parser.add_argument("--steps", type=int, default=10, help="denoising steps (default 10)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per method (default 3; --quick 2)")
    args = parser.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 3)
    pin_threads(args.threads)

    from miles_diffusion.policy import build_tiny_policy, load_pipeline

    rows: list[tuple[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="miles-bench-diffusion-") as tmp:
        policy = build_tiny_policy(Path(tmp) / "policy", seed=0)
        pipe = load_pipeline(policy)
        rows.append(
            (
                "diffusers StableDiffusion3Pipeline (ODE, images only)",
                _rate(bench_pipeline(pipe, args.batch, args.steps, repeats), args.batch),
            )
        )
        rows.append(
            (
                "engine loop, in process (SDE + log-probs + latents)",
                _rate(bench_loop(pipe, args.batch, args.steps, repeats), args.batch),
            )
        )
        for deterministic in (False, True):
            seconds = bench_engine(
                policy, pipe, args.batch, args.steps, repeats, args.threads, deterministic=deterministic
            )
            label = "deterministic (one image per forward)" if deterministic else "batched"
            rows.append((f"engine over HTTP, {label}", _rate(seconds, args.batch)))
    base = rows[0][1]
    table = markdown_table(
        ["sampler", "images/s", "vs diffusers pipeline"],
        [(name, f"{rate:.1f}", f"{rate / base:.2f}x") for name, rate in rows],
    )
    print(
        f"tiny SD3-style policy, 32 x 32, {args.steps} steps, batch {args.batch}, {args.threads} thread(s), median of {repeats}\n"
    )
    print(table)
    payload = {
        "machine": machine_info(args.device),
        "settings": {"batch": args.batch, "steps": args.steps, "repeats": repeats, "threads": args.threads},
        "images_per_second": dict(rows),
        "table": table,
    }
    write_result("diffusion", payload, args.results_dir)
    return payload


if __name__ == "__main__":
    main()
