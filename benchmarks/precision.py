"""Low-precision rollout recipes on one model, each against the bf16 rollout, in one run: the train-vs-rollout
logprob difference (mean and p99 of ``|logp_train - logp_rollout|`` per response token), the bytes of a push
and the engine's decode tokens/s.

The "trainer" is the Hugging Face model in bfloat16 (the recipes' trainer compute) over the fp32 checkpoint;
each rollout is the local engine's :class:`~miles.engine.model_runner.ModelRunner` in bfloat16, loaded with
what the recipe pushes (``rollout_weights`` of the fp32 weights) and, for ``fp8`` / ``mxfp8`` / ``nvfp4``,
launched with the recipe's ``quantization``. The response tokens are the bf16 trainer's greedy
continuations of the quickstart prompts, scored by teacher forcing on both sides. Decode tokens/s: a batch of
``--batch`` requests decoding ``--decode-steps`` tokens after a prefill (threads pinned), the recipes taking
turns for ``--rounds`` rounds (the best round of each, and the median: a busy machine slows some rounds)::

    python benchmarks/precision.py                # SmolLM2-135M-Instruct, 2 threads
    python benchmarks/precision.py --model tiny --quick
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO_ROOT, add_common_args, machine_info, markdown_table, model_dir, pin_threads, write_result

RECIPES: list[tuple[str, str, dict[str, Any]]] = [  # label, precision, settings
    ("bf16", "bf16", {}),
    ("fp8 tensor", "fp8", {"granularity": "tensor"}),
    ("fp8 row", "fp8", {"granularity": "row"}),
    ("fp8 block", "fp8", {"granularity": "block"}),
    ("mxfp8", "mxfp8", {}),
    ("nvfp4", "nvfp4", {}),
]

STATED: dict[str, dict[str, tuple[float, float]]] = {
    # model: {label: (mean, p99) upper bounds of |logp_train - logp_rollout|, as docs/how-to/precision.md states}
    "smollm2": {
        "bf16": (0.05, 0.25),
        "fp8 tensor": (0.2, 1.2),
        "fp8 row": (0.2, 1.5),
        "fp8 block": (0.15, 0.6),
        "mxfp8": (0.2, 1.0),
        "nvfp4": (0.6, 3.0),
    },
}
"""The ranges the recipes' docs state per model; the table says whether this run fell within them."""


def _sequences(model: Path, n_prompts: int, new_tokens: int) -> list[tuple[list[int], int]]:
    """``(tokens, prompt length)``: quickstart prompts with the bf16 model's greedy continuation."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    rows = [json.loads(line) for line in (REPO_ROOT / "examples/quickstart/train.jsonl").read_text().splitlines()]
    out = []
    for row in rows[:n_prompts]:
        prompt = row["prompt"] if isinstance(row["prompt"], list) else [{"role": "user", "content": row["prompt"]}]
        ids = tok.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        with torch.no_grad():
            gen = hf.generate(
                torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
            )
        out.append((gen[0].tolist(), len(ids)))
    return out


def _token_logprobs(logits: Any, tokens: list[int], start: int) -> Any:
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp[start - 1 : len(tokens) - 1].gather(1, torch.tensor(tokens[start:])[:, None])[:, 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.set_defaults(threads=2)
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.new_tokens, args.decode_steps, args.rounds = 2, 8, 8, 3
    logging.basicConfig(level=logging.WARNING)
    pin_threads(args.threads)
    import torch
    from safetensors.torch import load_file

    from miles.engine.model_runner import ModelRunner
    from miles.precision.builtin import BF16
    from miles.precision.quantized import FP8, MXFP8, NVFP4
    from miles.transport.base import wire_dtype

    work = Path(tempfile.mkdtemp(prefix="miles-precision-bench-"))
    model = model_dir(args.model, work)
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(model.glob("*.safetensors")):
        weights.update(load_file(str(shard)))
    sequences = _sequences(model, args.prompts, args.new_tokens)
    from transformers import AutoModelForCausalLM

    trainer = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    with torch.no_grad():
        train_lp = [_token_logprobs(trainer(torch.tensor([t])).logits[0], t, s) for t, s in sequences]
    del trainer

    classes: dict[str, Any] = {"bf16": BF16, "fp8": FP8, "mxfp8": MXFP8, "nvfp4": NVFP4}
    rows: list[dict[str, Any]] = []
    runners: dict[str, tuple[Any, int]] = {}
    for label, name, settings in RECIPES:
        recipe = classes[name](classes[name].Settings(**settings))
        sent = list(recipe.rollout_weights(iter(weights.items())))
        push_bytes = sum(
            t.numel() * t.element_size() for n, t in ((n, t.to(wire_dtype(n, t, torch.bfloat16))) for n, t in sent)
        )
        try:
            runner = ModelRunner(model, dtype="bfloat16", quantization=recipe.engine_quantization)
        except ValueError as exc:
            rows.append({"recipe": label, "refused": str(exc)})
            continue
        runner.load_tensors(sent, source=label)
        diffs = []
        with torch.inference_mode():
            for (tokens, start), reference in zip(sequences, train_lp, strict=True):
                logits, _ = runner.prefill(0, [tokens], [0], [True])
                diffs.append((_token_logprobs(logits[0], tokens, start) - reference).abs())
        diff = torch.cat(diffs)
        prompt = sequences[0][0][: sequences[0][1]]
        runner.prefill(0, [prompt] * args.batch, [0] * args.batch, [False] * args.batch)
        runner.decode([1] * args.batch, [len(prompt)] * args.batch)  # warm-up (the dequantized weights cached)
        runners[label] = (runner, len(prompt))
        rows.append(
            {
                "recipe": label,
                "engine": recipe.engine_quantization or "bfloat16",
                "logprob_diff_mean": float(diff.mean()),
                "logprob_diff_p99": float(torch.quantile(diff, 0.99)),
                "push_bytes": push_bytes,
            }
        )
    seconds: dict[str, list[float]] = {label: [] for label in runners}
    with torch.inference_mode():
        for _ in range(args.rounds):  # the recipes take turns: a slower spell of the machine hits them all
            for label, (runner, position) in runners.items():
                begin = time.perf_counter()
                for step in range(1, args.decode_steps + 1):
                    runner.decode([1] * args.batch, [position + step] * args.batch)
                seconds[label].append(time.perf_counter() - begin)
    for r in rows:
        if r["recipe"] in seconds:
            ordered = sorted(seconds[r["recipe"]])
            r["decode_tokens_per_s"] = args.batch * args.decode_steps / ordered[0]
            r["decode_tokens_per_s_median"] = args.batch * args.decode_steps / ordered[len(ordered) // 2]
            r["decode_seconds"] = seconds[r["recipe"]]
    base = next(r for r in rows if r["recipe"] == "bf16")
    stated = STATED.get(args.model, {})
    table = []
    for r in rows:
        if "refused" in r:
            table.append([r["recipe"], "refused", "", "", "", "", "", r["refused"][:90], ""])
            continue
        bound = stated.get(r["recipe"])
        r["stated_bound"] = bound
        r["within_stated"] = (
            None if bound is None else (r["logprob_diff_mean"] <= bound[0] and r["logprob_diff_p99"] <= bound[1])
        )
        table.append(
            [
                r["recipe"],
                f"{r['logprob_diff_mean']:.4f}",
                f"{r['logprob_diff_p99']:.4f}",
                f"{r['push_bytes'] / 1e6:.1f}",
                f"{r['push_bytes'] / base['push_bytes']:.2f}",
                f"{r['decode_tokens_per_s']:.0f} ({r['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}x)",
                f"{r['decode_tokens_per_s_median'] / base['decode_tokens_per_s_median']:.2f}x",
                r["engine"],
                "--" if bound is None else f"{'yes' if r['within_stated'] else 'NO'} (<= {bound[0]} / {bound[1]})",
            ]
        )
    headers = [
        "recipe",
        "|dlogp| mean",
        "|dlogp| p99",
        "push MB",
        "bytes vs bf16",
        "decode tok/s, best round (vs bf16)",
        "median round vs bf16",
        "engine",
        "within docs (mean / p99)",
    ]
    print(markdown_table(headers, table))
    path = write_result(
        "precision",
        {"model": args.model, "threads": args.threads, "machine": machine_info(), "rows": rows},
        args.results_dir,
    )
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
