"""What :mod:`miles.testing.runs` reads of the host: torch's shared-memory files a finished run left."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from miles.testing.runs import leaked_torch_segments, torch_segments


def test_a_leak_is_a_new_file_of_an_exited_process_not_of_a_live_one() -> None:
    before = torch_segments()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    files = [Path(f"/dev/shm/torch_{dead_pid}_7_0"), Path(f"/dev/shm/torch_{os.getpid()}_7_0")]
    try:
        for f in files:
            f.write_bytes(b"x")
        assert leaked_torch_segments(before) == [files[0].name]  # the live process's file is still in use
        assert leaked_torch_segments(before | {files[0].name}) == []
    finally:
        for f in files:
            f.unlink(missing_ok=True)
