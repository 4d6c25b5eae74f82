"""Plugin plumbing: the manager, the typed registries and the list of built-ins."""

from miles.plugins.manager import ENTRY_POINT_GROUP, PluginManager, PluginRecord, hookimpl
from miles.plugins.registry import Register, Registration, Registry

__all__ = ["ENTRY_POINT_GROUP", "PluginManager", "PluginRecord", "Register", "Registration", "Registry", "hookimpl"]
