"""The tiny vision-language model against its own text-only path: engine and trainer tokens per second.

One tiny random Qwen2-VL (:func:`miles.testing.vlm.build_tiny_vlm`), ``--prompts`` "how many red squares?"
prompts, each with one ``--size`` x ``--size`` image (a 112-pixel image is 16 placeholder tokens), or the same
prompts without their images (the text-only path of the same model). The engine (a ``miles serve`` process)
answers one batched ``/generate`` of ``--tokens`` sampled tokens per prompt, prefix cache flushed before each;
the trainer (``fsdp``, one gloo rank, in this process) takes ``compute_logprobs`` plus one ``train_step`` over
the resulting samples. Medians of ``--repeats``::

    python benchmarks/vlm.py
    python benchmarks/vlm.py --quick

Prints a markdown table (image / text ratios) and writes ``benchmarks/results/vlm.json``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_common_args, machine_info, markdown_table, median, pin_threads, versions, write_result


def _prompts(root: Path, model: Path, count: int, size: int) -> tuple[list[list[int]], list[list[int]], list[str]]:
    """Per prompt: its ids with the image placeholder, the same without the image, and the image path."""
    from transformers import AutoTokenizer

    from miles.data.images import load_image
    from miles.data.vision import expand_placeholders, image_token_id, load_image_processor, process_images
    from miles.testing.vlm import squares_image

    tokenizer = AutoTokenizer.from_pretrained(model)
    processor, token = load_image_processor(model), image_token_id(model)
    question = {"type": "text", "text": "How many red squares are in the image? Answer with a number."}
    with_image, text_only, paths = [], [], []
    for i in range(count):
        path = root / f"{i}.png"
        squares_image({"red": i % 4, "blue": (i // 4) % 3}, size=size, seed=i).save(path)
        paths.append(str(path))
        for content, out in (([{"type": "image"}, question], with_image), ([question], text_only)):
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], add_generation_prompt=True, return_dict=False
            )
            out.append([int(t) for t in ids])
        # expanded, as the data pipeline gives them: what the engine and the trainer both see
        counts = process_images(processor, [load_image(str(path))]).token_counts(processor.merge_size)
        with_image[-1] = expand_placeholders(with_image[-1], counts, token, what=str(path))
    return with_image, text_only, paths


def _generate(url: str, prompts: list[list[int]], images: list[str] | None, tokens: int) -> tuple[float, list[Any]]:
    import httpx

    httpx.post(url + "/flush_cache", timeout=60)
    body: dict[str, Any] = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": tokens, "temperature": 1.0, "ignore_eos": True},
        "return_logprob": True,
    }
    if images is not None:
        body["image_data"] = images
    start = time.perf_counter()
    answers = httpx.post(url + "/generate", json=body, timeout=600).json()
    return time.perf_counter() - start, answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--size", type=int, default=112, help="image side in pixels")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.tokens, args.repeats = 4, 8, 2
    pin_threads(args.threads)
    import torch

    from miles.net import free_port
    from miles.precision.builtin import FP32
    from miles.settings.model import TrainSettings
    from miles.testing.algorithms import RatioPG, RatioPGSettings
    from miles.testing.engine import EngineProcess
    from miles.testing.vlm import build_tiny_vlm
    from miles.training.batch import TrainBatch
    from miles.training.vision import attach_images
    from miles.types import Sample
    from miles_fsdp.distributed import init_distributed, shutdown_distributed
    from miles_fsdp.settings import FSDPSettings
    from miles_fsdp.trainer import FSDPTrainer

    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_tiny_vlm(root / "model", max_pixels=args.size * args.size)
        with_image, text_only, paths = _prompts(root, model, args.prompts, args.size)
        batches: dict[str, TrainBatch] = {}
        with EngineProcess(model, threads=args.threads, log_path=root / "engine.log") as engine:
            for side, prompts, images in (("image", with_image, paths), ("text", text_only, None)):
                times, answers = [], []
                for _ in range(args.repeats):
                    seconds, answers = _generate(engine.url, prompts, images, args.tokens)
                    times.append(seconds)
                prompt_tokens = sum(a["meta_info"]["prompt_tokens"] for a in answers)
                generated = sum(len(a["output_ids"]) for a in answers)
                results[side] = {
                    "prompt_tokens": prompt_tokens,
                    "engine_s": median(times),
                    "engine_tok_s": generated / median(times),
                }
                samples = [
                    Sample(
                        prompt_ids=prompts[i],
                        response_ids=answer["output_ids"],
                        rollout_logprobs=[lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]],
                        loss_mask=[1] * len(answer["output_ids"]),
                        metadata={"images": [paths[i]]} if images is not None else {},
                    )
                    for i, answer in enumerate(answers)
                ]
                batch = TrainBatch.from_samples(samples)
                if images is not None:
                    attach_images(batch, samples, str(model))
                batch.set_token_field("advantages", torch.linspace(-1, 1, batch.num_response_tokens))
                batch.set_token_field("old_logprobs", batch.rollout_logprobs)
                batches[side] = batch
        ctx = init_distributed(0, 1, master_port=free_port())
        try:
            train = TrainSettings(model_path=str(model), lr=1e-4, max_tokens_per_micro_batch=1 << 16)  # type: ignore[call-arg]
            trainer = FSDPTrainer(train, FSDPSettings(), FP32(None), ctx)
            trainer.setup()
            algo = RatioPG(RatioPGSettings())
            for side, batch in batches.items():
                trainer.train_step(batch, algo)  # warm-up
                times = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    trainer.compute_logprobs(batch)
                    trainer.train_step(batch, algo)
                    times.append(time.perf_counter() - start)
                results[side]["trainer_s"] = median(times)
                results[side]["trainer_tok_s"] = batch.num_tokens / median(times)
            trainer.close()
        finally:
            shutdown_distributed()
    image, text = results["image"], results["text"]
    rows = []
    for key, label in (
        ("prompt_tokens", "prompt tokens (all prompts)"),
        ("engine_tok_s", "engine generated tok/s"),
        ("trainer_tok_s", "trainer tok/s (logprobs + step)"),
    ):
        rows.append([label, f"{image[key]:,.1f}", f"{text[key]:,.1f}", f"{image[key] / text[key]:.3f}"])
    print(
        f"\ntiny Qwen2-VL, {args.prompts} prompts x {args.tokens} tokens, one {args.size}x{args.size} image each "
        f"vs none, {args.threads} thread(s)\n"
    )
    print(markdown_table(["", "with image", "text only", "image / text"], rows))
    path = write_result(
        "vlm",
        {
            "machine": machine_info(),
            "versions": versions(["torch", "transformers"]),
            "args": vars(args) | {"results_dir": str(args.results_dir)},
            "results": results,
        },
        args.results_dir,
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
