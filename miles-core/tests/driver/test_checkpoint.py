from __future__ import annotations

from pathlib import Path

import pytest

from miles.driver.checkpoint import DriverState, checkpoint_dir, find_checkpoint, read_driver_state, write_driver_state
from miles.errors import SettingsError


def test_driver_state_round_trip_and_latest(tmp_path: Path) -> None:
    root = tmp_path / "run" / "checkpoints"
    first = checkpoint_dir(root, 2)
    write_driver_state(
        first, DriverState(step=2, weight_version="2", data={"epoch": 0, "offset": 8}, rollout={"next_group_id": 8})
    )
    second = checkpoint_dir(root, 4)
    (second / "trainer").mkdir(parents=True)  # trainer files written, driver.json not yet: incomplete
    assert find_checkpoint(root) == first
    assert find_checkpoint(tmp_path / "run") == first
    write_driver_state(second, DriverState(step=4, weight_version="4"))
    assert find_checkpoint(root) == second
    assert find_checkpoint(first) == first
    state = read_driver_state(first)
    assert state.data == {"epoch": 0, "offset": 8} and state.rollout == {"next_group_id": 8}


def test_missing_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="no complete checkpoint"):
        find_checkpoint(tmp_path)
