"""The plugin conformance kit: checks a plugin author runs from their own tests.

Each check exercises the plugin through the real :class:`~miles.plugins.PluginManager` and the real
component interfaces, and raises :class:`AssertionError` with a message that names the plugin, the
component and what is wrong. This module checks a plugin as a whole; :mod:`miles.testing.component_checks`
checks one component against its kind's interface. Import both from :mod:`miles.testing`::

    from miles.testing import check_plugin, check_reward
    import miles_my_reward.plugin as plugin

    def test_conforms():
        (entry,) = check_plugin(plugin, name="my_reward")
        check_reward(entry.component)

:func:`check_plugin` checks the plugin as a whole (hooks, names, settings models),
:func:`check_entry_point` the installed distribution, :func:`check_light_import` the cost of importing
the plugin module.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.metadata
import inspect
import json
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic_core import PydanticUndefined

from miles import hookspecs
from miles.components import ComponentKind
from miles.errors import MilesError
from miles.plugins.builtin import BUILTIN_PLUGINS
from miles.plugins.manager import ENTRY_POINT_GROUP, PluginManager, PluginRecord

if TYPE_CHECKING:
    from miles.plugins.registry import Registration

__all__ = [
    "check_component",
    "check_entry_point",
    "check_light_import",
    "check_plugin",
    "check_settings_model",
]

T = TypeVar("T")

"""The base class each kind of component derives from (rollout functions are plain callables)."""


def failure(where: str, what: str) -> AssertionError:
    """The error every check raises: ``<where>: <what>``."""
    return AssertionError(f"{where}: {what}")


def describe(kind: ComponentKind, component: Any) -> str:
    """``reward 'keyword' (KeywordReward)``: how messages name a component."""
    name = getattr(component, "name", None)
    label = getattr(component, "__qualname__", None) or type(component).__qualname__
    return f"{kind.label} {name!r} ({label})" if name else f"{kind.label} {label}"


def run_coroutine(factory: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine to completion, also when the caller is already inside an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(factory())  # type: ignore[arg-type]
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(asyncio.run(factory()))  # type: ignore[arg-type]
        except BaseException as exc:  # re-raised in the caller's thread
            error.append(exc)

    thread = threading.Thread(target=target, name="miles-conformance")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


# -- the plugin as a whole ---------------------------------------------------------------------------


def _undecorated_hooks(plugin: object) -> list[str]:
    """Functions named like a hook that pluggy will ignore because they lack ``@miles.hookimpl``."""
    known = {n for n in dir(hookspecs) if n.startswith("miles_")}
    found = []
    for attr in dir(plugin):
        if not attr.startswith("miles_"):
            continue
        value = getattr(plugin, attr, None)
        if not callable(value) or hasattr(value, "miles_impl"):
            continue
        if attr in known or attr.startswith(("miles_register_", "miles_on_")):
            found.append(attr)
    return sorted(found)


def _bad_hook_arguments(plugin: object) -> list[str]:
    """Hook implementations that ask for arguments their hook specification does not provide."""
    problems = []
    for attr in dir(plugin):
        value = getattr(plugin, attr, None)
        spec = getattr(hookspecs, attr, None)
        if not attr.startswith("miles_") or not callable(value) or not hasattr(value, "miles_impl") or spec is None:
            continue
        provided = list(inspect.signature(spec).parameters)
        wanted = [
            p.name
            for p in inspect.signature(value).parameters.values()
            if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        unknown = [w for w in wanted if w not in provided]
        if unknown:
            problems.append(
                f"{attr} asks for argument(s) {', '.join(unknown)} that the hook does not provide "
                f"(it provides: {', '.join(provided)})"
            )
    return problems


def _registrations(manager: PluginManager, plugin_name: str) -> list[Registration[Any]]:
    out = []
    for kind in ComponentKind:
        out += [entry for entry in manager.registry(kind) if entry.plugin == plugin_name]
    return out


def check_plugin(
    plugin: object,
    *,
    name: str,
    builtins: Sequence[tuple[str, str]] | None = None,
    expect: Iterable[tuple[str, str]] | None = None,
) -> list[Registration[Any]]:
    """Check that ``plugin`` (a module or object with hook implementations) is a well-formed plugin.

    It is registered as ``name`` in a fresh :class:`~miles.plugins.PluginManager` next to the built-in
    plugins (so a name that collides with a built-in is caught), without entry points. Checked:
    every ``miles_*`` hook it implements exists and is decorated with ``@miles.hookimpl``; it implements at
    least one hook; its registration hooks run without error, register valid, unique names, and register
    the same components every time they are called; each registered class derives from its kind's base
    class, implements every abstract method and has a docstring; each settings model passes
    :func:`check_settings_model`.

    :param plugin: the plugin module or object.
    :param name: the plugin name (the entry-point name it is published under).
    :param builtins: the built-in plugins to load next to it (default: every built-in except ``plugin``).
    :param expect: ``(kind, name)`` pairs the plugin must register, e.g. ``[("reward", "keyword")]``.
    :returns: the plugin's registrations (kind, name, component, settings model).
    """
    where = f"plugin {name!r}"
    undecorated = _undecorated_hooks(plugin)
    if undecorated:
        raise failure(where, f"{', '.join(undecorated)} not decorated with @miles.hookimpl (pluggy ignores it)")
    bad_arguments = _bad_hook_arguments(plugin)
    if bad_arguments:
        raise failure(where, "; ".join(bad_arguments))
    if builtins is None:
        module_name = getattr(plugin, "__name__", None)
        builtins = [(n, m) for n, m in BUILTIN_PLUGINS if m != module_name and n != name]
    manager = PluginManager(builtins=builtins, entry_points=False, disabled=(), only=())
    try:
        manager.register(plugin, name)
    except MilesError as exc:
        raise failure(where, f"does not load: {str(exc).removeprefix(f'{where}: ')}") from exc
    record = next(r for r in manager.records() if r.name == name)
    if record.status != "ok":
        detail = f"\n{record.traceback}" if record.traceback else ""
        raise failure(where, f"status {record.status}: {record.error}{detail}")
    if not record.hooks:
        raise failure(where, "implements no Miles hook (expected functions decorated with @miles.hookimpl)")
    entries = _registrations(manager, name)

    again = PluginManager(builtins=builtins, entry_points=False, disabled=(), only=())
    again.register(plugin, name)
    first = sorted((e.kind.value, e.name) for e in entries)
    second = sorted((e.kind.value, e.name) for e in _registrations(again, name))
    again.unregister(name)
    again.register(plugin, name)
    second_again = sorted((e.kind.value, e.name) for e in _registrations(again, name))
    if not (first == second == second_again):
        raise failure(where, "registration hooks register different components on each call; they must be pure")

    for entry in entries:
        check_component(entry.kind, entry.component, plugin=name)
    if expect is not None:
        have = {(e.kind.value, e.name) for e in entries}
        missing = sorted({(ComponentKind(k).value, n) for k, n in expect} - have)
        if missing:
            listed = ", ".join(f"{k} {n!r}" for k, n in missing)
            got = ", ".join(f"{k} {n!r}" for k, n in sorted(have)) or "nothing"
            raise failure(where, f"does not register {listed} (registers {got})")
    return entries


def check_component(kind: ComponentKind | str, component: Any, *, plugin: str = "?") -> None:
    """Check one registered component: base class, abstract methods, docstring, settings model."""
    kind = ComponentKind(kind)
    where = f"plugin {plugin!r}, {describe(kind, component)}"
    if kind.interface:
        module, _, attr = kind.interface.partition(":")
        base = getattr(importlib.import_module(module), attr)
        if not (isinstance(component, type) and issubclass(component, base)):
            raise failure(where, f"must be a class deriving from {module}.{attr}, got {component!r}")
        if inspect.isabstract(component):
            missing = ", ".join(sorted(getattr(component, "__abstractmethods__", ())))
            raise failure(where, f"does not implement the abstract method(s) {missing}")
    elif not callable(component):
        raise failure(where, f"must be callable, got {component!r}")
    if not (getattr(component, "__doc__", None) or "").strip():
        raise failure(where, "has no docstring (its first line is the description in `miles plugins list`)")
    check_settings_model(getattr(component, "Settings", None) or _default_settings(), where=where)


def _default_settings() -> type[BaseModel]:
    from miles.components import ComponentSettings

    return ComponentSettings


def check_settings_model(model: Any, *, where: str = "settings") -> None:
    """Check a component's ``Settings``: a pydantic model that rejects unknown keys, every field has a
    description (an attribute docstring with ``use_attribute_docstrings``, or ``Field(description=...)``),
    and every default validates against its field's type and constraints."""
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise failure(where, f"Settings must be a pydantic BaseModel subclass, got {model!r}")
    qual = f"{where}: Settings {model.__qualname__}"
    if model.model_config.get("extra") != "forbid":
        raise AssertionError(
            f"{qual} accepts unknown keys (a typo would pass silently); derive it from "
            "miles.components.ComponentSettings or set extra='forbid'"
        )
    for field_name, info in model.model_fields.items():
        if not (info.description or "").strip():
            raise AssertionError(
                f"{qual}: field {field_name!r} has no docstring (it is the field's documentation and CLI help)"
            )
        if info.is_required():
            continue
        default = info.default_factory() if info.default_factory is not None else info.default  # type: ignore[call-arg]
        if default is PydanticUndefined:
            continue
        annotation: Any = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
        try:
            TypeAdapter(annotation).validate_python(default, strict=False)
        except ValidationError as exc:
            first = exc.errors()[0]["msg"]
            raise AssertionError(
                f"{qual}: default of field {field_name!r} ({default!r}) does not validate: {first}"
            ) from None


def component_settings(kind: ComponentKind, cls: Any, settings: BaseModel | Mapping[str, Any] | None) -> BaseModel:
    """Validated settings for ``cls``: ``settings`` as given, or its settings model's defaults."""
    where = describe(kind, cls)
    model = getattr(cls, "Settings", None) or _default_settings()
    check_settings_model(model, where=where)
    if isinstance(settings, BaseModel):
        if not isinstance(settings, model):
            raise failure(where, f"settings must be a {model.__qualname__}, got {type(settings).__qualname__}")
        return settings
    try:
        return model.model_validate(dict(settings or {}))
    except ValidationError as exc:
        hint = "" if settings else " (pass settings= for fields without a default)"
        raise failure(
            where, f"settings do not validate{hint}: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}"
        ) from None


# -- entry points ------------------------------------------------------------------------------------


def check_entry_point(name: str, *, distribution: str | None = None) -> PluginRecord:
    """Check that an installed distribution exposes plugin ``name`` in the ``miles.plugins`` entry-point
    group and that the real plugin manager loads it with status ``ok`` (then :func:`check_plugin` on it).

    :param name: the entry-point (plugin) name.
    :param distribution: the distribution that must provide it (e.g. ``miles-reward-example``).
    :returns: the manager's record (distribution, version, what it registers, hooks).
    """
    where = f"entry point {name!r} (group {ENTRY_POINT_GROUP!r})"
    found = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not found:
        raise failure(where, "not installed; is the distribution installed (pip install -e .) and is the name right?")
    dists = sorted({ep.dist.metadata["Name"] for ep in found if ep.dist is not None})
    if distribution is not None and distribution not in dists:
        raise failure(where, f"provided by {', '.join(dists) or '?'}, expected distribution {distribution!r}")
    manager = PluginManager(entry_points=True, disabled=(), only=(name,))
    record = next((r for r in manager.records() if r.name == name), None)
    if record is None:
        raise failure(where, "the plugin manager did not see it")
    if record.status != "ok":
        detail = f"\n{record.traceback}" if record.traceback else ""
        raise failure(where, f"loads with status {record.status}: {record.error}{detail}")
    if record.builtin:
        raise failure(where, "has the name of a built-in plugin")
    check_plugin(found[0].load(), name=name)
    return record


def check_light_import(module: str, *, forbidden: Sequence[str] = ("torch", "transformers")) -> None:
    """Check, in a fresh interpreter, that importing the plugin module ``module`` does not import any of
    ``forbidden``: ``miles plugins list`` imports every plugin, so entry modules must be cheap."""
    code = (
        "import importlib, json, sys\n"
        f"importlib.import_module({module!r})\n"
        f"print(json.dumps(sorted(m for m in {list(forbidden)!r} if m in sys.modules)))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode != 0:
        raise AssertionError(f"plugin module {module!r}: import fails:\n{proc.stderr.strip()}")
    heavy = json.loads(proc.stdout.strip().splitlines()[-1])
    if heavy:
        raise AssertionError(
            f"plugin module {module!r}: importing it imports {', '.join(heavy)}; import heavy modules inside the "
            "functions that use them"
        )
