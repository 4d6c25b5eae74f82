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


_SAVE = """
import os, resource, signal, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
from miles.driver.checkpoint import DriverState, checkpoint_dir, write_driver_state

root, how = Path(sys.argv[1]), sys.argv[2]
first = checkpoint_dir(root, 1)
(first / "trainer").mkdir(parents=True)
save_file({"w": torch.ones(4)}, str(first / "trainer" / "model.safetensors"))
write_driver_state(first, DriverState(step=1, weight_version="1"))
second = checkpoint_dir(root, 2)
(second / "trainer").mkdir(parents=True)
if how == "disk-full":  # the OS refuses writes past 64 KiB, as a full disk would
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
with open(second / "trainer" / "model.safetensors", "wb") as f:
    f.write(b"x" * 32768)
    f.flush()
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)  # killed in the middle of the trainer's files
    f.write(b"x" * (1 << 20))  # the disk is full: OSError, the save fails
write_driver_state(second, DriverState(step=2, weight_version="2"))
"""


@pytest.mark.parametrize("how", ["kill", "disk-full"])
def test_an_interrupted_save_never_replaces_the_last_good_checkpoint(tmp_path: Path, how: str) -> None:
    import subprocess
    import sys

    root = tmp_path / "checkpoints"
    out = subprocess.run([sys.executable, "-c", _SAVE, str(root), how], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    if how == "kill":
        assert out.returncode == -9
    else:
        assert "File too large" in out.stderr or "No space" in out.stderr, out.stderr
    assert (root / "latest").read_text() == "step_000001\n"
    assert find_checkpoint(root) == checkpoint_dir(root, 1)
    assert read_driver_state(checkpoint_dir(root, 1)).step == 1
    assert not (checkpoint_dir(root, 2) / "driver.json").exists()
    assert not list(root.glob("*.tmp")) and not list(checkpoint_dir(root, 1).glob("*.tmp"))


def test_keep_last_removes_older_complete_checkpoints_only(tmp_path: Path) -> None:
    from miles.driver.checkpoint import prune_checkpoints

    root = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8):
        write_driver_state(checkpoint_dir(root, step), DriverState(step=step, weight_version=str(step)))
    (checkpoint_dir(root, 10) / "trainer").mkdir(parents=True)  # a save in progress: no driver.json yet
    removed = prune_checkpoints(root, 2)
    assert [p.name for p in removed] == ["step_000002", "step_000004"]
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000006", "step_000008", "step_000010"]
    assert find_checkpoint(root).name == "step_000008"
