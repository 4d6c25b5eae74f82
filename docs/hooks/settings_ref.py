"""MkDocs hook: generate reference tables from the code at build time.

A page holding the marker ``<!-- miles:settings -->`` gets every section of the settings tree
(:class:`miles.settings.model.MilesSettings`) and the settings model of every built-in component, with
each field's type, constraints, default, environment variable and docstring. ``<!-- miles:cli -->``
gets every ``miles`` command with its usage and options, read from the typer application. Nothing is
copied by hand, so the pages cannot drift from the code.
"""

from __future__ import annotations

import enum
import importlib
import json
import re
import sys
import typing
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parents[2]
SETTINGS_MARKER = "<!-- miles:settings -->"
CLI_MARKER = "<!-- miles:cli -->"


def _import_miles() -> None:
    """Make ``miles`` importable from the checkout when it is not installed (the docs environment)."""
    try:
        import miles
    except ImportError:
        sys.path.insert(0, str(ROOT / "miles-core" / "src"))
        try:
            import miles  # noqa: F401
        except ImportError as exc:
            raise PluginError(f"docs/hooks/settings_ref.py: cannot import miles from miles-core/src: {exc}") from exc


# -- rendering helpers -------------------------------------------------------------------------------


def _prose(text: str | None) -> str:
    """A docstring as one table cell: reST roles to code, pipes escaped, one line."""
    text = (text or "").strip()
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text)
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    text = " ".join(text.split())
    return text.replace("|", "\\|")


def _type_name(annotation: Any) -> str:
    if annotation is None or annotation is type(None):
        return "None"
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    text = repr(annotation).replace("typing.", "").replace("NoneType", "None")
    return re.sub(r"\b(?:[a-z_][\w]*\.)+([A-Za-z_]\w*)", r"\1", text)


def _constraints(metadata: list[Any]) -> str:
    symbols = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "min_length": "min length", "max_length": "max length"}
    parts = []
    for item in metadata:
        for attr, symbol in symbols.items():
            value = getattr(item, attr, None)
            if value is not None:
                parts.append(f"{symbol} {value}")
    return f" ({', '.join(parts)})" if parts else ""


def _default(info: Any) -> str:
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    if info.is_required():
        return "*required*"
    value = info.default_factory() if info.default_factory is not None else info.default
    if value is PydanticUndefined:
        return "*required*"
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
        if (isinstance(value, dict) and set(value) == {"name"}) or (
            isinstance(value, dict)
            and "name" in value
            and all(k == "name" or v in (None, 1.0) for k, v in value.items())
        ):
            value = value["name"]
    elif isinstance(value, list):
        value = [v.model_dump(mode="json") if isinstance(v, BaseModel) else v for v in value]
        value = [v["name"] if isinstance(v, dict) and set(v) == {"name"} else v for v in value]
    if isinstance(value, enum.Enum):
        value = value.value
    return f"`{json.dumps(value, ensure_ascii=False)}`".replace("|", "\\|")


def _fields_table(model: Any, *, env_prefix: str | None) -> list[str]:
    lines = []
    header = "| field | type | default | description |"
    rule = "|---|---|---|---|"
    if env_prefix is not None:
        header = "| field | type | default | environment | description |"
        rule = "|---|---|---|---|---|"
    lines += [header, rule]
    for name, info in model.model_fields.items():
        if info.exclude:
            continue
        cells = [f"`{name}`", f"`{_type_name(info.annotation)}`{_constraints(info.metadata)}", _default(info)]
        if env_prefix is not None:
            cells.append(f"`{env_prefix}{name.upper()}`")
        cells.append(_prose(info.description))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


# -- the settings page -------------------------------------------------------------------------------

_WHERE: dict[str, str] = {
    "launcher": "[cluster.launcher]",
    "data_source": "[data.source]",
    "rollout_engine": "[rollout.engine]",
    "trainer": "[train.backend]",
    "algorithm": "[algorithm]",
    "transport": "[transport]",
    "precision": "[precision]",
    "reward": "[[reward.functions]]",
    "logger": "[[log.loggers]]",
}
"""Where in a settings file a component of each kind is selected (its other keys are its settings)."""


def render_settings() -> str:
    _import_miles()
    from pydantic import BaseModel

    from miles.components import ComponentKind
    from miles.plugins.manager import PluginManager
    from miles.settings.model import MilesSettings, PluginSpec

    out = ["## The settings tree", ""]
    for section, info in MilesSettings.model_fields.items():
        model = info.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            continue
        out += [f"### `{section}`", "", _prose(info.description), ""]
        if issubclass(model, PluginSpec):
            out += [
                f'A component chosen by name: `{section} = "{_default(info).strip("`").strip(chr(34))}"`, or a table '
                f"`[{section}]` whose `name` picks the component and whose other keys are that component's settings "
                f"(see [component settings](#component-settings)).",
                "",
            ]
        out += _fields_table(model, env_prefix=f"MILES_{section.upper()}__")
        out.append("")
        for name, field in model.model_fields.items():  # nested tables: [rollout.teacher], [log.signals] ...
            sub = field.annotation
            if isinstance(sub, type) and issubclass(sub, BaseModel) and not issubclass(sub, PluginSpec):
                out += [f"#### `{section}.{name}`", "", _prose(field.description), ""]
                out += _fields_table(sub, env_prefix=f"MILES_{section.upper()}__{name.upper()}__")
                out.append("")

    out += [
        "## Component settings",
        "",
        "The settings models of the components built into `miles-core`. A component from another package "
        "documents its own; `miles plugins list` shows what is installed.",
        "",
    ]
    manager = PluginManager(entry_points=False, disabled=(), only=())
    failed = [r for r in manager.records() if r.status != "ok"]
    if failed:
        problems = "; ".join(f"{r.name}: {r.error}" for r in failed)
        raise PluginError(f"docs/hooks/settings_ref.py: built-in plugins failed to load: {problems}")
    for kind in ComponentKind:
        entries = list(manager.registry(kind))
        if not entries:
            continue
        out += [f"### {kind.label.capitalize()}s", ""]
        where = _WHERE.get(kind.value)
        if where:
            out += [f"Selected in `{where}` by `name`; the other keys of that table are the settings below.", ""]
        for entry in entries:
            out += [f"#### `{entry.name}`", "", f"{_prose(entry.description)} *(plugin `{entry.plugin}`)*", ""]
            if entry.settings_model.model_fields:
                out += _fields_table(entry.settings_model, env_prefix=None)
            else:
                out.append("No settings.")
            out.append("")
    return "\n".join(out)


# -- the CLI page ------------------------------------------------------------------------------------


def render_cli() -> str:
    _import_miles()
    import typer

    app_module = importlib.import_module("miles.cli.app")
    register = getattr(app_module, "_register_commands", None)
    if register is not None:
        register()
    root = typer.main.get_command(app_module.app)
    out: list[str] = []

    # typer may vendor its own click: the command tree is read by duck typing, not isinstance
    def walk(command: Any, path: list[str], parent: Any) -> None:
        ctx = command.context_class(command, info_name=path[-1], parent=parent)
        if hasattr(command, "list_commands"):
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                if sub is not None and not sub.hidden:
                    walk(sub, [*path, name], ctx)
            return
        out.extend([f"### `{' '.join(path)}`", "", _prose(command.help), ""])
        pieces = " ".join(command.collect_usage_pieces(ctx))
        out.extend(["```text", f"{' '.join(path)} {pieces}".rstrip(), "```", ""])
        params = [p for p in command.get_params(ctx) if p.name != "help"]
        if not params:
            return
        out.extend(["| argument / option | description |", "|---|---|"])
        for param in params:
            record = param.get_help_record(ctx)
            names, help_text = record if record else (param.name.upper(), "")
            out.append(f"| `{names.replace('|', '/')}` | {_prose(help_text)} |")
        out.append("")

    walk(root, ["miles"], None)
    return "\n".join(out)


# -- mkdocs entry point ------------------------------------------------------------------------------


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace the markers with the generated reference."""
    if SETTINGS_MARKER in markdown:
        markdown = markdown.replace(SETTINGS_MARKER, render_settings())
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, render_cli())
    return markdown
