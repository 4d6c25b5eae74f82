"""``python -m miles_sglang.serve FLAGS``: ``python -m sglang.launch_server FLAGS`` with the run's keys.

The keys come from the environment (:data:`~miles.auth.API_KEY_ENV`, :data:`~miles.auth.ADMIN_API_KEY_ENV`)
and become SGLang's ``--api-key`` / ``--admin-api-key`` inside this process, so they are on no command line
that ``/proc`` or a launcher's log would show. SGLang 0.5.23 logs its resolved arguments, keys included, at
start: every log record of this process has the keys' values redacted. (SGLang also reports them in
``/server_info``, which its API key opens; Miles' engine client drops them from what it reads.)

On a CPU, SGLang's kernels create a 270 MB ``/dev/shm`` segment per TP rank for their all-reduce
(``deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>``) and never remove it: every server
stopped left one behind (13 GB after a day of tests here). This process names them after itself
(``MASTER_ADDR = miles``, ``MASTER_PORT`` = its PID; SGLang only sets them when unset, and only names the
segments with them) and at start removes those of servers whose process is gone (:func:`sweep_segments`); it
tries to remove its own at exit too, which SGLang's shutdown does not always let it (a stopped server's
segment then goes at the next start), and a server killed with SIGKILL cannot.
"""

from __future__ import annotations

import atexit
import logging
import os
import runpy
import signal
import sys
from pathlib import Path
from typing import Any

from miles.auth import ADMIN_API_KEY_ENV, API_KEY_ENV, ServiceKeys

__all__ = ["SEGMENT_PREFIX", "key_argv", "keyed_launch", "main", "sweep_segments"]

LAUNCH_MODULE = "sglang.launch_server"

SEGMENT_PREFIX = "deepspeed_allreduce_buffer"
"""What SGLang's CPU kernels (``shm.cpp``) name their all-reduce segments in ``/dev/shm``."""
SEGMENT_ADDR = "miles"
"""The ``MASTER_ADDR`` this process gives SGLang: the segments' names then carry ``miles`` and its PID."""


def _segments(root: Path, pid: int | None = None) -> list[Path]:
    """This user's segments named by a Miles-started server (``pid``'s, or every one)."""
    pattern = f"{SEGMENT_PREFIX}_{os.getuid()}_{SEGMENT_ADDR}_{'*' if pid is None else pid}_*"
    return sorted(root.glob(pattern))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_segments(root: Path = Path("/dev/shm"), *, own: bool = False) -> list[Path]:
    """Remove the all-reduce segments of Miles-started SGLang servers whose process is gone (``own``: this
    process's too, at its exit). Returns what was removed."""
    removed = []
    for path in _segments(root):
        try:
            pid = int(path.name[len(f"{SEGMENT_PREFIX}_{os.getuid()}_{SEGMENT_ADDR}_") :].split("_", 1)[0])
        except ValueError:
            continue
        if (own and pid == os.getpid()) or not _alive(pid):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def key_argv(keys: ServiceKeys) -> list[str]:
    """SGLang's flags for ``keys``: ``--api-key`` (every route; the ``NORMAL`` ones only with an admin key) and
    ``--admin-api-key`` (its ``ADMIN_OPTIONAL`` control routes)."""
    flags = [f"--api-key={keys.api_key}"] if keys.api_key else []  # one argument: a key may start with "-"
    return flags + ([f"--admin-api-key={keys.admin_api_key}"] if keys.admin_api_key else [])


def keyed_launch(argv: list[str]) -> list[str]:
    """``argv`` (``python -m sglang.launch_server ...``, :func:`miles_sglang.command.launch_argv`) started
    through this module, which adds the keys from its environment."""
    out = list(argv)
    for i in range(len(out) - 1):
        if out[i] == "-m" and out[i + 1] == LAUNCH_MODULE:
            out[i + 1] = __name__
            return out
    raise ValueError(f"not an SGLang launch command: {argv[:4]}")


def _redact_records(secrets: list[str]) -> None:
    """Every log record created in this process shows ``<redacted>`` for each of ``secrets``."""
    make = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a record that cannot format is left to its handler
            return record
        if any(s in message for s in secrets):
            for s in secrets:
                message = message.replace(s, "<redacted>")
            record.msg, record.args = message, None
        return record

    logging.setLogRecordFactory(factory)


def main() -> None:
    keys = ServiceKeys.from_env()
    for name in (API_KEY_ENV, ADMIN_API_KEY_ENV):  # SGLang's own processes get them from its arguments
        os.environ.pop(name, None)
    if keys.enabled:
        _redact_records(keys.secrets())
    sys.argv = [LAUNCH_MODULE, *sys.argv[1:], *key_argv(keys)]
    if "MASTER_ADDR" not in os.environ and "MASTER_PORT" not in os.environ:
        os.environ.update(MASTER_ADDR=SEGMENT_ADDR, MASTER_PORT=str(os.getpid()))
        sweep_segments()
        atexit.register(sweep_segments, own=True)
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    runpy.run_module(LAUNCH_MODULE, run_name="__main__", alter_sys=True)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM (a launcher stopping the server): exit through ``atexit``, which removes the segments."""
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    main()
