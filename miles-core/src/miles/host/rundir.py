"""The run directory: a new run never destroys what an earlier one produced.

A directory that already holds a run (metrics, samples, checkpoints, an export, logs) is refused unless the
user says what to do with it: ``--resume`` continues that run (logs are appended, each process start marked),
``--overwrite`` replaces it (only once the settings are known to be good).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from miles.errors import SettingsError

if TYPE_CHECKING:
    from miles.settings.model import MilesSettings

__all__ = [
    "RUN_OUTPUTS",
    "check_run_dir",
    "prepare_run_dir",
    "remove_scratch",
    "rewind_metrics",
    "run_outputs",
    "write_resolved_settings",
]

log = logging.getLogger(__name__)

RUN_OUTPUTS = (
    "metrics.jsonl", "samples", "checkpoints", "hf", "logs", "launch.json", "fleet.json", "settings.json", "tensorboard", "weights",
)  # fmt: skip
"""What a run writes into its directory."""


def run_outputs(run_dir: Path) -> list[str]:
    """The outputs of an earlier run in ``run_dir`` (empty when there are none)."""
    return [name for name in RUN_OUTPUTS if (run_dir / name).exists()]


def check_run_dir(settings: MilesSettings, *, resume: str | None, overwrite: bool) -> list[str]:
    """The earlier run's outputs in ``log.run_dir`` (touches nothing).

    Raises :class:`SettingsError` naming ``log.run_dir`` when it holds a run and neither ``resume`` nor
    ``overwrite`` is given. Cheap: ``miles train`` calls it before resolving any plugin.
    """
    from miles.driver.checkpoint import find_checkpoint
    from miles.settings.loader import sources_of

    run_dir = Path(settings.log.run_dir).resolve()
    found = run_outputs(run_dir)
    if resume is not None:
        find_checkpoint(resume)  # a resume that cannot work is refused now, not after everything has loaded
    if found and resume is None and not overwrite:
        source = sources_of(settings).of("log.run_dir")
        where = f"log.run_dir ({source})" if source else "log.run_dir"
        listed = ", ".join(found)
        try:
            find_checkpoint(run_dir)
            ways = f"pass --resume {settings.log.run_dir} to continue it, --overwrite to replace it"
        except SettingsError:  # nothing to continue from: the run saved no checkpoint
            ways = "it saved no checkpoint to resume from: pass --overwrite to replace it"
        raise SettingsError(f"{where}: {run_dir} already holds a run ({listed}); {ways}, or choose another log.run_dir")
    return found


def rewind_metrics(run_dir: Path, step: int) -> int:
    """A resumed run continues after checkpoint step ``step``: the rows of later steps the earlier run logged
    are dropped from ``metrics.jsonl`` (the resumed run logs those steps again); returns how many."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
    dropped = len([line for line in lines if line.strip()]) - len(kept)
    if dropped:
        scratch = path.with_name(path.name + ".tmp")
        scratch.write_text("".join(kept), encoding="utf-8")
        scratch.replace(path)
    return dropped


def remove_scratch(run_dir: Path) -> None:
    """The weight versions a run's disk transports wrote into ``run_dir/weights`` (scratch, removed by the
    transport at a normal end): gone on every other exit too (Ctrl-C, a failure)."""
    shutil.rmtree(run_dir / "weights", ignore_errors=True)


def prepare_run_dir(settings: MilesSettings, *, resume: str | None, overwrite: bool) -> Path:
    """The run's directory (absolute, created), checked against an earlier run's outputs
    (:func:`check_run_dir`); with ``overwrite`` the earlier outputs are removed here, once the settings
    are known to be good."""
    found = check_run_dir(settings, resume=resume, overwrite=overwrite)
    run_dir = Path(settings.log.run_dir).resolve()
    if found and overwrite and resume is None:
        for name in found:
            path = run_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        log.info("--overwrite: removed the earlier run's %s from %s", ", ".join(found), run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def write_resolved_settings(settings: MilesSettings, path: Path) -> None:
    """The resolved settings every rank reads (JSON: plugin tables keep their extra keys)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings.model_dump(mode="json"), indent=1))
