"""The local engine as the RL loop drives it: a ``miles serve`` process over loopback HTTP, concurrent requests.

For each concurrency C (default 1, 8, 32) the same C prompts (``--prompt-len`` random tokens, ``--new-tokens``
sampled at temperature 1 with fixed lengths, EOS ignored) go three ways, in one run:

- **HTTP**: a ``miles serve`` process (``miles.engine``, ``--threads``) and the rollout's own client
  (:class:`~miles.rollout.http_client.HttpEngineClient`), C ``/generate`` requests in flight at once, each with
  its logprobs, as the rollout manager sends them;
- **in-process**: the same engine's scheduler driven directly in this process (``benchmarks.engine``): what
  the engine itself does, with no HTTP, JSON or admission in between;
- **HF ``generate``** on the same model in float32 (the reference of ``benchmarks/engine.py``).

The table gives decoded tokens/s of each and the ratios HTTP / in-process (what the serving path costs) and
HTTP / HF. Medians of ``--repeats`` after a warm-up::

    python -m benchmarks.engine_http                       # SmolLM2, bfloat16 and float32
    python -m benchmarks.engine_http --dtypes bfloat16 --concurrency 8

With ``--sglang`` (run with the python of the SGLang CPU environment, ``scripts/sglang/cpu_env.py``), real
SGLang 0.5.23 on its CPU path serves the same model in bfloat16 after the local engine, started as ``miles
train`` starts it (``SGLangEngine.launch`` with ``device="cpu"``, the cores of ``--threads`` bound with
``SGLANG_CPU_OMP_THREADS_BIND``), and the same rounds go to it through the same client: a second table, SGLang
against the local engine over HTTP, both bfloat16::

    $(python scripts/sglang/cpu_env.py) -m benchmarks.engine_http --dtypes bfloat16 --sglang

Writes ``benchmarks/results/engine_http.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    add_common_args,
    machine_info,
    markdown_table,
    model_dir,
    pin_threads,
    versions,
    write_result,
)


def _decode_steps(url: str) -> int:
    import httpx

    return int(httpx.get(f"{url}/server_info", timeout=30).json()["decode_steps"])


async def _http_round(url: str, prompts: list[list[int]], new: int, seed: int) -> float:
    from miles.rollout.http_client import HttpEngineClient
    from miles.rollout.protocol import SamplingParams

    async with HttpEngineClient([url]) as client:
        params = [
            SamplingParams(
                max_new_tokens=new, min_new_tokens=new, temperature=1.0, ignore_eos=True, sampling_seed=seed + i
            )
            for i in range(len(prompts))
        ]
        start = time.perf_counter()
        outs = await asyncio.gather(
            *(client.generate(p, sp, return_logprob=True) for p, sp in zip(prompts, params, strict=True))
        )
        elapsed = time.perf_counter() - start
    assert all(len(o[0].output_ids) == new for o in outs)
    return elapsed


def _in_process_round(state: Any, prompts: list[list[int]], new: int, as_http: bool, seed: int = 0) -> float:
    """The scheduler on this thread: greedy (``as_http=False``, ``benchmarks/engine.py``'s setting) or with the
    HTTP rounds' sampling (temperature 1, a seed per request, logprobs returned)."""
    from benchmarks.engine import run_engine

    if as_http:
        elapsed, _ = run_engine(state, prompts, new, n=1, temperature=1.0, seed=seed, return_logprob=True)
    else:
        elapsed, _ = run_engine(state, prompts, new, n=1)
    return elapsed


def _sglang_server(path: Path, levels: list[int], threads: int, run_dir: Path) -> Any:
    """Real SGLang on its CPU path serving ``path`` in bfloat16, started as ``miles train`` starts it (a
    context manager yielding its URL; the server and its processes are reaped on leaving)."""
    from contextlib import contextmanager

    from miles.launch.local import LocalLauncher
    from miles.net import free_port
    from miles_sglang.checks import cpu_problems
    from miles_sglang.engine import SGLangEngine
    from miles_sglang.settings import SGLangEngineSettings

    settings = SGLangEngineSettings(max_total_tokens=8192, max_running_requests=max(levels), log_level="warning")
    problems = cpu_problems(settings)
    if problems:
        raise SystemExit("--sglang: " + "; ".join(problems))
    launch = SGLangEngine(settings).launch(
        model_path=str(path), host="127.0.0.1", port=free_port(), device="cpu", dtype="bfloat16", devices=[], seed=0
    )
    cores = "0" if threads == 1 else f"0-{threads - 1}"
    launch.env = {**launch.env, "SGLANG_CPU_OMP_THREADS_BIND": cores, "OMP_NUM_THREADS": str(threads)}

    @contextmanager
    def serving() -> Any:
        with LocalLauncher(run_dir=str(run_dir)) as launcher:
            (url,) = launcher.start_engines([launch], timeout=1800)
            yield url

    return serving()


def _timed(round_: Any, repeats: int, steps: Any) -> tuple[float, float]:
    """Median seconds of ``repeats`` calls of ``round_(r)`` and the decode steps each took (mean)."""
    times, counts = [], []
    for r in range(repeats):
        before = steps()
        times.append(round_(r))
        counts.append(steps() - before)
    return statistics.median(times), statistics.mean(counts)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--model", default="smollm2", help="smollm2 or tiny")
    parser.add_argument("--concurrency", default="1,8,32", help="requests in flight at once")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument(
        "--sglang", action="store_true", help="also real SGLang on its CPU path, bfloat16 (the SGLang CPU environment)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.concurrency, args.new_tokens, args.repeats = "tiny", "1,8", 16, 1
    pin_threads(args.threads)
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.engine import run_hf
    from miles.engine.launch import build_engine
    from miles.testing.engine import EngineProcess

    levels = [int(c) for c in args.concurrency.split(",")]
    rows: list[tuple[Any, ...]] = []
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="miles-bench-engine-http-") as tmp:
        path = model_dir(args.model, Path(tmp))
        vocab = AutoModelForCausalLM.from_pretrained(path).config.vocab_size
        g = torch.Generator().manual_seed(0)
        prompts = {c: torch.randint(10, vocab - 10, (c, args.prompt_len), generator=g).tolist() for c in levels}
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hf_tps = {}
        for c in levels:
            run_hf(hf, prompts[c], 2)
            hf_tps[c] = (
                c
                * args.new_tokens
                / statistics.median(run_hf(hf, prompts[c], args.new_tokens) for _ in range(args.repeats))
            )
        del hf
        for dtype in args.dtypes.split(","):
            engine_args = ["--dtype", dtype, "--max-running-requests", str(max(levels))]
            http: dict[int, float] = {}
            http_steps: dict[int, float] = {}
            with EngineProcess(
                path, extra_args=engine_args, threads=args.threads, log_path=Path(tmp) / f"engine-{dtype}.log"
            ) as engine:
                url = engine.url
                for c in levels:
                    asyncio.run(_http_round(url, prompts[c], 2, 0))  # warm-up
                    seconds, http_steps[c] = _timed(
                        lambda r, c=c, url=url: asyncio.run(_http_round(url, prompts[c], args.new_tokens, r)),
                        args.repeats,
                        lambda url=url: _decode_steps(url),
                    )
                    http[c] = c * args.new_tokens / seconds
            # the served engine's own defaults (its prefix cache included), the scheduler on this thread
            state = build_engine(path, max_running_requests=max(levels), dtype=dtype, start=False)
            local: dict[int, float] = {}
            same: dict[int, float] = {}
            same_steps: dict[int, float] = {}
            try:
                for c in levels:
                    _in_process_round(state, prompts[c], 2, as_http=False)
                    seconds, _ = _timed(
                        lambda r, c=c, state=state: _in_process_round(
                            state, prompts[c], args.new_tokens, as_http=False
                        ),
                        args.repeats,
                        lambda state=state: state.scheduler.steps,
                    )
                    local[c] = c * args.new_tokens / seconds
                    seconds, same_steps[c] = _timed(
                        lambda r, c=c, state=state: _in_process_round(
                            state, prompts[c], args.new_tokens, as_http=True, seed=r
                        ),
                        args.repeats,
                        lambda state=state: state.scheduler.steps,
                    )
                    same[c] = c * args.new_tokens / seconds
            finally:
                state.scheduler.stop()
            results[dtype] = {
                "http": http,
                "in_process": local,
                "in_process_http_sampling": same,
                "decode_steps_http": http_steps,
                "decode_steps_in_process": same_steps,
                "hf_float32": hf_tps,
            }
            for c in levels:
                rows.append(
                    (
                        dtype,
                        c,
                        f"{http[c]:.1f}",
                        f"{local[c]:.1f}",
                        f"{same[c]:.1f}",
                        f"{http[c] / local[c]:.2f}x",
                        f"{same[c] / local[c]:.2f}x",
                        f"{http[c] / same[c]:.2f}x",
                        f"{http_steps[c]:.0f} / {same_steps[c]:.0f}",
                        f"{hf_tps[c]:.1f}",
                        f"{http[c] / hf_tps[c]:.2f}x",
                    )
                )
        if args.sglang:
            results["sglang_bfloat16"] = sglang = {"http": {}, "start_seconds": 0.0}
            start = time.perf_counter()
            with _sglang_server(path, levels, args.threads, Path(tmp) / "sglang") as url:
                sglang["start_seconds"] = time.perf_counter() - start
                for c in levels:
                    asyncio.run(_http_round(url, prompts[c], 2, 0))  # warm-up
                    seconds, _ = _timed(
                        lambda r, c=c, url=url: asyncio.run(_http_round(url, prompts[c], args.new_tokens, r)),
                        args.repeats,
                        lambda: 0,
                    )
                    sglang["http"][c] = c * args.new_tokens / seconds
    headers = [
        "engine dtype",
        "concurrent requests",
        "HTTP tok/s",
        "in-process greedy tok/s",
        "in-process, HTTP's sampling tok/s",
        "HTTP / in-process greedy",
        "of which sampling + logprobs",
        "of which serving",
        "decode steps HTTP / in-process",
        "HF generate fp32 tok/s",
        "HTTP / HF",
    ]
    print(
        f"## Engine over HTTP\n\n{args.model}, {args.threads} thread(s), prompts of {args.prompt_len} tokens, "
        f"{args.new_tokens} new tokens sampled (fixed length), median of {args.repeats}\n"
    )
    print(markdown_table(headers, rows))
    if args.sglang:
        local_bf16 = results.get("bfloat16", {}).get("http", {})
        served = results["sglang_bfloat16"]["http"]
        print(
            f"\n## SGLang on its CPU path against the local engine, over HTTP\n\nthe same rounds, bfloat16 both, "
            f"{args.threads} thread(s) each, {machine_info('cpu')['cpu']}; SGLang started in "
            f"{results['sglang_bfloat16']['start_seconds']:.0f} s\n"
        )
        print(
            markdown_table(
                ["concurrent requests", "SGLang tok/s", "local engine tok/s", "SGLang / local"],
                [
                    (
                        c,
                        f"{served[c]:.1f}",
                        f"{local_bf16[c]:.1f}" if c in local_bf16 else "-",
                        f"{served[c] / local_bf16[c]:.2f}x" if c in local_bf16 else "-",
                    )
                    for c in levels
                ],
            )
        )
    payload = {
        "machine": machine_info("cpu"),
        "versions": versions(("sglang", "sglang-kernel-cpu") if args.sglang else ()),
        "config": {k: v for k, v in vars(args).items() if k != "results_dir"},
        "results": results,
    }
    write_result("engine_http", payload, args.results_dir)
    return payload


if __name__ == "__main__":
    main()
