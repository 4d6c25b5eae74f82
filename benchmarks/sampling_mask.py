"""Sampling-mask replay (issue 40): the train-vs-rollout logprob mismatch with top-p 0.9 / top-k 20, with and
without replay, and what replay costs.

A local engine serves the model; it samples responses to arithmetic chat prompts at top-p 0.9, top-k 20
(temperature 1) with ``return_sampling_mask``, so each token comes with its kept set and its behaviour
logprob: its logprob under the kept set renormalised, the distribution it was drawn from. The fsdp trainer
(one gloo rank, in this process) then scores the same tokens twice: over the whole vocabulary (what it does
without replay) and renormalised over each token's kept set (replay). Against the behaviour logprobs it
reports the mismatch metric, ``fidelity/train_rollout_logprob_abs_diff`` (mean |trainer - rollout| over the
tokens), its largest value, and the k3 estimate of KL(behaviour || trainer) (``mean(exp(d) - 1 - d)``,
``d = trainer - behaviour``). It also reports the mismatch Miles logs without replay, against the
engine's untruncated logprobs (the ``output_token_logprobs`` convention): near 0 although the tokens were
drawn from another distribution. Costs: the kept sets' bytes per token (JSON in the response, the int64
mask rows in the batch), the engine's generation time with and without ``return_sampling_mask`` and the
trainer's scoring time with and without the rows (medians, the two sides alternating)::

    python -m benchmarks.sampling_mask                 # SmolLM2-135M-Instruct, 8 prompts x 4 x 32 tokens
    python -m benchmarks.sampling_mask --model tiny    # the benchmarks' tiny random Qwen2 (near uniform)
    python -m benchmarks.sampling_mask --quick

Prints a markdown table and writes ``benchmarks/results/sampling_mask.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    add_common_args,
    machine_info,
    markdown_table,
    median,
    model_dir,
    pin_threads,
    write_result,
)
from miles.net import free_port

TOP_P, TOP_K, TEMPERATURE = 0.9, 20, 1.0


def _prompts(model: Path, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    out = []
    for i in range(count):
        messages = [{"role": "user", "content": f"What is {12 + 7 * i} + {5 + 3 * i}? Explain briefly."}]
        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = tokenizer.encode(messages[0]["content"])
        out.append([int(t) for t in ids])
    return out


async def _rollout(url: str, prompts: list[list[int]], n: int, tokens: int, replay: bool) -> tuple[list[Any], float]:
    """The engine's outputs (``n`` per prompt, seeded) and the wall seconds of generating them."""
    from miles.rollout.http_client import HttpEngineClient
    from miles.rollout.protocol import SamplingParams

    async with HttpEngineClient([url]) as client:
        client.return_sampling_mask = replay
        start = time.perf_counter()
        outputs = await asyncio.gather(
            *(
                client.generate(
                    prompt,
                    SamplingParams(
                        max_new_tokens=tokens,
                        temperature=TEMPERATURE,
                        top_p=TOP_P,
                        top_k=TOP_K,
                        sampling_seed=1000 * i + j,
                    ),
                )
                for i, prompt in enumerate(prompts)
                for j in range(n)
            )
        )
        return [o for outs in outputs for o in outs], time.perf_counter() - start


def _mismatch(trainer: Any, behaviour: Any) -> dict[str, float]:
    d = (trainer.double() - behaviour.double()).flatten()
    return {
        "abs_diff": float(d.abs().mean()),
        "abs_diff_max": float(d.abs().max()),
        "kl_k3": float((d.exp() - 1 - d).mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--model", default="smollm2", help="smollm2 (default) or tiny")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    pin_threads(args.threads)
    import torch

    from miles.precision.builtin import FP32
    from miles.rollout.manager import sample_from_output
    from miles.settings.model import TrainSettings
    from miles.testing.engine import EngineProcess
    from miles.training.batch import TrainBatch
    from miles.training.logit_masks import LOGIT_MASK_IDS
    from miles.types import Sample
    from miles_fsdp.distributed import init_distributed, shutdown_distributed
    from miles_fsdp.settings import FSDPSettings
    from miles_fsdp.trainer import FSDPTrainer

    prompts_n, n, tokens = (2, 2, 8) if args.quick else (8, 4, 32)
    rounds = 1 if args.quick else args.rounds
    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir(args.model, Path(tmp))
        prompts = _prompts(model, prompts_n)
        with EngineProcess(model, log_path=Path(tmp) / "engine.log", threads=args.threads) as engine:
            gen_seconds: dict[str, list[float]] = {"without": [], "with": []}
            outputs: dict[str, list[Any]] = {}
            asyncio.run(_rollout(engine.url, prompts[:1], 1, 4, True))  # warm-up
            for r in range(rounds):
                for side in ("without", "with") if r % 2 == 0 else ("with", "without"):
                    outs, seconds = asyncio.run(_rollout(engine.url, prompts, n, tokens, side == "with"))
                    gen_seconds[side].append(seconds)
                    outputs[side] = outs
        for o, plain in zip(outputs["with"], outputs["without"], strict=True):
            assert o.output_ids == plain.output_ids, "the same seeds must give the same tokens"
        samples = [sample_from_output(Sample(prompt_ids=prompts[i // n]), o) for i, o in enumerate(outputs["with"])]
        untruncated = torch.tensor([lp for o in outputs["with"] for lp in o.output_logprobs])
        behaviour = torch.tensor([lp for s in samples for lp in s.rollout_logprobs])
        kept_sizes = [len(row) for s in samples for row in s.sampling_mask or []]
        json_bytes = sum(len(json.dumps(o.meta_info["output_token_sampling_mask"])) for o in outputs["with"])

        ctx = init_distributed(0, 1, master_port=free_port())
        try:
            trainer = FSDPTrainer(TrainSettings(model_path=str(model)), FSDPSettings(), FP32(None), ctx)  # type: ignore[arg-type, call-arg]
            trainer.setup()
            with_rows = TrainBatch.from_samples(samples)
            plain_samples = [Sample.from_dict({**s.to_dict(), "sampling_mask": None}) for s in samples]
            without_rows = TrainBatch.from_samples(plain_samples)
            score_seconds: dict[str, list[float]] = {"without": [], "with": []}
            scored: dict[str, Any] = {}
            for r in range(rounds + 1):  # the first round warms up
                for side in ("without", "with") if r % 2 == 0 else ("with", "without"):
                    batch = with_rows if side == "with" else without_rows
                    start = time.perf_counter()
                    scored[side] = trainer.compute_logprobs(batch, temperature=TEMPERATURE).logprobs
                    if r:
                        score_seconds[side].append(time.perf_counter() - start)
            rows_tensor = with_rows.response_tensors[LOGIT_MASK_IDS]
            trainer.close()
        finally:
            shutdown_distributed()

    count = behaviour.numel()
    no_replay = _mismatch(scored["without"], behaviour)
    replay = _mismatch(scored["with"], behaviour)
    as_logged = _mismatch(scored["without"], untruncated)
    kept_mass = float((untruncated.double() - behaviour.double()).exp().mean())

    def fmt(m: dict[str, float]) -> list[str]:
        return [f"{m['abs_diff']:.3g}", f"{m['abs_diff_max']:.3g}", f"{m['kl_k3']:.3g}"]

    rows = [
        ["without replay (trainer: whole vocabulary)", *fmt(no_replay)],
        ["with replay (trainer: renormalised over the kept set)", *fmt(replay)],
        ["as logged without replay (vs the untruncated logprobs)", *fmt(as_logged)],
    ]
    table = markdown_table(["train vs behaviour logprob", "mean abs diff", "max abs diff", "KL (k3)"], rows)
    cost = markdown_table(
        ["cost", "without", "with", "ratio"],
        [
            [
                "engine: generate (s)",
                f"{median(gen_seconds['without']):.2f}",
                f"{median(gen_seconds['with']):.2f}",
                f"{median(gen_seconds['with']) / median(gen_seconds['without']):.2f}x",
            ],
            [
                "trainer: score the batch (s)",
                f"{median(score_seconds['without']):.3f}",
                f"{median(score_seconds['with']):.3f}",
                f"{median(score_seconds['with']) / median(score_seconds['without']):.2f}x",
            ],
        ],
    )
    sizes = (
        f"kept set: mean {sum(kept_sizes) / len(kept_sizes):.1f} ids per token (max {max(kept_sizes)}), mean kept "
        f"mass {kept_mass:.3f}; {json_bytes / count:.0f} JSON bytes per token in the response, "
        f"{rows_tensor.shape[1] * 8} bytes per token in the batch ([R, {rows_tensor.shape[1]}] int64)"
    )
    info = machine_info()
    print(
        f"{args.model}: {prompts_n} prompts x {n} samples x {tokens} tokens ({count} tokens), top-p {TOP_P}, "
        f"top-k {TOP_K}, temperature {TEMPERATURE}, {args.threads} thread(s), {info['cpu']}\n"
    )
    print(table + "\n\n" + cost + "\n\n" + sizes)
    write_result(
        "sampling_mask",
        {
            "table": table,
            "cost": cost,
            "sizes": sizes,
            "mismatch": {"without_replay": no_replay, "with_replay": replay, "as_logged": as_logged},
            "kept_mass": kept_mass,
            "kept_sizes_mean": sum(kept_sizes) / len(kept_sizes),
            "json_bytes_per_token": json_bytes / count,
            "generate_seconds": gen_seconds,
            "score_seconds": score_seconds,
            "model": args.model,
            "shape": [prompts_n, n, tokens],
            "machine": info,
        },
        args.results_dir,
    )


if __name__ == "__main__":
    main()
