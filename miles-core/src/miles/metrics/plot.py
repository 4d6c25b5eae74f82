"""PNG curves of a run's ``metrics.jsonl`` (``miles plot RUN_DIR``)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miles.components import Requirement

__all__ = ["DEFAULT_PANELS", "MATPLOTLIB", "panels_for", "plot_run", "read_metrics"]

MATPLOTLIB = Requirement("matplotlib", extra="plot")
"""What the curves are drawn with."""

DEFAULT_PANELS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("reward", "mean reward", ("rollout/reward_mean", "eval/reward_mean")),
    ("KL to the reference", "KL (nats / token)", ("train/kl",)),
    ("entropy", "entropy (nats / token)", ("train/entropy",)),
    ("train vs rollout |logprob diff|", "|logprob diff| (nats)", ("fidelity/train_rollout_logprob_abs_diff",)),
    ("step time", "seconds", ("time/step_seconds", "rollout/seconds", "time/train_seconds", "weight_sync/seconds")),
)
"""(title, y-axis label, metric keys) per panel; keys a run does not have are skipped, and so is a panel
none of whose keys were logged (a run without a KL term has no KL panel)."""


def read_metrics(run_dir: str | Path) -> list[dict[str, float]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no metrics (is {run_dir} a run directory?)")
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
    return rows


def panels_for(
    rows: Sequence[dict[str, Any]], panels: Sequence[tuple[str, str, Sequence[str]]] = DEFAULT_PANELS
) -> list[tuple[str, str, list[str]]]:
    """The panels drawn for ``rows``: each with the keys that were logged (finite somewhere); panels
    without any are left out."""

    def logged(key: str) -> bool:
        return any(isinstance(r.get(key), (int, float)) and math.isfinite(r[key]) for r in rows)

    present = [(title, ylabel, [k for k in keys if logged(k)]) for title, ylabel, keys in panels]
    return [(title, ylabel, keys) for title, ylabel, keys in present if keys]


def plot_run(
    run_dir: str | Path,
    out: str | Path | None = None,
    panels: Sequence[tuple[str, str, Sequence[str]]] = DEFAULT_PANELS,
) -> Path:
    """Draw one panel per metric group that the run logged; returns the PNG's path."""
    MATPLOTLIB.load("miles plot").use("Agg")
    plt = MATPLOTLIB.load("miles plot", "matplotlib.pyplot")

    rows = read_metrics(run_dir)
    present = panels_for(rows, panels)
    if not present:
        raise ValueError(f"{run_dir}: none of the plotted metrics were logged")
    axes: Any
    fig, axes = plt.subplots(len(present), 1, figsize=(7, 2.6 * len(present)), sharex=True, squeeze=False)
    for ax, (title, ylabel, keys) in zip(axes[:, 0], present, strict=True):
        for key in keys:
            points = [(r["step"], r[key]) for r in rows if key in r and r[key] is not None and math.isfinite(r[key])]
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, label=key)
        ax.set_title(title)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel("training step")
    fig.tight_layout()
    target = Path(out) if out is not None else Path(run_dir) / "curves.png"
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target
