"""Build :class:`MilesSettings` from a file, ``MILES_*`` environment variables and ``--set`` overrides.

Precedence, lowest first: defaults < file (TOML or YAML) < environment < ``--set a.b=c``. Every value
remembers where it came from, so an error says ``train.lr (run.toml:7): ...`` or
``train.lr (env MILES_TRAIN__LR): ...``.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_settings import EnvSettingsSource

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, as a package
    import tomli as tomllib

from miles.errors import SettingsError
from miles.settings.errors import format_validation_error
from miles.settings.model import MilesSettings

__all__ = ["SettingsSources", "load_settings", "parse_override"]


class SettingsSources:
    """Where each dotted field path got its value."""

    def __init__(self) -> None:
        self._by_path: dict[str, str] = {}

    def set(self, path: str, source: str) -> None:
        self._by_path[path] = source

    def of(self, path: str) -> str | None:
        """The source of ``path`` or of its nearest parent that has one."""
        probe = path
        while probe:
            if probe in self._by_path:
                return self._by_path[probe]
            probe = re.sub(r"(\.[^.\[]+|\[\d+\])$", "", probe) if re.search(r"(\.[^.\[]+|\[\d+\])$", probe) else ""
        return None

    def items(self) -> list[tuple[str, str]]:
        return sorted(self._by_path.items())


def _leaf_paths(data: Any, prefix: str = "") -> list[str]:
    if isinstance(data, Mapping):
        out = [prefix] if prefix else []
        for key, value in data.items():
            out += _leaf_paths(value, f"{prefix}.{key}" if prefix else str(key))
        return out
    if isinstance(data, list):
        out = [prefix]
        for i, value in enumerate(data):
            out += _leaf_paths(value, f"{prefix}[{i}]")
        return out
    return [prefix]


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


# -- files ------------------------------------------------------------------------------------------


def _toml_lines(text: str) -> dict[str, int]:
    """Dotted key path -> line number, for the key forms a settings file uses."""
    lines: dict[str, int] = {}
    table = ""
    array_counts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip() if not raw.strip().startswith(("'", '"')) else raw.strip()
        if not line:
            continue
        if m := re.match(r"^\[\[\s*([^\]]+?)\s*\]\]$", line):
            name = m.group(1).replace(" ", "")
            index = array_counts.get(name, 0)
            array_counts[name] = index + 1
            table = f"{name}[{index}]"
            lines.setdefault(table, number)
        elif m := re.match(r"^\[\s*([^\]]+?)\s*\]$", line):
            table = m.group(1).replace(" ", "")
            lines.setdefault(table, number)
        elif m := re.match(r'^([A-Za-z0-9_.\-"\' ]+?)\s*=', line):
            key = m.group(1).replace(" ", "").replace('"', "").replace("'", "")
            lines[f"{table}.{key}" if table else key] = number
    return lines


def _yaml_lines(text: str) -> dict[str, int]:
    lines: dict[str, int] = {}

    def walk(node: yaml.Node, path: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                child = f"{path}.{key_node.value}" if path else str(key_node.value)
                lines[child] = key_node.start_mark.line + 1
                walk(value_node, child)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                child = f"{path}[{i}]"
                lines[child] = item.start_mark.line + 1
                walk(item, child)

    root = yaml.compose(text)
    if root is not None:
        walk(root, "")
    return lines


def _read_file(path: Path, sources: SettingsSources) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SettingsError(f"cannot read settings file {path}: {exc.strerror}") from None
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            data: Any = tomllib.loads(text)
            line_of = _toml_lines(text)
        elif suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
            line_of = _yaml_lines(text)
        else:
            raise SettingsError(f"settings file {path}: expected a .toml, .yaml or .yml file")
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"settings file {path}: invalid TOML: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise SettingsError(f"settings file {path}{where}: invalid YAML: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(data, dict):
        raise SettingsError(f"settings file {path}: the top level must be a table of sections")
    for leaf in _leaf_paths(data):
        line = line_of.get(leaf)
        sources.set(leaf, f"{path}:{line}" if line else str(path))
    return data


# -- environment ------------------------------------------------------------------------------------


def _read_env(sources: SettingsSources, env: Mapping[str, str] | None) -> dict[str, Any]:
    environ = dict(os.environ if env is None else env)
    source = EnvSettingsSource(
        MilesSettings,
        env_prefix="MILES_",
        env_nested_delimiter="__",
        case_sensitive=False,
        env_parse_none_str="null",
    )
    source.env_vars = {k.lower(): v for k, v in environ.items()}
    try:
        data = source()
    except Exception as exc:  # pydantic-settings raises SettingsError for undecodable JSON values
        raise SettingsError(f"environment: {exc}") from None
    names = {k.lower(): k for k in environ}
    for leaf in _leaf_paths(data):
        var = "MILES_" + leaf.replace(".", "__").upper()
        var = names.get(var.lower(), var)
        if var.lower() not in names:  # a nested value given as JSON in its parent's variable
            parent = leaf
            while "." in parent and ("miles_" + parent.replace(".", "__")).lower() not in names:
                parent = parent.rsplit(".", 1)[0]
            var = names.get(("miles_" + parent.replace(".", "__")).lower(), var)
        sources.set(leaf, f"env {var}")
    return data


# -- overrides --------------------------------------------------------------------------------------


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"train.lr=1e-5"`` -> (["train", "lr"], 1e-05). Values are read as TOML/JSON literals when they
    parse (numbers, booleans, lists, inline tables), else kept as strings."""
    if "=" not in text:
        raise SettingsError(f"--set {text!r}: expected KEY=VALUE, e.g. --set train.lr=1e-5")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$", key):
        raise SettingsError(f"--set {text!r}: invalid key {key!r} (expected dotted names like train.lr)")
    raw = raw.strip()
    value: Any
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
    return key.split("."), value


def _apply_overrides(overrides: Sequence[str], sources: SettingsSources) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise SettingsError(f"--set {text!r}: {'.'.join(parts[:-1])} is not a table")
        node[parts[-1]] = value
        path = ".".join(parts)
        for leaf in _leaf_paths(value, path) if isinstance(value, (dict, list)) else [path]:
            sources.set(leaf, f"--set {text}")
    return data


# -- entry point ------------------------------------------------------------------------------------


def load_settings(
    path: str | os.PathLike[str] | None = None,
    *,
    overrides: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> MilesSettings:
    """Load and validate settings. Raises :class:`SettingsError` whose message names each bad field and
    its source. (Plugin choices are checked separately by ``PluginManager.validate_settings``.)

    :param path: a ``.toml`` / ``.yaml`` file, or ``None`` for defaults.
    :param overrides: ``KEY=VALUE`` strings, applied last.
    :param env: environment to read ``MILES_*`` from (default ``os.environ``).
    """
    sources = SettingsSources()
    data: dict[str, Any] = {}
    if path is not None:
        data = _deep_merge(data, _read_file(Path(path), sources))
    data = _deep_merge(data, _read_env(sources, env))
    data = _deep_merge(data, _apply_overrides(overrides, sources))
    try:
        settings = MilesSettings.model_validate(data)
    except ValidationError as exc:
        raise SettingsError(format_validation_error(exc, source_of=sources.of)) from None
    settings._sources = sources
    return settings


def sources_of(settings: MilesSettings) -> SettingsSources:
    """The :class:`SettingsSources` recorded by :func:`load_settings` (empty for other settings)."""
    sources: SettingsSources | None = settings._sources
    return sources or SettingsSources()
