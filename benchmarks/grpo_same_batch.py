"""One GRPO optimizer step of Miles and of TRL's ``GRPOTrainer`` on the same batch, gradient against gradient.

``grpo_vs_trl`` compares whole runs, where each side samples its own completions; this takes sampling out.
One batch is built once: the first ``--prompts-per-step`` prompts of the quickstart data through Miles' data
pipeline (the chat template), ``--group-size`` completions of ``--completion-tokens`` tokens each sampled by HF
``generate`` from the float32 model, and one reward per completion drawn at random with both values in every
group (at step 1 the real reward is almost always 0, so most groups would carry no gradient; where the rewards
come from does not change whether two implementations of the loss agree). Then, in separate processes:

- **TRL**: ``GRPOTrainer`` with the configuration ``grpo_vs_trl`` runs (:func:`benchmarks.grpo_vs_trl.trl_grpo_config`),
  one step, its generation replaced by the batch's completions (the prompt ids TRL asks for are checked against
  the batch's, so both sides see the same tokens) and its reward by the batch's rewards;
- **Miles**: the ``miles train`` configuration of ``grpo_vs_trl`` (:func:`benchmarks.grpo_vs_trl._miles_config`)
  resolved through the plugins, its trainer built and set up as the loop does, the batch through
  :func:`miles.driver.batching.prepare_minibatches` (the GRPO advantages) and one ``train_step``.

Each side's gradient is captured just before its optimizer step (after clipping to norm 1.0, which scales every
tensor alike), with the gradient norm before clipping, and so is the optimizer step's change of the parameters
(the first AdamW step moves each parameter by about the learning rate times the sign of its gradient, so the
update cosine also counts the small gradients whose sign rounding flips). Both for each precision of
``--precisions`` (``fp32``; ``bf16``: TRL's bf16 autocast, Miles' bf16 compute over float32 master weights). The
table compares the pairs: the two fp32 steps (the same algorithm: cosine 1 up to float32 rounding), and each
bf16 step against its own side's fp32 step (how much of the step bf16 keeps). (The loss itself is 0 on both
sides: on-policy the ratio is 1 and each group's advantages sum to 0.)::

    python -m benchmarks.grpo_same_batch                     # SmolLM2-135M-Instruct, fp32 and bf16
    python -m benchmarks.grpo_same_batch --model tiny --quick

Writes ``benchmarks/results/grpo_same_batch.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.common import (
    REPO_ROOT,
    add_common_args,
    child_env,
    machine_info,
    markdown_table,
    model_dir,
    versions,
    write_result,
)
from benchmarks.grpo_vs_trl import FAST, PROMPTS, _miles_config, trl_grpo_config, trl_python
from miles.net import free_port


# --------------------------------------------------------------------------------------------- batch
def build_batch(spec: dict[str, Any]) -> dict[str, Any]:
    """The prompts (Miles' chat-template ids), the sampled completions, their logprobs and the rewards."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles.data.base import Prompt
    from miles.data.pipeline import PromptPipeline

    torch.manual_seed(spec["seed"])
    rows = [json.loads(line) for line in Path(spec["prompts"]).read_text().splitlines() if line.strip()]
    rows = rows[: spec["prompts_per_step"]]
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    prompts = PromptPipeline(tokenizer)(
        [Prompt(r["prompt"], r["label"], source=f"row {i}") for i, r in enumerate(rows)]
    )
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
    n, group = spec["completion_tokens"], spec["group_size"]
    rng = random.Random(spec["seed"])
    out: dict[str, Any] = {"rows": rows, "prompt_ids": [], "completions": [], "logprobs": [], "rewards": []}
    for prompt in prompts:
        assert prompt.prompt_ids is not None
        ids = torch.tensor([prompt.prompt_ids] * group)
        with torch.no_grad():
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=spec["temperature"],
                top_k=0,
                top_p=1.0,
                max_new_tokens=n,
                min_new_tokens=n,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            )
        completions = gen.sequences[:, ids.shape[1] :]
        # the processed scores of each step (temperature applied, EOS masked by min_new_tokens): what was sampled from
        steps = torch.stack([torch.log_softmax(s.float(), dim=-1) for s in gen.scores], dim=1)
        logprobs = steps.gather(-1, completions.unsqueeze(-1)).squeeze(-1)
        rewards = [0.0] * group
        while len(set(rewards)) < 2:
            rewards = [float(rng.random() < 0.5) for _ in range(group)]
        out["prompt_ids"].append(list(prompt.prompt_ids))
        out["completions"].append(completions.tolist())
        out["logprobs"].append(logprobs.tolist())
        out["rewards"].append(rewards)
    return out


class StepCapture:
    """A side's gradients just before its optimizer step and the parameter changes the step makes, in float32."""

    def __init__(self, named_parameters: Callable[[], Iterator[tuple[str, Any]]]) -> None:
        self.named_parameters = named_parameters
        self.grads: dict[str, Any] = {}
        self.updates: dict[str, Any] = {}
        self._before: dict[str, Any] = {}

    def before_step(self, *_: Any) -> None:
        for name, param in self.named_parameters():
            if param.grad is not None:
                self.grads[name] = param.grad.detach().float().clone().contiguous()
                self._before[name] = param.detach().float().clone()

    def after_step(self, *_: Any) -> None:
        for name, param in self.named_parameters():
            if name in self._before:
                self.updates[name] = (param.detach().float() - self._before.pop(name)).contiguous()

    def save(self, out_dir: Path) -> None:
        from safetensors.torch import save_file

        save_file(self.grads, str(out_dir / "grads.safetensors"))
        save_file(self.updates, str(out_dir / "updates.safetensors"))


# ----------------------------------------------------------------------------------------------- TRL
def _trl_worker(batch_path: str, spec_path: str, out_dir: str) -> None:
    """Inside the interpreter that has ``trl``: one GRPOTrainer step on the batch; gradients to ``out_dir``."""
    import torch

    spec = json.loads(Path(spec_path).read_text())
    batch = json.loads(Path(batch_path).read_text())
    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    dataset = Dataset.from_list([{"prompt": r["prompt"], "label": str(r["label"])} for r in batch["rows"]])
    served: list[tuple[int, int]] = []  # (prompt, completion) in the order TRL asked for them
    taken = [0] * len(batch["prompt_ids"])

    def generate(prompt_ids: list[list[int]], *_args: Any, **_kwargs: Any) -> tuple[list[list[int]], None]:
        completions = []
        for ids in prompt_ids:
            ids = list(map(int, ids))
            if ids not in batch["prompt_ids"]:
                raise SystemExit(f"TRL tokenised a prompt differently from Miles' pipeline: {ids}")
            p = batch["prompt_ids"].index(ids)
            completions.append(batch["completions"][p][taken[p]])
            served.append((p, taken[p]))
            taken[p] += 1
        return completions, None

    def rewards(prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
        assert len(served) == len(completions), (len(served), len(completions))
        return [batch["rewards"][p][k] for p, k in served]

    capture = StepCapture(lambda: trainer.model.named_parameters())

    class Capture(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            capture.before_step()

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            capture.after_step()

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    config = trl_grpo_config({**spec, "steps": 1, "bf16": spec["precision"] == "bf16"})
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=rewards,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Capture()],
    )
    trainer._generate_single_turn = generate  # type: ignore[method-assign]
    trainer.train()
    logged = next(h for h in trainer.state.log_history if "loss" in h)
    capture.save(Path(out_dir))
    meta = {"loss": float(logged["loss"]), "grad_norm": float(logged["grad_norm"]), "served": served}
    (Path(out_dir) / "meta.json").write_text(json.dumps(meta))


# --------------------------------------------------------------------------------------------- Miles
def _miles_worker(batch_path: str, spec_path: str, out_dir: str) -> None:
    """One Miles trainer step on the batch, built as ``miles train`` builds it; gradients to ``out_dir``."""
    import torch

    spec = json.loads(Path(spec_path).read_text())
    batch = json.loads(Path(batch_path).read_text())
    torch.set_num_threads(spec["threads"])

    from miles.compose import build_run
    from miles.driver.batching import prepare_minibatches
    from miles.settings.loader import load_settings
    from miles.types import Sample, SampleGroup, SampleStatus
    from miles_fsdp.distributed import init_distributed, shutdown_distributed

    out = Path(out_dir)
    config = out / "miles.toml"
    config.write_text(_miles_config({**spec, "steps": 1}, out / "run", "sync", spec["precision"]))
    overrides = FAST if spec["precision"] == "bf16" else []
    run = build_run(load_settings(config, overrides=overrides))
    run.materialize_model()
    dist = init_distributed(0, 1, master_port=free_port())
    try:
        trainer = run.trainer(dist)
        trainer.setup()
        groups = [
            SampleGroup(
                g,
                [
                    Sample(
                        prompt_ids=batch["prompt_ids"][g],
                        response_ids=completion,
                        rollout_logprobs=batch["logprobs"][g][k],
                        loss_mask=[1] * len(completion),
                        reward=batch["rewards"][g][k],
                        status=SampleStatus.TRUNCATED,
                        group_id=g,
                        index=k,
                    )
                    for k, completion in enumerate(batch["completions"][g])
                ],
            )
            for g in range(len(batch["prompt_ids"]))
        ]
        size = sum(len(g.samples) for g in groups)
        temperature = spec["temperature"]
        (step,) = prepare_minibatches(
            groups,
            algorithm=run.algorithm,
            trainer=trainer,
            dist=dist,
            global_batch_size=size,
            temperature=temperature,
            on_policy=True,
        )
        actor = trainer.actor  # type: ignore[attr-defined]
        optimizer = trainer._parts["actor"][1]  # type: ignore[attr-defined]
        capture = StepCapture(actor.named_parameters)
        optimizer.register_step_pre_hook(capture.before_step)
        optimizer.register_step_post_hook(capture.after_step)
        metrics = trainer.train_step(step, run.algorithm, temperature=temperature)
        trainer.close()
    finally:
        shutdown_distributed()
    capture.save(out)
    (out / "meta.json").write_text(
        json.dumps({"loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "metrics": metrics})
    )


# ------------------------------------------------------------------------------------------- compare
def compare(a_dir: Path, b_dir: Path, what: str = "grads") -> dict[str, Any]:
    """Cosine of the two sides' whole ``what`` (``grads``: the gradients; ``updates``: the parameter changes
    of the optimizer step), the lowest per-tensor cosine, and the relative difference of the two once each
    is scaled to norm 1."""
    from safetensors.torch import load_file

    a, b = load_file(str(a_dir / f"{what}.safetensors")), load_file(str(b_dir / f"{what}.safetensors"))
    if a.keys() != b.keys():
        raise SystemExit(f"the two sides' parameters differ: only {sorted(a.keys() ^ b.keys())[:5]}")
    dot = na = nb = 0.0
    worst, worst_name = 1.0, ""
    for name in a:
        x, y = a[name].double().flatten(), b[name].double().flatten()
        d, xx, yy = float(x @ y), float(x @ x), float(y @ y)
        dot, na, nb = dot + d, na + xx, nb + yy
        if xx > 0 and yy > 0 and d / (xx * yy) ** 0.5 < worst:
            worst, worst_name = d / (xx * yy) ** 0.5, name
    cosine = dot / (na * nb) ** 0.5
    return {
        "cosine": cosine,
        "relative_difference": max(0.0, 2 - 2 * cosine) ** 0.5,
        "worst_tensor_cosine": worst,
        "worst_tensor": worst_name,
        "tensors": len(a),
    }


def _run_worker(python: str, role: str, batch: Path, spec: dict[str, Any], out: Path, threads: int) -> dict[str, Any]:
    out.mkdir(parents=True)
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    log = out / "worker.log"
    with log.open("wb") as handle:
        proc = subprocess.run(
            [python, "-m", "benchmarks.grpo_same_batch", f"--{role}-worker", str(batch), str(spec_path), str(out)],
            env=child_env(threads),
            cwd=REPO_ROOT,
            stdout=handle,
            stderr=subprocess.STDOUT,
            timeout=spec["timeout"],
            check=False,
        )
    if proc.returncode != 0 or not (out / "meta.json").exists():
        raise RuntimeError(
            f"{role} worker exited with {proc.returncode}; log {log}:\n{log.read_text(errors='replace')[-3000:]}"
        )
    meta: dict[str, Any] = json.loads((out / "meta.json").read_text())
    return meta


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--model", default="smollm2", help="smollm2 (default) or tiny")
    parser.add_argument("--precisions", default="fp32,bf16", help="comma-separated: fp32, bf16")
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--completion-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument(
        "--trl-python", default=None, help="the interpreter with trl (default: this one, else .venv-bench)"
    )
    parser.add_argument("--trl-worker", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--miles-worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trl_worker:
        _trl_worker(*args.trl_worker)
        return {}
    if args.miles_worker:
        _miles_worker(*args.miles_worker)
        return {}
    if args.quick:
        args.prompts_per_step, args.group_size, args.completion_tokens = 2, 4, 8
    precisions = [p for p in args.precisions.split(",") if p]
    python = trl_python(args.trl_python)
    with tempfile.TemporaryDirectory(prefix="miles-bench-same-batch-") as tmp:
        workdir = Path(tmp)
        spec: dict[str, Any] = {
            "model": str(model_dir(args.model, workdir)),
            "prompts": str(PROMPTS),
            "device": args.device,
            "prompts_per_step": args.prompts_per_step,
            "group_size": args.group_size,
            "completion_tokens": args.completion_tokens,
            "temperature": args.temperature,
            "lr": args.lr,
            "seed": args.seed,
            "transport": "broadcast",
            "threads": args.threads,
            "timeout": args.timeout,
            "output_dir": str(workdir / "trl-out"),
        }
        batch = build_batch(spec)
        batch_path = workdir / "batch.json"
        batch_path.write_text(json.dumps(batch))
        steps: dict[str, dict[str, Any]] = {}
        for precision in precisions:
            for side, interpreter in (("trl", python), ("miles", sys.executable)):
                name = f"{side}-{precision}"
                meta = _run_worker(
                    interpreter, side, batch_path, {**spec, "precision": precision}, workdir / name, args.threads
                )
                steps[name] = {"loss": meta["loss"], "grad_norm": meta["grad_norm"]}
                print(f"{name}: loss {meta['loss']:.6f}, grad norm {meta['grad_norm']:.6f}", flush=True)
        pairs = [
            ("miles-fp32", "trl-fp32"),
            ("miles-bf16", "miles-fp32"),
            ("trl-bf16", "trl-fp32"),
            ("miles-bf16", "trl-bf16"),
        ]
        compared = {}
        rows = []
        for a, b in pairs:
            if a not in steps or b not in steps:
                continue
            c = compare(workdir / a, workdir / b)
            u = compare(workdir / a, workdir / b, "updates")
            compared[f"{a} vs {b}"] = {"grads": c, "updates": u}
            rows.append(
                (
                    f"{a} vs {b}",
                    f"{c['cosine']:.6f}",
                    f"{c['relative_difference']:.2e}",
                    f"{c['worst_tensor_cosine']:.4f} ({c['worst_tensor']})",
                    f"{u['cosine']:.6f}",
                    f"{steps[a]['grad_norm']:.4f} / {steps[b]['grad_norm']:.4f}",
                )
            )
    samples = args.prompts_per_step * args.group_size
    print(
        f"\n## One GRPO step on the same batch ({args.model}: {args.prompts_per_step} prompts x {args.group_size} "
        f"completions x {args.completion_tokens} tokens, seed {args.seed})\n"
    )
    headers = [
        "pair",
        "gradient cosine",
        "relative difference",
        "lowest tensor cosine",
        "update cosine",
        "grad norm (a / b)",
    ]
    print(markdown_table(headers, rows))
    payload = {
        "machine": machine_info(args.device),
        "versions": versions(),
        "config": {**vars(args), "results_dir": str(args.results_dir), "samples": samples},
        "steps": steps,
        "compared": compared,
    }
    path = write_result("grpo_same_batch", payload, args.results_dir)
    print(f"\nwrote {path}")
    return payload


if __name__ == "__main__":
    main()
