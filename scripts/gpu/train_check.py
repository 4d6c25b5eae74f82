"""``miles train`` end to end on one device (issue 38): GRPO steps of a Qwen2.5-0.5B-shaped model (random
weights, a tokenizer built in-process), the local engine and FSDP on the same GPU, every push verified.

  (a) colocated, the trainer offloaded while the engine rolls out and the engine released while it trains,
      pushes by ``tensor_ipc`` (CUDA IPC from the trainer rank to the engine on its GPU):
      the phases read back from the run's logs with their memory; during rollout the trainer holds < 10% of
      its training-time memory, during training the engine < 10% of its rollout-time memory;
  (b) colocated without the trainer's offload (``cluster.offload_trainer = false``): the trainer resident
      throughout, the figure (a) is measured against (a run not colocated needs a second GPU for its engine:
      run with --not-colocated where there is one);
  (c) one-step-off async (not colocated: a second GPU; skipped, saying so, with one).

  python scripts/gpu/train_check.py [--device cuda] [--model qwen0.5b|tiny] [--steps 5] [--out DIR]

On a CPU (``--device cpu --model tiny``) it runs the same runs as a smoke test; the memory bounds are
checked on CUDA only (a CPU has no device memory to give back)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def model(name: str, workdir: Path) -> Path:
    if name == "qwen0.5b":
        from benchmarks.trainer import _model

        return _model("qwen0.5b", workdir)
    from miles.testing.models import build_tiny_model

    out = workdir / "tiny"
    if not (out / "config.json").exists():
        build_tiny_model(out, "qwen2", seed=0)
    return out


def config(workdir: Path, model_path: Path, run_dir: Path, *, device: str, steps: int, extra: str) -> Path:
    from miles.testing.runs import write_arithmetic_prompts

    prompts = write_arithmetic_prompts(workdir / "prompts.jsonl")
    path = workdir / f"{run_dir.name}.toml"
    path.write_text(
        f"""
[cluster]
device = "{device}"
trainer_ranks = 1
num_engines = 1
{extra}

[data]
path = "{prompts}"

[rollout]
rollout_batch_size = 8
n_samples_per_prompt = 4
max_new_tokens = 64
temperature = 1.0

[train]
model_path = "{model_path}"
num_rollouts = {steps}
global_batch_size = 32

[algorithm]
name = "grpo"

[[reward.functions]]
name = "length_penalty"
max_length = 64
buffer_length = 16
mode = "linear"

[transport]
name = "disk"

[checkpoint]
save_final = false

[log]
run_dir = "{run_dir}"
"""
    )
    return path


def train(name: str, workdir: Path, args: argparse.Namespace, model_path: Path, extra: str, *sets: str) -> dict:
    run_dir = workdir / name
    cfg = config(workdir, model_path, run_dir, device=args.device, steps=args.steps, extra=extra)
    start = time.perf_counter()
    overrides = [a for s in sets for a in ("--set", s)]
    out = subprocess.run(
        [sys.executable, "-m", "miles", "train", str(cfg), "--overwrite", *overrides],
        capture_output=True,
        text=True,
        timeout=900,
    )
    seconds = time.perf_counter() - start
    if out.returncode != 0:
        print(out.stdout[-3000:], out.stderr[-5000:])
        raise SystemExit(f"{name}: miles train exited {out.returncode}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    verified = [r["weight_sync/verified"] for r in rows if "weight_sync/verified" in r]
    # (one-step-off commits a push while the next step trains: its verification is on a later row, the last
    # one's at the end of the run)
    assert len(rows) == args.steps, f"{name}: {len(rows)} steps of {args.steps}"
    assert len(verified) >= args.steps - 1 and set(verified) == {1.0}, f"{name}: pushes verified {verified}"
    result = {
        "seconds": round(seconds, 1),
        "step_seconds": [round(r["time/step_seconds"], 2) for r in rows],
        "reward_mean": [round(r.get("rollout/reward_mean", float("nan")), 3) for r in rows],
        "logprob_abs_diff": [r.get("fidelity/train_rollout_logprob_abs_diff") for r in rows],
    }
    logs = run_dir / "logs"
    phases = re.findall(
        r"colocation: ([a-z ]+?)(?:: [^\n]*?)? \(trainer holds ([0-9.]+) MB[^\n]*?(?:cuda allocated ([0-9.]+) MB)?",
        (logs / "trainer-0.log").read_text(),
    )
    if phases:
        result["trainer_phases"] = [(p, float(mb), float(a) if a else None) for p, mb, a in phases]
    released = re.findall(r"cuda allocated ([0-9.]+) -> ([0-9.]+) MB", (logs / "engine-0.log").read_text())
    if released:
        result["engine_release_mb"] = [(float(a), float(b)) for a, b in released]
    print(f"{name}: {json.dumps(result)}", flush=True)
    return result


def check_colocated(result: dict, device: str) -> list[str]:
    """The memory bounds of (a), from the phases' figures (CUDA only)."""
    if device != "cuda":
        return []
    problems = []
    phases = result["trainer_phases"]
    training = max(alloc for p, _, alloc in phases if p == "train")
    rollout = max(alloc for p, _, alloc in phases if p in ("rollout", "trainer offload weights"))
    if not rollout < 0.1 * training:
        problems.append(f"trainer during rollout {rollout:.0f} MB, training {training:.0f} MB: not < 10%")
    for before, after in result["engine_release_mb"]:
        if not after < 0.1 * before:
            problems.append(f"engine during training {after:.0f} MB of {before:.0f} MB at rollout: not < 10%")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--model", default="qwen0.5b", choices=["qwen0.5b", "tiny"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/miles-train-check")))
    parser.add_argument("--not-colocated", action="store_true", help="also (b') and (c): needs two GPUs")
    args = parser.parse_args()
    workdir = args.out / "train_check"
    workdir.mkdir(parents=True, exist_ok=True)
    model_path = model(args.model, workdir)
    results: dict = {"device": args.device, "model": args.model, "steps": args.steps}
    if args.device == "cuda":
        import torch

        results["gpu"] = torch.cuda.get_device_name(0)
    # (b) first, by disk: its figures stand even if the CUDA IPC path of (a) fails
    results["b_colocated_resident"] = train(
        "b_colocated_resident", workdir, args, model_path, "colocate = true\noffload_trainer = false"
    )
    ipc = "transport.name=tensor_ipc"  # the colocated fast path: the engine reads the trainer's tensors by CUDA IPC
    results["a_colocated"] = train(
        "a_colocated", workdir, args, model_path, "colocate = true\noffload_trainer = true", ipc
    )
    if args.not_colocated:
        results["b_not_colocated"] = train("b_not_colocated", workdir, args, model_path, "")
        results["c_one_step_off"] = train("c_one_step_off", workdir, args, model_path, "", "rollout.mode=one_step_off")
    else:
        results["c_one_step_off"] = "skipped: not colocated, the engine needs a GPU of its own (--not-colocated)"
    problems = check_colocated(results["a_colocated"], args.device)
    results["problems"] = problems
    (args.out / "train_check.json").write_text(json.dumps(results, indent=1))
    print(json.dumps({k: v for k, v in results.items() if not isinstance(v, dict)}, indent=1))
    if problems:
        raise SystemExit("; ".join(problems))


if __name__ == "__main__":
    main()
