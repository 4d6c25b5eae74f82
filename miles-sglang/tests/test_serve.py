"""``miles_sglang.serve``'s /dev/shm segments: SGLang's CPU kernels leave a 270 MB all-reduce segment per
server in /dev/shm; servers started through Miles name theirs after their own PID, and each start removes
those of servers that are gone, at exit its own (real files, a real dead process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from miles_sglang.serve import SEGMENT_ADDR, SEGMENT_PREFIX, sweep_segments


def segment(root: Path, pid: int, rank: int = 0, addr: str = SEGMENT_ADDR) -> Path:
    path = root / f"{SEGMENT_PREFIX}_{os.getuid()}_{addr}_{pid}_{rank}"
    path.write_bytes(b"\0" * 64)
    return path


def test_a_start_removes_the_segments_of_servers_that_are_gone_and_exit_removes_its_own(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a server killed with SIGKILL: its segments stay behind
    dead = [segment(tmp_path, gone.pid, rank) for rank in (0, 1)]
    mine = segment(tmp_path, os.getpid())
    other = segment(tmp_path, gone.pid, addr="127.0.0.1")  # not started by Miles: not ours to remove
    assert sorted(sweep_segments(tmp_path)) == sorted(dead)
    assert mine.exists() and other.exists() and not any(p.exists() for p in dead)
    assert sweep_segments(tmp_path, own=True) == [mine] and other.exists()
