"""Print resolved settings and which plugin serves each component (``miles train --dry-run``)."""

from __future__ import annotations

import json
from collections.abc import Mapping

from rich.console import Console
from rich.table import Table

from miles.plugins.registry import Registration
from miles.settings.model import MilesSettings

__all__ = ["render_resolved"]


def render_resolved(console: Console, settings: MilesSettings, chosen: Mapping[str, Registration[object]]) -> None:
    console.print("[bold]Resolved settings[/]")
    data = settings.model_dump(mode="json")
    data["train"]["steps_per_rollout"] = settings.train.steps_per_rollout
    console.print_json(json.dumps(data))
    table = Table(title="Components")
    for column in ("setting", "kind", "name", "plugin"):
        table.add_column(column)
    for field_path, entry in chosen.items():
        table.add_row(field_path, entry.kind.label, entry.name, entry.plugin)
    console.print(table)
