"""Where an engine may read weights from: the served model's directory and ``--allowed-weight-dirs``.

``/update_weights_from_disk`` and ``/update_weights_from_delta`` take a path from the request body and
read every file under it. An engine reachable by anyone who can open a loopback socket must not load
whatever directory a caller names, so each path is resolved (symbolic links and ``..`` followed) and must
lie inside one of the allowed directories. ``miles train`` allows the run's directory and the transport's
``dir``; a standalone ``miles serve`` allows its model directory plus what ``--allowed-weight-dirs`` lists.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["WeightDirs", "parse_weight_dirs"]


def parse_weight_dirs(value: str | None) -> list[Path]:
    """The directories of an ``--allowed-weight-dirs`` value (separated by ``os.pathsep``; empty parts skipped)."""
    if not value:
        return []
    return [Path(part).expanduser() for part in value.split(os.pathsep) if part.strip()]


class WeightDirs:
    """The resolved directories an engine may load weights from."""

    def __init__(self, dirs: Iterable[str | Path]) -> None:
        self.dirs = tuple(dict.fromkeys(Path(os.path.realpath(d)) for d in dirs))

    def check(self, path: str, *, field: str) -> Path:
        """``path`` resolved, if it lies inside an allowed directory; otherwise :class:`PermissionError` naming
        ``field``, the path and the allowed directories."""
        resolved = Path(os.path.realpath(path))
        for allowed in self.dirs:
            if resolved == allowed or resolved.is_relative_to(allowed):
                return resolved
        listed = ", ".join(str(d) for d in self.dirs) or "none"
        raise PermissionError(
            f"{field}: {path!r} is outside the directories this engine may load weights from ({listed}); "
            "start the engine with --allowed-weight-dirs to allow it"
        )
