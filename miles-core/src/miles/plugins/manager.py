"""The plugin manager: loads built-in and entry-point plugins, fills the typed registries, calls the
lifecycle hooks. It is the only code that touches ``pm.hook``; everything else calls its typed methods.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import pluggy

from miles import hookspecs
from miles._version import __version__
from miles.components import ComponentKind
from miles.errors import DuplicateComponentError, PluginLoadError, SettingsError
from miles.markers import PROJECT, hookimpl
from miles.plugins.builtin import BUILTIN_PLUGINS
from miles.plugins.registry import Registration, Registry

if TYPE_CHECKING:
    import typer
    from fastapi import FastAPI
    from pydantic import BaseModel

    from miles.settings.model import MilesSettings, PluginSpec
    from miles.types import PushReport, SampleGroup

__all__ = ["ENTRY_POINT_GROUP", "PluginManager", "PluginRecord", "hookimpl"]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "miles.plugins"
DISABLE_ENV = "MILES_DISABLE_PLUGINS"
LOAD_ENV = "MILES_LOAD_PLUGINS"

Status = Literal["ok", "blocked", "failed"]


@dataclass
class PluginRecord:
    """What ``miles plugins list`` shows for one plugin."""

    name: str
    distribution: str
    version: str
    builtin: bool
    status: Status = "ok"
    error: str | None = None
    """One line: ``ImportError: No module named 'torch'``."""
    traceback: str | None = None
    registers: list[tuple[str, str]] = field(default_factory=list)
    """``(kind, name)`` pairs this plugin registered."""
    hooks: list[str] = field(default_factory=list)
    """Hook names the plugin implements."""
    commands: list[str] = field(default_factory=list)
    """CLI subcommands the plugin added (``miles_register_commands``)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "builtin": self.builtin,
            "status": self.status,
            "error": self.error,
            "registers": [{"kind": k, "name": n} for k, n in self.registers],
            "hooks": list(self.hooks),
            "commands": list(self.commands),
        }


def _split_env(value: str | None) -> list[str] | None:
    if value is None:
        return None
    return [part.strip() for part in value.split(",") if part.strip()]


def _command_names(commands: Iterable[Any], groups: Iterable[Any]) -> set[str]:
    """The names typer gives registered commands (``name``, else the callback's with dashes) and groups."""
    names = {c.name or (c.callback.__name__.replace("_", "-") if c.callback else "") for c in commands}
    return names | {g.name or "" for g in groups}


def _group_commands(groups: Iterable[Any]) -> dict[str, tuple[Any, list[Any]]]:
    """Each named group's typer app and its commands so far (a plugin may add commands to an existing group,
    e.g. ``miles convert``)."""
    return {
        g.name: (g.typer_instance, list(g.typer_instance.registered_commands))
        for g in groups
        if g.name and g.typer_instance
    }


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


class PluginManager:
    """Loads plugins and answers typed questions about them.

    :param builtins: ``(name, module)`` pairs of built-in plugins (default :data:`BUILTIN_PLUGINS`).
    :param entry_points: load plugins from the ``miles.plugins`` entry-point group.
    :param disabled: plugin names to block (default: ``MILES_DISABLE_PLUGINS``, comma-separated).
    :param only: load only these entry-point plugins (default: ``MILES_LOAD_PLUGINS`` when set).
    """

    def __init__(
        self,
        *,
        builtins: Sequence[tuple[str, str]] = BUILTIN_PLUGINS,
        entry_points: bool = True,
        disabled: Iterable[str] | None = None,
        only: Iterable[str] | None = None,
    ) -> None:
        self._pm = pluggy.PluginManager(PROJECT)
        self._pm.add_hookspecs(hookspecs)
        self._builtins = tuple(builtins)
        self._use_entry_points = entry_points
        env_disabled = _split_env(os.environ.get(DISABLE_ENV))
        self._disabled = set(disabled if disabled is not None else env_disabled or [])
        self._only = (
            set(only)
            if only is not None
            else (set(o) if (o := _split_env(os.environ.get(LOAD_ENV))) is not None else None)
        )
        self._records: dict[str, PluginRecord] = {}
        self._registries: dict[ComponentKind, Registry[Any]] | None = None
        self._conflicts: dict[tuple[ComponentKind, str], DuplicateComponentError] = {}
        self._loaded = False

    # -- loading ----------------------------------------------------------------------------------
    def load(self) -> PluginManager:
        """Load built-ins, then entry points (once). Failures are recorded, never raised."""
        if self._loaded:
            return self
        self._loaded = True
        for name, module_name in self._builtins:
            record = PluginRecord(name, "miles-core", __version__, builtin=True)
            if self._block(record):
                continue
            self._import_and_register(record, lambda m=module_name: importlib.import_module(m))
        if self._use_entry_points:
            self._load_entry_points()
        return self

    def _block(self, record: PluginRecord) -> bool:
        self._records[record.name] = record
        if record.name in self._disabled:
            record.status = "blocked"
            record.error = f"blocked by {DISABLE_ENV}"
            self._pm.set_blocked(record.name)
            return True
        return False

    def _load_entry_points(self) -> None:
        for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            dist = ep.dist
            record = PluginRecord(
                ep.name,
                dist.metadata["Name"] if dist is not None else "?",
                dist.version if dist is not None else "?",
                builtin=False,
            )
            if ep.name in self._records:
                existing = self._records[ep.name]
                if existing.distribution == record.distribution:
                    continue  # the same distribution seen twice on sys.path
                record.status = "failed"
                record.error = f"plugin name {ep.name!r} is already taken by distribution {existing.distribution!r}"
                self._records[f"{ep.name} ({record.distribution})"] = record
                continue
            if self._only is not None and ep.name not in self._only:
                self._records[record.name] = record
                record.status = "blocked"
                record.error = f"not listed in {LOAD_ENV}"
                continue
            if self._block(record):
                continue
            self._import_and_register(record, ep.load)

    def _import_and_register(self, record: PluginRecord, loader: Any) -> None:
        self._records[record.name] = record
        try:
            plugin = loader()
            self._pm.register(plugin, name=record.name)
        except Exception as exc:  # a broken plugin must never take the CLI down
            record.status = "failed"
            record.error = _one_line(exc)
            record.traceback = traceback.format_exc()
            log.debug("plugin %s failed to load", record.name, exc_info=True)
            return
        callers = self._pm.get_hookcallers(plugin) or []
        unknown = sorted(c.name for c in callers if c.spec is None)
        if unknown:
            self._pm.unregister(plugin)
            record.status = "failed"
            record.error = f"implements unknown hook(s): {', '.join(unknown)}"
            return
        record.hooks = sorted(c.name for c in callers)
        self._registries = None

    def register(self, plugin: object, name: str, *, distribution: str = "(in-process)", version: str = "") -> None:
        """Register an in-process plugin object (tests, notebooks, ``miles.testing``)."""
        self.load()
        record = PluginRecord(name, distribution, version or __version__, builtin=False)
        self._import_and_register(record, lambda: plugin)
        if record.status == "failed":
            raise PluginLoadError(f"plugin {name!r}: {record.error}")

    def unregister(self, name: str) -> None:
        """Remove a plugin registered by :meth:`register` (or loaded) by name."""
        plugin = self._pm.get_plugin(name)
        if plugin is not None:
            self._pm.unregister(plugin)
        self._records.pop(name, None)
        self._registries = None

    # -- records ----------------------------------------------------------------------------------
    def records(self) -> list[PluginRecord]:
        """Every plugin seen, with what it registers (built-ins first, then by name)."""
        self.load()
        self._build_registries()
        return sorted(self._records.values(), key=lambda r: (not r.builtin, r.name))

    def failed(self) -> list[PluginRecord]:
        return [r for r in self.records() if r.status == "failed"]

    # -- registries -------------------------------------------------------------------------------
    def _build_registries(self) -> dict[ComponentKind, Registry[Any]]:
        self.load()
        if self._registries is not None:
            return self._registries
        registries = {kind: Registry[Any](kind) for kind in ComponentKind}
        self._conflicts = {}
        for existing in self._records.values():
            existing.registers = []
        for kind in ComponentKind:
            hook_name = kind.hook
            caller = getattr(self._pm.hook, hook_name)
            # call each implementation on its own so every registration is attributed to its plugin,
            # in registration order (built-ins first): the later plugin is the one that collides
            for impl in caller.get_hookimpls():
                plugin_name = impl.plugin_name
                record: PluginRecord | None = self._records.get(plugin_name)

                def register(
                    component: Any,
                    *,
                    name: str | None = None,
                    _p: str = plugin_name,
                    _r: Any = record,
                    _k: ComponentKind = kind,
                ) -> None:
                    try:
                        entry = registries[_k].add(component, plugin=_p, name=name)
                    except DuplicateComponentError as exc:
                        resolved = str(name or getattr(component, "name", "?"))
                        self._conflicts[(_k, resolved)] = exc
                        if _r is not None:
                            _r.status = "failed"
                            _r.error = str(exc)
                        return
                    if _r is not None:
                        _r.registers.append((_k.value, entry.name))

                try:
                    impl.function(register=register)
                except Exception as exc:
                    if record is not None:
                        record.status = "failed"
                        record.error = f"{hook_name}: {_one_line(exc)}"
                        record.traceback = traceback.format_exc()
        self._registries = registries
        return registries

    def registry(self, kind: ComponentKind | str) -> Registry[Any]:
        """The registry of one kind of component."""
        return self._build_registries()[ComponentKind(kind)]

    def get(self, kind: ComponentKind | str, name: str, *, field: str | None = None) -> Registration[Any]:
        """The component registered as ``name``; a clear error when it is missing, conflicting, or its
        plugin failed to load."""
        kind = ComponentKind(kind)
        registry = self.registry(kind)
        if (kind, name) in self._conflicts:
            raise self._conflicts[(kind, name)]
        if name in registry:
            return registry.get(name)
        hint = ""
        failed = self.failed()
        suspects = [r for r in failed if r.name == name or name in r.name] or failed
        if suspects:
            lines = "".join(
                f"\n  plugin {r.name!r} ({r.distribution} {r.version}) failed to load: {r.error}" for r in suspects
            )
            hint = f"; plugins that failed to load and may provide it:{lines}"
            detail = "".join(f"\n\n{r.traceback}" for r in suspects if r.traceback)
            raise PluginLoadError(
                f"{field + ': ' if field else ''}{kind.label} {name!r} is not available{hint}{detail}"
            )
        return registry.get(name, field=field, hint=hint)

    def resolve(
        self,
        kind: ComponentKind | str,
        spec: PluginSpec,
        *,
        field: str,
        source_of: Callable[[str], str | None] | None = None,
    ) -> tuple[Registration[Any], BaseModel]:
        """Look up ``spec.name`` and validate ``spec``'s other keys with the component's settings model.

        Errors name the field path (``algorithm.clip_eps``) and the component.
        """
        from pydantic import ValidationError

        from miles.settings.errors import format_validation_error

        name_field = field
        source = source_of(field) if source_of else None
        if source_of is not None and source_of(f"{field}.name") != source:  # a table with a name key
            name_field = f"{field}.name"
            source = source_of(name_field)
        entry = self.get(kind, spec.name, field=f"{name_field} ({source})" if source else name_field)
        try:
            options = entry.settings_model.model_validate(spec.options)
        except ValidationError as exc:
            context = f"settings of {entry.kind.label} {entry.name!r} (plugin {entry.plugin!r})"
            raise SettingsError(
                format_validation_error(exc, prefix=field, context=context, source_of=source_of)
            ) from None
        return entry, options

    def create(self, kind: ComponentKind | str, spec: PluginSpec, *, field: str, **kwargs: Any) -> Any:
        """Instantiate the component ``spec`` selects, passing its validated settings first."""
        entry, options = self.resolve(kind, spec, field=field)
        return entry.component(options, **kwargs)

    # -- commands ---------------------------------------------------------------------------------
    def register_commands(self, app: typer.Typer) -> None:
        """Let every plugin add its CLI subcommands to ``app`` (``miles_register_commands``).

        A plugin whose hook raises, or that claims a command name already taken, is recorded as failed
        (``miles plugins list`` shows why) and its commands are left out; the CLI keeps working.
        """
        self.load()
        for impl in self._pm.hook.miles_register_commands.get_hookimpls():
            record = self._records.get(impl.plugin_name)
            commands, groups = list(app.registered_commands), list(app.registered_groups)
            taken = _command_names(commands, groups)
            nested = _group_commands(groups)
            try:
                impl.function(app=app)
                added = _command_names(app.registered_commands[len(commands) :], app.registered_groups[len(groups) :])
                clash = sorted(added & taken)
                for group, (sub, before) in nested.items():  # commands added to an existing group
                    new = _command_names(sub.registered_commands[len(before) :], [])
                    clash += sorted(f"{group} {n}" for n in new & _command_names(before, []))
                    added |= {f"{group} {n}" for n in new}
                if clash:
                    raise PluginLoadError(f"command {clash[0]!r} is already taken")
            except Exception as exc:
                app.registered_commands[:] = commands
                app.registered_groups[:] = groups
                for sub, before in nested.values():
                    sub.registered_commands[:] = before
                if record is not None:
                    record.status = "failed"
                    record.error = f"miles_register_commands: {_one_line(exc)}"
                    record.traceback = traceback.format_exc()
                log.debug("plugin %s failed to register commands", impl.plugin_name, exc_info=True)
                continue
            if record is not None:
                record.commands = sorted(added)

    # -- engine routes -----------------------------------------------------------------------------
    def add_engine_routes(self, *, app: FastAPI, engine: object) -> None:
        """Let every plugin add its routes to an engine server's ``app`` (``miles_engine_routes``), built-ins
        first.

        A plugin whose hook raises, or that adds a route ``app`` already serves (same path and method), is
        recorded as failed (``miles plugins list`` in that environment shows why), its routes are left out
        and the error is logged; the engine serves on. Plugins that failed to load are logged too: their
        routes, if any, are missing.
        """
        from fastapi.routing import APIRoute

        self.load()
        for broken in self._records.values():
            if broken.status == "failed":
                log.warning(
                    "plugin %r (%s %s) failed to load: %s (routes it would add to the engine are missing)",
                    broken.name,
                    broken.distribution,
                    broken.version,
                    broken.error,
                )
        arguments = {"app": app, "engine": engine}
        for impl in self._pm.hook.miles_engine_routes.get_hookimpls():
            record = self._records.get(impl.plugin_name)
            before = list(app.router.routes)
            served = {(r.path, m) for r in before if isinstance(r, APIRoute) for m in r.methods or ()}
            try:
                impl.function(**{k: v for k, v in arguments.items() if k in impl.argnames})
                added = [r for r in app.router.routes[len(before) :] if isinstance(r, APIRoute)]
                clash = sorted(f"{m} {r.path}" for r in added for m in r.methods or () if (r.path, m) in served)
                if clash:
                    raise PluginLoadError(f"route {clash[0]} is already served")
            except Exception as exc:
                app.router.routes[:] = before
                if record is not None:
                    record.status = "failed"
                    record.error = f"miles_engine_routes: {_one_line(exc)}"
                    record.traceback = traceback.format_exc()
                log.error("plugin %s: its engine routes are left out", impl.plugin_name, exc_info=True)

    # -- lifecycle ---------------------------------------------------------------------------------
    def on_run_start(self, *, settings: MilesSettings, run_dir: str) -> None:
        self._pm.hook.miles_on_run_start(settings=settings, run_dir=run_dir)

    def on_rollout_end(self, *, step: int, groups: Sequence[SampleGroup], metrics: Mapping[str, float]) -> None:
        self._pm.hook.miles_on_rollout_end(step=step, groups=groups, metrics=metrics)

    def on_step_end(self, *, step: int, metrics: Mapping[str, float]) -> None:
        self._pm.hook.miles_on_step_end(step=step, metrics=metrics)

    def on_weights_pushed(self, *, step: int, version: str, report: PushReport) -> None:
        self._pm.hook.miles_on_weights_pushed(step=step, version=version, report=report)

    def on_checkpoint_saved(self, *, step: int, path: str) -> None:
        self._pm.hook.miles_on_checkpoint_saved(step=step, path=path)

    def on_run_end(self, *, run_dir: str, status: str, error: str | None) -> None:
        self._pm.hook.miles_on_run_end(run_dir=run_dir, status=status, error=error)
