"""Typed registries: one per kind of component, filled through the registration hooks."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from pydantic import BaseModel

from miles.components import ComponentKind, component_settings_model
from miles.errors import DuplicateComponentError, UnknownComponentError

__all__ = ["Register", "Registration", "Registry"]

T = TypeVar("T")
_NAME = re.compile(r"^[a-z][a-z0-9_.-]*$")


class Register(Protocol):
    """The callback a registration hook receives: ``register(MyTrainer)`` or ``register(obj, name="x")``."""

    def __call__(self, component: Any, *, name: str | None = None) -> None: ...


@dataclass(frozen=True)
class Registration(Generic[T]):
    """One registered component and the plugin it came from."""

    kind: ComponentKind
    name: str
    component: T
    plugin: str
    settings_model: type[BaseModel]

    @property
    def description(self) -> str:
        doc = getattr(self.component, "__doc__", None) or ""
        return doc.strip().splitlines()[0] if doc.strip() else ""


class Registry(Generic[T]):
    """Components of one kind, keyed by name. A name claimed twice names both plugins."""

    def __init__(self, kind: ComponentKind) -> None:
        self.kind = kind
        self._entries: dict[str, Registration[T]] = {}

    def add(self, component: T, *, plugin: str, name: str | None = None) -> Registration[T]:
        resolved = name if name is not None else getattr(component, "name", None)
        if not isinstance(resolved, str) or not _NAME.match(resolved):
            raise ValueError(
                f"plugin {plugin!r} registered a {self.kind.label} with an invalid name {resolved!r} "
                "(expected lower-case letters, digits, '_', '-' or '.', starting with a letter)"
            )
        if resolved in self._entries:
            other = self._entries[resolved].plugin
            raise DuplicateComponentError(
                f"{self.kind.label} {resolved!r} is registered by both plugin {other!r} and plugin {plugin!r}; "
                f"block one of them with MILES_DISABLE_PLUGINS={plugin}"
            )
        entry = Registration(self.kind, resolved, component, plugin, component_settings_model(component))
        self._entries[resolved] = entry
        return entry

    def get(self, name: str, *, field: str | None = None, hint: str = "") -> Registration[T]:
        """The registration for ``name``; ``UnknownComponentError`` lists what is available."""
        try:
            return self._entries[name]
        except KeyError:
            where = f"{field}: " if field else ""
            available = ", ".join(sorted(self._entries)) or "none"
            raise UnknownComponentError(
                f"{where}unknown {self.kind.label} {name!r} (available: {available}){hint}"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[Registration[T]]:
        return iter(sorted(self._entries.values(), key=lambda r: r.name))

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> list[str]:
        return sorted(self._entries)
