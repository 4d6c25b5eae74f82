"""The version folders of the transports that write weights to a shared directory (``disk``,
``disk_delta``): the root is created by rank 0 at connect, and at close the folders this run wrote are
removed (unless ``keep_after_run``), then the root when nothing else is in it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles.rollout.client import EngineClient
    from miles.training.trainer import DistContext

__all__ = ["VersionFolders"]


class VersionFolders:
    """Mixin of a transport with ``root`` (where versions go), ``written`` (the folders this run wrote, oldest
    first) and a ``keep_after_run`` setting."""

    root: Path
    written: list[Path]
    client: EngineClient | None
    settings: Any

    async def connect(self, client: EngineClient | None, dist: DistContext) -> None:
        self.client = client
        if dist.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)

    async def close(self) -> None:
        """Remove the versions this run wrote (unless ``keep_after_run``), and the folder when it is empty."""
        if self.settings.keep_after_run:
            return
        for path in self.written:
            shutil.rmtree(path, ignore_errors=True)
        self.written = []
        try:
            self.root.rmdir()
        except OSError:
            pass  # not ours alone, or already gone
