"""The built-in ``launch`` plugin: registers the ``local`` and ``ray`` launchers (cheap to import: no httpx, no
torch, no ray — the ``ray`` launcher imports it when it runs)."""

from __future__ import annotations

from miles.components import Register
from miles.launch.local import LocalLauncher
from miles.launch.ray_launcher import RayLauncher
from miles.markers import hookimpl


@hookimpl
def miles_register_launchers(register: Register) -> None:
    register(LocalLauncher)
    register(RayLauncher)
