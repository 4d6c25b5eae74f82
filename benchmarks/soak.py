"""Soak: a long ``miles train`` of the tiny config, every process of the run sampled (issue 22).

Runs ``--steps`` GRPO steps (default 1,000) of a tiny Qwen2 with one engine and ``--ranks`` trainer ranks
over broadcast with verification, and samples every process of the run (the launcher, the engine, each
rank) every ``--interval`` seconds from ``/proc``: resident memory, open file descriptors, threads. The
table compares each process after warm-up (``--warmup`` of the steps, default 10%) with the end of the run:
RSS growth must stay under 5%, descriptors and threads must not grow::

    python -m benchmarks.soak                 # 1,000 steps (hours on 2 cores)
    python -m benchmarks.soak --steps 60      # a shorter soak
    python -m benchmarks.soak --quick         # 12 steps: a smoke run of the script

Not a CI test: the limit is a benchmark's, printed with both sides of the comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT, add_common_args, child_env, machine_info, markdown_table, model_dir
from benchmarks.common import write_result as write_json
from miles.settings.model import MilesSettings

RSS_LIMIT = 0.05
"""The largest RSS growth after warm-up the soak accepts."""


def _config(workdir: Path, model: Path, steps: int, ranks: int, malloc: dict[str, str]) -> Path:
    data = workdir / "prompts.jsonl"
    rows = [{"prompt": f"Count to {n}:", "label": str(n)} for n in range(2, 66)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = workdir / "soak.toml"
    config.write_text(
        textwrap.dedent(
            f"""
            [cluster]
            trainer_ranks = {ranks}
            num_engines = 1
            trainer_malloc = "{malloc["trainer"]}"
            engine_malloc = "{malloc["engine"]}"

            [data]
            path = "{data}"

            [rollout]
            rollout_batch_size = 4
            n_samples_per_prompt = 4
            max_new_tokens = 8

            [train]
            model_path = "{model}"
            num_rollouts = {steps}
            global_batch_size = 16
            lr = 1e-4

            [algorithm]
            name = "grpo"

            [[reward.functions]]
            name = "length_penalty"
            max_length = 8
            buffer_length = 4

            [transport]
            name = "broadcast"

            [log]
            run_dir = "{workdir / "run"}"
            """
        )
    )
    return config


def _proc(pid: int) -> dict[str, Any] | None:
    """``rss_mb``, ``fds``, ``threads`` and a role name of process ``pid`` (``None`` once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    args = b" ".join(cmdline).decode(errors="replace")
    if "miles.driver.worker" in args:
        rank = next((e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"RANK=")), "?")
        role = f"trainer-{rank}"
    elif "miles.engine" in args:
        role = "engine"
    elif " train " in f" {args} ":
        role = "launcher"
    else:
        return None
    return {
        "role": role,
        "rss_mb": int(fields["VmRSS"].split()[0]) / 1024,
        "fds": fds,
        "threads": int(fields["Threads"]),
    }


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        out.append(parent)
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        todo += [int(c) for c in children]
    return out


def _step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return int(json.loads(lines[-1])["step"]) if lines else 0


def soak(steps: int, ranks: int, interval: float, threads: int, malloc: dict[str, str]) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="miles-soak-"))
    model = model_dir("tiny", workdir)
    config = _config(workdir, model, steps, ranks, malloc)
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles", "train", str(config)],
        cwd=REPO_ROOT,
        env=child_env(threads),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    samples: list[dict[str, Any]] = []
    started = time.monotonic()
    while proc.poll() is None:
        step = _step(workdir / "run")
        for pid in _descendants(proc.pid):
            info = _proc(pid)
            if info is not None:
                samples.append({"t": time.monotonic() - started, "step": step, "pid": pid, **info})
        time.sleep(interval)
    stderr = proc.stderr.read() if proc.stderr is not None else ""
    if proc.returncode != 0:
        raise SystemExit(f"the soak run failed ({proc.returncode}):\n{stderr[-3000:]}")
    return {"samples": samples, "seconds": time.monotonic() - started, "steps": _step(workdir / "run")}


def summarize(samples: list[dict[str, Any]], steps: int, warmup: float) -> list[dict[str, Any]]:
    """Per process: the first sample after warm-up against the last one taken while steps were still
    running (the final step's checkpoint, export and shutdown are not the steady state)."""
    after = max(1, int(steps * warmup))
    last_step = max((s["step"] for s in samples), default=0)
    rows = []
    for pid in sorted({s["pid"] for s in samples}):
        mine = [s for s in samples if s["pid"] == pid]
        warm = [s for s in mine if after <= s["step"] < last_step]
        if len(warm) < 2:
            continue
        first, last = warm[0], warm[-1]
        peak = max(s["rss_mb"] for s in warm)
        rows.append(
            {
                "process": first["role"],
                "from_step": first["step"],
                "to_step": last["step"],
                "rss_warm_mb": round(first["rss_mb"], 1),
                "rss_end_mb": round(last["rss_mb"], 1),
                "rss_peak_mb": round(peak, 1),
                "rss_growth": round(last["rss_mb"] / first["rss_mb"] - 1, 4),
                "fds": f"{first['fds']} -> {last['fds']}",
                "threads": f"{first['threads']} -> {last['threads']}",
                "ok": last["rss_mb"] <= first["rss_mb"] * (1 + RSS_LIMIT)
                and last["fds"] <= first["fds"]
                and last["threads"] <= first["threads"],
            }
        )
    return rows


def series(samples: list[dict[str, Any]], every: int = 10) -> dict[str, list[list[float]]]:
    """Per process: ``[step, RSS MB]`` at the first sample in every ``every`` steps (the growth's shape)."""
    out: dict[str, list[list[float]]] = {}
    seen: set[tuple[int, int]] = set()
    for s in samples:
        key = (s["pid"], s["step"] // every)
        if key in seen:
            continue
        seen.add(key)
        out.setdefault(f"{s['role']} (pid {s['pid']})", []).append([s["step"], round(s["rss_mb"], 1)])
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between samples")
    parser.add_argument("--warmup", type=float, default=0.1, help="share of the steps before the comparison starts")
    for role in ("trainer", "engine"):
        parser.add_argument(
            f"--{role}-malloc",
            choices=["keep", "system"],
            default=None,
            help=f"cluster.{role}_malloc (default: the setting's default)",
        )
    args = parser.parse_args(argv)
    steps = 12 if args.quick else args.steps
    defaults = MilesSettings().cluster
    malloc = {
        "trainer": args.trainer_malloc or defaults.trainer_malloc,
        "engine": args.engine_malloc or defaults.engine_malloc,
    }
    result = soak(steps, args.ranks, args.interval, args.threads, malloc)
    rows = summarize(result["samples"], steps, args.warmup)
    headers = ["process", "steps", "RSS warm (MB)", "RSS end (MB)", "peak", "growth", "limit", "fds", "threads", "ok"]
    table = markdown_table(
        headers,
        [
            [
                r["process"],
                f"{r['from_step']}-{r['to_step']}",
                r["rss_warm_mb"],
                r["rss_end_mb"],
                r["rss_peak_mb"],
                f"{r['rss_growth']:+.1%}",
                f"{RSS_LIMIT:.0%}",
                r["fds"],
                r["threads"],
                "yes" if r["ok"] else "NO",
            ]
            for r in rows
        ],
    )
    print(
        f"soak: {result['steps']} steps in {result['seconds']:.0f} s, {len(result['samples'])} samples, "
        f"malloc: trainers {malloc['trainer']}, engine {malloc['engine']}\n"
    )
    print(table)
    write_json(
        "soak",
        {
            "machine": machine_info(args.device),
            "steps": result["steps"],
            "seconds": result["seconds"],
            "rows": rows,
            "series": series(result["samples"]),
            "malloc": malloc,
            "env": {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "GLIBC_TUNABLES"))},
        },
        args.results_dir,
    )
    (args.results_dir / "soak.md").write_text(table + "\n")
    if not all(r["ok"] for r in rows):
        raise SystemExit("a process grew past the soak's limits")


if __name__ == "__main__":
    main()
