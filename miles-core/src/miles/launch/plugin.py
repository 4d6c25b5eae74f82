"""The built-in ``launch`` plugin: registers the ``local`` launcher (cheap to import: no httpx, no torch)."""

from __future__ import annotations

from miles.components import Register
from miles.launch.local import LocalLauncher
from miles.markers import hookimpl


@hookimpl
def miles_register_launchers(register: Register) -> None:
    register(LocalLauncher)
