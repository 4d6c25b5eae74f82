"""Print the resolved settings and which plugin serves each component: a summary for ``miles train``, every
setting for ``miles train --dry-run`` (a run keeps them all in ``<run_dir>/settings.json``)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from rich.console import Console
from rich.table import Table

from miles.defaults import Choice, ThreadSplit
from miles.plugins.registry import Registration
from miles.settings.model import MilesSettings

__all__ = ["render_choices", "render_resolved"]


def _summary(settings: MilesSettings) -> list[tuple[str, str]]:
    s = settings
    return [
        ("model", str(s.train.model_path)),
        ("data", str(s.data.path)),
        (
            "steps",
            f"{s.train.num_rollouts} x {s.rollout.rollout_batch_size} prompts x {s.rollout.n_samples_per_prompt} samples",
        ),
        (
            "mode",
            f"{s.rollout.mode}, {s.cluster.trainer_ranks} trainer rank(s), {s.cluster.num_engines} engine(s) on {s.cluster.device}",
        ),
        ("run dir", f"{s.log.run_dir} (every setting: settings.json there)"),
    ]


def render_resolved(
    console: Console, settings: MilesSettings, chosen: Mapping[str, Registration[object]], *, full: bool = False
) -> None:
    if full:
        console.print("[bold]Resolved settings[/]")
        data = settings.model_dump(mode="json")
        data["train"]["steps_per_rollout"] = settings.train.steps_per_rollout
        console.print_json(json.dumps(data))
    else:
        for key, value in _summary(settings):
            console.print(f"[bold]{key}[/]: {value}", highlight=False, soft_wrap=True)
    table = Table(title="Components")
    for column in ("setting", "kind", "name", "plugin"):
        table.add_column(column)
    for field_path, entry in chosen.items():
        table.add_row(field_path, entry.kind.label, entry.name, entry.plugin)
    console.print(table)


def render_choices(console: Console, choices: Iterable[Choice], threads: ThreadSplit | None = None) -> None:
    """The run's precision, transport and thread split, each with why (``auto``: chosen from the machine)."""
    for choice in choices:
        console.print(f"[bold]{choice.field}[/]: {choice.value} ({choice.reason})", highlight=False, soft_wrap=True)
    if threads is not None:
        line = threads.line().removeprefix("threads: ")
        console.print(f"[bold]threads[/]: {line}", highlight=False, soft_wrap=True)
