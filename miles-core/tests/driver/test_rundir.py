"""The run directory: an earlier run is refused with only what will work for it, a resume that cannot work is
refused before anything starts, a resumed run's metrics hold each step once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.driver.checkpoint import DriverState, checkpoint_dir, write_driver_state
from miles.errors import SettingsError
from miles.host.rundir import check_run_dir, rewind_metrics
from miles.settings.model import MilesSettings


def settings_in(run_dir: Path) -> MilesSettings:
    return MilesSettings.model_validate({"log": {"run_dir": str(run_dir)}})


def test_a_run_without_a_checkpoint_is_not_offered_a_resume(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(SettingsError) as info:
        check_run_dir(settings_in(tmp_path), resume=None, overwrite=False)
    message = str(info.value)
    assert "already holds a run (metrics.jsonl)" in message and "saved no checkpoint" in message
    assert "--resume" not in message and "--overwrite" in message
    with pytest.raises(SettingsError, match=r"--resume .*: no complete checkpoint there"):
        check_run_dir(settings_in(tmp_path), resume=str(tmp_path), overwrite=False)


def test_a_run_with_a_checkpoint_is_offered_a_resume(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    step = checkpoint_dir(tmp_path / "checkpoints", 2)
    step.mkdir(parents=True)
    write_driver_state(step, DriverState(step=2, weight_version="2"))
    with pytest.raises(SettingsError, match=f"pass --resume {tmp_path} to continue it, --overwrite to replace it"):
        check_run_dir(settings_in(tmp_path), resume=None, overwrite=False)
    assert check_run_dir(settings_in(tmp_path), resume=str(tmp_path), overwrite=False) == [
        "metrics.jsonl",
        "checkpoints",
    ]


def test_a_resumed_run_logs_each_step_once(tmp_path: Path) -> None:
    rows = [{"step": s, "loss": float(s)} for s in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert rewind_metrics(tmp_path, 2) == 2  # steps 3 and 4 run again after the step-2 checkpoint
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert rewind_metrics(tmp_path, 2) == 0
    assert rewind_metrics(tmp_path / "none", 2) == 0
