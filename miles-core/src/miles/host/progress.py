"""Progress of a training run on the launching host, read from the ``metrics.jsonl`` the ranks write.

On a terminal: a rich progress bar (step, reward, s/step, tok/s). Anywhere else (piped, CI, ``nohup``): one
plain line per step, so a log shows how the run goes.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["follow_metrics", "step_summary"]


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
    console: Console | None, metrics_path: Path, total: int, *, interval: float = 1.0, after_step: int = 0
) -> Iterator[None]:
    """Show the run's progress while the block runs (nothing without a console); ``after_step``: a resumed
    run's rows up to its checkpoint are not shown again."""
    if console is None:
        yield
        return
    reader = _Reader(metrics_path)
    for _ in reader.rows():  # (rows already there: a resumed run's earlier steps)
        pass
    stop = threading.Event()
    if console.is_terminal:
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

    def follow() -> None:
        while not stop.wait(interval):
            poll()

    follower = threading.Thread(target=follow, name="miles-progress", daemon=True)
    if console.is_terminal:
        bar.start()
    follower.start()
    try:
        yield
    finally:
        stop.set()
        follower.join()
        poll()
        if console.is_terminal:
            bar.stop()  # before anything else prints: no log line runs into the bar
