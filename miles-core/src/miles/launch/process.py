"""One child process on this host, in its own session, with its output in a log file.

Liveness is checked with ``waitid(..., WNOWAIT)``: an exited child stays a zombie, so its process-group
id cannot be reused, until :meth:`LocalProcess.reap` has swept the group (killing anything the child
left behind) and collected the exit status. Signals go to the child's process group, never to a name.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from abc import abstractmethod
from collections.abc import Callable

from miles.auth import redact_argv
from miles.launch.base import ProcessHandle, ProcessSpec

__all__ = ["LocalProcess", "SupervisedProcess", "describe_exit"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def describe_exit(code: int) -> str:
    """``exit code 3`` or ``killed by SIGKILL``."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _die_with_parent_hook() -> Callable[[], None] | None:
    """A ``preexec_fn`` that sets ``PR_SET_PDEATHSIG`` to SIGKILL (Linux); ``None`` elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


class SupervisedProcess(ProcessHandle):
    """A process a launcher signals and reaps: a child of this host (:class:`LocalProcess`) or one owned by
    an actor elsewhere (the ``ray`` launcher's)."""

    spec: ProcessSpec
    """What was started (a restart starts it again)."""
    pid: int
    """Process id (on the machine it runs on)."""
    log_path: str
    """Its log file (``<run_dir>/logs/<name>.log``)."""
    started_at: float
    """``time.monotonic()`` when it was started."""

    @property
    @abstractmethod
    def reaped(self) -> bool:
        """Whether the exit status has been collected (the pid is gone)."""

    @abstractmethod
    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the process group (while it is not reaped)."""

    @abstractmethod
    def reap(self, timeout: float | None = None) -> int | None:
        """Wait up to ``timeout`` for it; once it exited, kill what is left of its group and reap it.

        Returns the exit code, or ``None`` when it still runs after ``timeout``."""


class LocalProcess(SupervisedProcess):
    """A started child: ``Popen`` with ``start_new_session=True``, stdout and stderr to ``log_path``."""

    def __init__(self, spec: ProcessSpec, log_dir: str, *, die_with_parent: bool = True) -> None:
        """:param die_with_parent: on Linux, the kernel sends the child SIGKILL when this process dies
        without a shutdown (``kill -9``, a crash): ``PR_SET_PDEATHSIG``. It fires when the *thread*
        that started the child ends, so start children from a long-lived thread (the main one)."""
        if not _SAFE_NAME.match(spec.name):
            raise ValueError(
                f"process name {spec.name!r} must be letters, digits, '_', '-' or '.' (it names a log file)"
            )
        if not spec.argv:
            raise ValueError(f"process {spec.name!r}: empty argv")
        self.name = spec.name
        self.spec = spec
        self.log_path = os.path.join(log_dir, f"{spec.name}.log")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
        with open(self.log_path, "ab") as log_file:
            # a log reused by a resumed run keeps the earlier lines; this start is marked, and only its own
            # lines are shown when it fails (log_tail)
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            log_file.write(f"==== miles: {self.name} started {stamp}: {' '.join(redact_argv(spec.argv))}\n".encode())
            log_file.flush()
            self.log_start = log_file.tell()
            """Offset in the log file where this start's output begins."""
            self.popen = subprocess.Popen(
                spec.argv,
                env=env,
                cwd=spec.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent_hook() if die_with_parent else None,
            )
        self.pid = self.popen.pid
        """Process id; also the id of its process group and session."""
        self.started_at = time.monotonic()
        log.info(
            "started %s (pid %d): %s; log %s", self.name, self.pid, " ".join(redact_argv(spec.argv)), self.log_path
        )

    @property
    def reaped(self) -> bool:
        """Whether the exit status has been collected (the pid is gone)."""
        return self.popen.returncode is not None

    def exit_status(self) -> int | None:
        if self.popen.returncode is not None:
            return self.popen.returncode
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped elsewhere (should not happen): ask Popen
            return self.popen.poll()
        if info is None or info.si_pid == 0:
            return None
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the child's process group (while the child is not reaped)."""
        if self.reaped:
            return
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass

    def reap(self, timeout: float | None = None) -> int | None:
        """Wait up to ``timeout`` for the child; once it exited, kill what is left of its group and reap it.

        Returns the exit code, or ``None`` when the child still runs after ``timeout``.
        """
        if self.reaped:
            return self.popen.returncode
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.exit_status() is None:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(0.02)
        self.signal_group(signal.SIGKILL)  # stragglers of the group; the zombie leader still holds its id
        code = self.popen.wait()
        log.info("%s (pid %d) ended: %s", self.name, self.pid, describe_exit(code))
        return code

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                size = fh.tell()
                fh.seek(max(self.log_start, size - 256 * lines))
                data = fh.read()
        except OSError as exc:
            return f"(log {self.log_path} unreadable: {exc})"
        text = data.decode("utf-8", errors="replace").splitlines()
        return "\n".join(text[-lines:])
