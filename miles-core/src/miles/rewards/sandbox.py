"""A sandbox for model-written code: a subprocess with time, memory, file-size and open-file limits and no
network, killed on timeout.

Limits are POSIX resource limits set in the child before it runs the code (``RLIMIT_AS`` for memory,
``RLIMIT_CPU``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, ``RLIMIT_CORE`` = 0); the wall-clock timeout kills the
child's whole process group with ``SIGKILL``. The network is an empty network namespace
(``unshare(CLONE_NEWNET)``: no interface but a loopback that is down, so even ``127.0.0.1`` of the host is
unreachable), made as root or, without root, inside a new user namespace; where neither is allowed
:func:`run_python` refuses to run (:class:`SandboxError`) unless ``network = true``. The code runs in a fresh
temporary directory (removed afterwards) with an almost empty environment and ``python -I`` (no user site,
no ``PYTHON*`` variables).

Every way the code can fail — a timeout, a memory or file limit, a crash, an exit code — comes back as a
:class:`SandboxResult` with a one-line :attr:`~SandboxResult.reason`; :meth:`SandboxResult.check` raises it as
a :class:`SandboxError`, which a reward turns into a failed sample with that reason (never a crashed run).

This is process isolation for an RL run's own samples, not a security boundary against a determined
attacker (the code runs as the run's user, with its file system).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import math
import os
import resource
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["SandboxError", "SandboxLimits", "SandboxResult", "run_command", "run_python"]

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000


class SandboxError(RuntimeError):
    """Sandboxed code failed (timed out, hit a limit, crashed), or the sandbox could not be made."""


class SandboxLimits(BaseModel):
    """Limits of one sandboxed run (a table of the settings that use it: ``[reward.functions] sandbox = {...}``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    timeout: float = Field(10.0, gt=0.0)
    """Wall-clock seconds before the process group is killed (``SIGKILL``)."""
    cpu_seconds: int | None = Field(None, ge=1)
    """CPU seconds (``RLIMIT_CPU``; default: the timeout rounded up, plus one)."""
    memory_mb: int = Field(512, ge=16)
    """Address space in MiB (``RLIMIT_AS``): an allocation beyond it fails (Python raises ``MemoryError``)."""
    file_size_mb: int = Field(16, ge=0)
    """Largest file the code may write, in MiB (``RLIMIT_FSIZE``: a larger write fails with ``EFBIG``, or kills a
    program that does not ignore ``SIGXFSZ``; Python ignores it)."""
    open_files: int = Field(64, ge=8)
    """Open file descriptors (``RLIMIT_NOFILE``)."""
    output_kb: int = Field(64, ge=1)
    """Kept of stdout and of stderr each, in KiB (the rest is read and dropped)."""
    network: bool = False
    """Let the code use the network (``false``: an empty network namespace)."""


@dataclass
class SandboxResult:
    """What a sandboxed run did."""

    returncode: int | None
    """Exit code (negative: killed by that signal; ``None``: never started)."""
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool = False
    reason: str = ""
    """Empty when the code exited with 0; else why it failed, in one line."""

    @property
    def ok(self) -> bool:
        return not self.reason

    def check(self) -> SandboxResult:
        """This result, or :class:`SandboxError` with the reason when the code failed."""
        if self.reason:
            raise SandboxError(self.reason)
        return self


@functools.cache
def _libc_unshare() -> Callable[[int], int]:
    """libc's ``unshare``, looked up in the parent (the forked child only calls it)."""
    function: Callable[[int], int] = ctypes.CDLL(None, use_errno=True).unshare
    return function


def _child_setup(limits: SandboxLimits, unshare: Callable[[int], int]) -> None:  # pragma: no cover - in the child
    """In the child, before exec: own process group, the limits, and an empty network namespace."""
    os.setpgid(0, 0)
    if not limits.network and unshare(CLONE_NEWNET) != 0 and unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        os.write(2, b"miles-sandbox: cannot make a network namespace\n")
        os._exit(97)
    cpu = limits.cpu_seconds or math.ceil(limits.timeout) + 1
    memory = limits.memory_mb << 20
    for what, value in (
        (resource.RLIMIT_CPU, cpu),
        (resource.RLIMIT_AS, memory),
        (resource.RLIMIT_FSIZE, limits.file_size_mb << 20),
        (resource.RLIMIT_NOFILE, limits.open_files),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(what, (value, value))


async def _read_capped(stream: asyncio.StreamReader | None, limit: int) -> bytes:
    """Everything of ``stream`` read, the first ``limit`` bytes kept."""
    if stream is None:
        return b""
    kept = bytearray()
    while chunk := await stream.read(65536):
        if len(kept) < limit:
            kept += chunk[: limit - len(kept)]
    return bytes(kept)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _reason(code: int, stderr: str, limits: SandboxLimits) -> str:
    if code == 0:
        return ""
    if code == 97 and "cannot make a network namespace" in stderr:
        return "the sandbox could not make a network namespace (needs root or user namespaces; or allow network)"
    last = next((line.strip() for line in reversed(stderr.splitlines()) if line.strip()), "")
    if code < 0:
        name = _signal_name(-code)
        why = {
            "SIGXCPU": f"CPU time limit ({limits.cpu_seconds or math.ceil(limits.timeout) + 1} s)",
            "SIGXFSZ": f"file size limit ({limits.file_size_mb} MiB)",
        }.get(name, "")
        return f"killed by {name}" + (f": {why}" if why else "") + (f" ({last[:200]})" if last and not why else "")
    if "MemoryError" in last or "MemoryError" in stderr[-2000:]:
        return f"exit {code}: MemoryError (memory limit {limits.memory_mb} MiB)"
    if "File too large" in last:  # (Python ignores SIGXFSZ: the write fails with EFBIG instead)
        return f"exit {code}: file size limit ({limits.file_size_mb} MiB): {last[:200]}"
    return f"exit {code}" + (f": {last[:300]}" if last else "")


async def run_command(
    argv: Sequence[str], *, stdin: str = "", limits: SandboxLimits | None = None, files: dict[str, str] | None = None
) -> SandboxResult:
    """Run ``argv`` in the sandbox (in a fresh temporary directory holding ``files``: name -> text) with
    ``stdin``; never raises for what the program does, only when it cannot be started."""
    limits = limits or SandboxLimits()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="miles-sandbox-") as workdir:
        for name, text in (files or {}).items():
            path = os.path.join(workdir, name)
            if os.path.dirname(os.path.abspath(path)) != os.path.abspath(workdir):
                raise SandboxError(f"sandbox file {name!r} is not a plain file name")
            with open(path, "w") as f:
                f.write(text)
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=workdir,
            env=env,
            preexec_fn=functools.partial(_child_setup, limits, _libc_unshare()),
        )
        cap = limits.output_kb << 10
        reads = asyncio.gather(_read_capped(process.stdout, cap), _read_capped(process.stderr, cap))

        async def feed() -> None:
            assert process.stdin is not None
            try:
                process.stdin.write(stdin.encode())
                await process.stdin.drain()
            except (BrokenPipeError, ConnectionResetError):
                pass
            finally:
                process.stdin.close()

        timed_out = False
        try:
            await asyncio.wait_for(asyncio.gather(feed(), process.wait()), limits.timeout)
        except asyncio.TimeoutError:
            timed_out = True
        finally:
            if process.returncode is None or timed_out:
                try:
                    os.killpg(process.pid, signal.SIGKILL)  # the whole group: children it forked too
                except ProcessLookupError:
                    pass
            code = await process.wait()
            try:
                out, err = await asyncio.wait_for(reads, 5.0)  # (a grandchild holding the pipes: give up)
            except asyncio.TimeoutError:
                out, err = b"", b""
    stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
    reason = f"timed out after {limits.timeout:g} s (killed)" if timed_out else _reason(code, stderr, limits)
    return SandboxResult(code, stdout, stderr, time.monotonic() - start, timed_out, reason)


async def run_python(code: str, *, stdin: str = "", limits: SandboxLimits | None = None) -> SandboxResult:
    """Run Python source ``code`` in the sandbox (``python -I main.py`` with this interpreter)."""
    return await run_command([sys.executable, "-I", "main.py"], stdin=stdin, limits=limits, files={"main.py": code})
