"""Progress of a training run on the launching host, read from the ``metrics.jsonl`` the ranks write.

On a terminal: a rich progress bar (step, reward, s/step, tok/s). Anywhere else (piped, CI, ``nohup``): one
plain line per step, so a log shows how the run goes.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["ZeroRewardNote", "follow_metrics", "step_summary"]


def step_summary(row: dict[str, Any]) -> str:
    """``reward 0.420  5.3 s/step  55 tok/s`` from one metrics row (what is there)."""
    parts = []
    if "rollout/reward_mean" in row:
        parts.append(f"reward {row['rollout/reward_mean']:.3f}")
    elif row.get("train/loss") is not None:
        parts.append(f"loss {row['train/loss']:.4f}")
    if "eval/reward_mean" in row:
        parts.append(f"eval {row['eval/reward_mean']:.3f}")
    if "time/step_seconds" in row:
        parts.append(f"{row['time/step_seconds']:.1f} s/step")
    if "rollout/tokens_per_second" in row:
        parts.append(f"{row['rollout/tokens_per_second']:.0f} tok/s")
    return "  ".join(parts)


class ZeroRewardNote:
    """Says once, when the first ``after`` steps scored every sample 0, what that means: no learning
    signal (what a random model shows: it writes nothing a reward recognises)."""

    def __init__(self, after: int = 2) -> None:
        self.after = after
        self.zero_steps = 0
        self.done = False

    def see(self, row: dict[str, Any]) -> str | None:
        if self.done or "rollout/reward_mean" not in row:
            return None
        if row["rollout/reward_mean"] != 0 or row.get("rollout/reward_std", 0) != 0:
            self.done = True
            return None
        self.zero_steps += 1
        if self.zero_steps < self.after:
            return None
        self.done = True
        return (
            f"note: every sample of the first {self.zero_steps} steps scored 0, so the group-relative advantages "
            "are 0 and nothing is learned yet. A random model (the tiny smoke run's) writes nothing the reward "
            "recognises, so this is expected there; on a real model, check the reward's settings and the labels "
            "(miles view RUN_DIR shows each sample with its reward)."
        )


class _Reader:
    """New complete lines of a growing JSONL file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def rows(self) -> Iterator[dict[str, Any]]:
        if not self.path.exists():
            return
        with open(self.path, encoding="utf-8") as f:
            f.seek(self.offset)
            for line in f:
                if not line.endswith("\n"):
                    break
                self.offset += len(line.encode())
                yield json.loads(line)


@contextmanager
def follow_metrics(
    console: Console | None,
    metrics_path: Path,
    total: int,
    *,
    interval: float = 1.0,
    after_step: int = 0,
    on_step: Callable[[int], object] | None = None,
) -> Iterator[None]:
    """Show the run's progress while the block runs (nothing without a console); ``after_step``: a resumed
    run's rows up to its checkpoint are not shown again; ``on_step`` is called with each new step."""
    if console is None and on_step is None:
        yield
        return
    reader = _Reader(metrics_path)
    for _ in reader.rows():  # (rows already there: a resumed run's earlier steps)
        pass
    stop = threading.Event()
    zero_rewards = ZeroRewardNote()
    if console is None:

        def show(row: dict[str, Any]) -> None:
            pass

    elif console.is_terminal:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(
            TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(), console=console, transient=False,
        )  # fmt: skip
        task = bar.add_task("train", total=total, completed=after_step, info="starting engines and ranks ...")

        def show(row: dict[str, Any]) -> None:
            bar.update(task, completed=int(row["step"]), info=step_summary(row))

    else:

        def show(row: dict[str, Any]) -> None:
            console.print(f"step {int(row['step'])}/{total}  {step_summary(row)}", highlight=False, soft_wrap=True)

    def poll() -> None:
        for row in reader.rows():
            show(row)
            note = zero_rewards.see(row)
            if note and console is not None:
                console.print(note, highlight=False, soft_wrap=True)
            if on_step is not None and isinstance(row.get("step"), (int, float)):
                on_step(int(row["step"]))

    def follow() -> None:
        while not stop.wait(interval):
            poll()

    follower = threading.Thread(target=follow, name="miles-progress", daemon=True)
    if console is not None and console.is_terminal:
        bar.start()
    follower.start()
    try:
        yield
    finally:
        stop.set()
        follower.join()
        poll()
        if console is not None and console.is_terminal:
            bar.stop()  # before anything else prints: no log line runs into the bar
