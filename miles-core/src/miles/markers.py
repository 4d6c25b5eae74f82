"""The two markers of the plugin contract (as pytest, tox and llm keep them: tiny, at the bottom).

``hookimpl`` marks a plugin's implementation of a hook (``@miles.hookimpl``); ``hookspec`` marks a
specification in :mod:`miles.hookspecs`. Importing this module imports only pluggy.
"""

from __future__ import annotations

import pluggy

__all__ = ["PROJECT", "hookimpl", "hookspec"]

PROJECT = "miles"
"""pluggy's project name: the marker attribute both markers set."""

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
