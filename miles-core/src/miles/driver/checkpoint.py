"""Checkpoint layout of a run and the driver's share of it.

``<dir>/step_<N>/trainer/`` holds what the trainer backend saves (sharded model, optimizer, scheduler,
RNG); ``<dir>/step_<N>/driver.json`` holds the driver's position (data source, rollout manager, weight
version, metrics step); ``<dir>/latest`` names the newest complete checkpoint. A checkpoint is complete
only once ``driver.json`` is written, last, so a run killed mid-save resumes from the previous one.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from miles.errors import SettingsError

if TYPE_CHECKING:
    from miles.driver.sources import GroupSource

__all__ = [
    "DriverState",
    "checkpoint_dir",
    "find_checkpoint",
    "prune_checkpoints",
    "read_driver_state",
    "write_driver_state",
]

_FORMAT = 1


@dataclass
class DriverState:
    """Everything besides the trainer that a resumed run needs to continue exactly."""

    step: int
    """Rollouts (and weight pushes) completed."""
    weight_version: str
    data: dict[str, Any] = field(default_factory=dict)
    rollout: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    format: int = _FORMAT

    @classmethod
    def capture(
        cls, step: int, weight_version: str, *, data: Stateful, manager: Stateful | None, source: GroupSource | None
    ) -> DriverState:
        """Rank 0's position after ``step``: the data source's, the rollout manager's and the group source's
        state."""
        return cls(
            step=step,
            weight_version=weight_version,
            data=data.state_dict(),
            rollout=manager.state_dict() if manager is not None else {},
            extra=source.state_dict() if source is not None else {},
        )

    def restore(self, *, data: Stateful, manager: Stateful | None, source: GroupSource | None) -> None:
        """Put rank 0's components back where :meth:`capture` found them."""
        data.load_state_dict(self.data)
        if manager is not None and self.rollout:
            manager.load_state_dict(self.rollout)
        if source is not None:
            source.load_state_dict(self.extra, step=self.step)


class Stateful(Protocol):
    """A component whose position a checkpoint keeps."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def checkpoint_dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def _write_durably(path: Path, text: str) -> None:
    """``path`` holds ``text`` or what it held before, never a part of it, even across a power loss:
    write a temporary file, fsync it, rename it over ``path``, fsync the directory."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_driver_state(path: Path, state: DriverState) -> None:
    """Write ``driver.json`` durably (the checkpoint is complete from then on), then point ``latest`` at
    this checkpoint. Called after the trainer's files are written: a save killed before it (or failing
    on a full disk) leaves ``latest`` on the previous complete checkpoint."""
    path.mkdir(parents=True, exist_ok=True)
    _write_durably(path / "driver.json", json.dumps(asdict(state), indent=1))
    _write_durably(path.parent / "latest", path.name + "\n")


def prune_checkpoints(root: Path, keep: int) -> list[Path]:
    """Remove all but the newest ``keep`` complete checkpoints under ``root`` (never the one ``latest``
    names; incomplete ones are left to the next save's check); returns what went."""
    import shutil

    complete = sorted(p for p in root.glob("step_*") if (p / "driver.json").exists())
    latest = (root / "latest").read_text().strip() if (root / "latest").exists() else None
    removed = [p for p in complete[: max(len(complete) - keep, 0)] if p.name != latest]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def read_driver_state(path: Path) -> DriverState:
    data = json.loads((path / "driver.json").read_text())
    if data.get("format") != _FORMAT:
        raise SettingsError(f"checkpoint {path}: format {data.get('format')!r} is not supported (expected {_FORMAT})")
    return DriverState(**data)


def find_checkpoint(path: str | os.PathLike[str]) -> Path:
    """Resolve ``--resume PATH``: a checkpoint (``step_N``), or a directory of them (its ``latest``), or a
    run directory (its ``checkpoints/latest``)."""
    p = Path(path)
    if (p / "driver.json").exists():
        return p
    for root in (p, p / "checkpoints"):
        latest = root / "latest"
        if latest.exists():
            candidate = root / latest.read_text().strip()
            if (candidate / "driver.json").exists():
                return candidate
    raise SettingsError(f"--resume {path}: no complete checkpoint there (expected driver.json or a 'latest' file)")
