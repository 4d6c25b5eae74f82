"""The built-in ``launch`` plugin: registers the ``local`` launcher (cheap to import: no httpx, no torch)."""

from __future__ import annotations

from miles.launch.local import LocalLauncher
from miles.plugins.manager import hookimpl
from miles.plugins.registry import Register


@hookimpl
def miles_register_launchers(register: Register) -> None:
    register(LocalLauncher)
