"""Print the resolved settings and which plugin serves each component: a summary for ``miles train``, every
setting with where its value came from for ``miles train --dry-run`` (a run keeps them all in
``<run_dir>/settings.json``)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from miles.defaults import Choice, ThreadSplit
from miles.plugins.registry import Registration
from miles.settings.loader import sources_of
from miles.settings.model import MilesSettings

__all__ = ["render_choices", "render_resolved", "resolved_rows"]


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


def _leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            yield from _leaves(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list) and value and any(isinstance(item, dict) for item in value):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{path}[{i}]")
    else:
        yield path, value


def _put(data: Any, path: str, value: Any) -> None:
    """Set ``data`` at a field path such as ``reward.functions[0]``."""
    parts = [int(p) if p.isdigit() else p for p in re.findall(r"[^.\[\]]+", path)]
    for part in parts[:-1]:
        data = data[part]
    data[parts[-1]] = value


def _shorter(source: str) -> str:
    """``/abs/run.toml:7`` as ``run.toml:7`` when the file is under the working directory."""
    path, colon, line = source.partition(":") if not source.startswith(("env ", "--set ")) else (source, "", "")
    if os.path.isabs(path):
        relative = os.path.relpath(path)
        path = relative if not relative.startswith("..") else path
    return f"{path}{colon}{line}"


def resolved_rows(
    settings: MilesSettings, options: Mapping[str, BaseModel] | None = None
) -> list[tuple[str, str, str]]:
    """``(setting, value as JSON, where it came from)`` for every resolved setting: a file and line, ``env
    VAR``, ``--set KEY=VALUE``, ``default`` or ``derived``. ``options``: each selected component's validated
    settings by field path (their defaults are listed too)."""
    data = settings.model_dump(mode="json")
    for field, validated in (options or {}).items():
        name = _settings_name(data, field)
        _put(data, field, {"name": name, **validated.model_dump(mode="json")})
    data["train"]["steps_per_rollout"] = settings.train.steps_per_rollout
    known = dict(sources_of(settings).items())
    rows = []
    for path, value in _leaves(data):
        source = known.get(path)
        if source is None and path.endswith(".name"):  # a component given by its name alone
            source = known.get(path.removesuffix(".name"))
        if source is None:
            source = "derived" if path == "train.steps_per_rollout" else "default"
        rows.append((path, json.dumps(value), _shorter(source)))
    return rows


def _settings_name(data: Any, field: str) -> Any:
    """The ``name`` a component's settings give at ``field`` of a settings dump."""
    node = data
    for part in re.findall(r"[^.\[\]]+", field):
        node = node[int(part)] if part.isdigit() else node[part]
    return node.get("name") if isinstance(node, dict) else node


def render_resolved(
    console: Console,
    settings: MilesSettings,
    chosen: Mapping[str, Registration[object]],
    *,
    full: bool = False,
    options: Mapping[str, BaseModel] | None = None,
) -> None:
    if full:
        rows = resolved_rows(settings, options)
        console.print("[bold]Resolved settings[/] (setting, value, where it came from)")
        width = max(len(path) for path, _, _ in rows)
        value_width = min(40, max(len(value) for _, value, _ in rows))
        for path, value, source in rows:
            console.print(
                f"  {path:<{width}}  {value:<{value_width}}  {source}", highlight=False, markup=False, soft_wrap=True
            )
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
