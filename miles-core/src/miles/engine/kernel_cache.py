"""Build a C++ extension at most once per machine and source version, and never wedge on a dead build.

``torch.utils.cpp_extension.load`` guards a build with a ``lock`` file in the build directory that it
creates exclusively and deletes when the build ends. A process killed mid-build (Ctrl-C during an engine's
first start) leaves that file behind, and every later ``load`` of the same extension then waits on it
forever, silently. It also writes a ``build.ninja`` with the include paths of the interpreter that asks,
so a second virtual environment or checkout rebuilds over the first one's build.

:func:`load_extension` puts a lock around torch's that cannot go stale (``flock`` on a file of its own:
the kernel releases it when the holder dies), so while holding it any ``lock`` file of torch's is known
to be left by a dead build and is removed. A finished build is marked complete, and every later caller,
from any environment with the same torch, Python and sources, imports the built module directly. Waiting
for another process's build is bounded and logged with the directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

__all__ = [
    "BUILD_TIMEOUT_ENV",
    "CACHE_ENV",
    "KernelBuildError",
    "build_progress",
    "cache_root",
    "extension_key",
    "last_build_seconds",
    "load_extension",
]

log = logging.getLogger(__name__)

CACHE_ENV = "MILES_KERNEL_CACHE"
"""Directory of Miles' compiled kernels (default ``~/.cache/miles/kernels``)."""
BUILD_TIMEOUT_ENV = "MILES_KERNEL_BUILD_TIMEOUT"
"""Seconds to wait for another process's build of the same kernels (default 1800)."""
COMPLETE = "COMPLETE"
BUILD_TIMES = "build-times.json"
"""``{what: seconds}`` of the last build of each extension on this machine, in :func:`cache_root`."""
FIRST_BUILD = "45 s on 2 idle cores, 75-98 s sharing them with one other job, minutes on a busier machine"
"""What a first build costs, as measured (the three Miles CPU kernels, g++ 12, -O3 -march=native, on the
2-core development machine; 680 s there at a load average of 10-18)."""
PROGRESS_INTERVAL = 10.0
"""Seconds between the progress lines of a build."""


class KernelBuildError(RuntimeError):
    """The extension could not be built or loaded (the message says why and where)."""


def cache_root() -> Path:
    """Where extensions are built: ``$MILES_KERNEL_CACHE`` or ``~/.cache/miles/kernels``."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "miles" / "kernels"


def extension_key(sources: Sequence[Path], *, extra: Sequence[str] = ()) -> str:
    """A short hash of the sources, torch's version, Python's ABI and ``extra`` (e.g. the CPU's flags)."""
    import torch

    digest = hashlib.sha256()
    for part in (torch.__version__, sys.implementation.cache_tag or "", *extra):
        digest.update(part.encode() + b"\0")
    for path in sources:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def _import(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise KernelBuildError(f"{library}: not a loadable extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _exclusive(path: Path, *, timeout: float, what: str) -> Iterator[None]:
    """Hold ``flock(path)``; wait at most ``timeout`` seconds, saying every 15 s who is waited for."""
    with open(path, "a+", encoding="utf-8") as handle:
        start = time.monotonic()
        next_note = start + 15.0
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if now - start > timeout:
                    handle.seek(0)
                    holder = handle.read().strip() or "?"
                    raise KernelBuildError(
                        f"waited {timeout:.0f} s for another process (pid {holder}) building {what} in "
                        f"{path.parent}; set {BUILD_TIMEOUT_ENV} to wait longer"
                    ) from None
                if now >= next_note:
                    log.info("waiting for another process building %s in %s (%.0f s)", what, path.parent, now - start)
                    next_note = now + 15.0
                time.sleep(0.2)
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(str(os.getpid()))
            handle.flush()
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def last_build_seconds(what: str) -> float | None:
    """How long the last build of ``what`` took on this machine (``None``: never built here)."""
    try:
        value = json.loads((cache_root() / BUILD_TIMES).read_text()).get(what)
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) else None


def _record_build_seconds(what: str, seconds: float) -> None:
    path = cache_root() / BUILD_TIMES
    try:
        times = json.loads(path.read_text())
        times = times if isinstance(times, dict) else {}
    except (OSError, ValueError):
        times = {}
    times[what] = round(seconds, 1)
    scratch = path.with_name(f"{path.name}.{os.getpid()}")
    scratch.write_text(json.dumps(times, indent=1))
    scratch.replace(path)


@contextlib.contextmanager
def build_progress(
    what: str, directory: Path, sources: int, *, expected: float | None, interval: float | None = None
) -> Iterator[None]:
    """Log every ``interval`` seconds while the block builds: the sources compiled so far (their object
    files in ``directory``), the time spent and what the last build here took."""
    stop = threading.Event()
    start = time.monotonic()
    last = f" (the last build here took {expected:.0f} s)" if expected else f" (a first build takes {FIRST_BUILD})"

    def beat() -> None:
        while not stop.wait(interval or PROGRESS_INTERVAL):
            done = min(sources, len(list(directory.glob("*.o"))))
            log.info(
                "building %s: %d of %d sources compiled, %.0f s%s", what, done, sources, time.monotonic() - start, last
            )

    thread = threading.Thread(target=beat, name="miles-kernel-build", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def load_extension(
    name: str,
    sources: Sequence[Path],
    *,
    extra_cflags: Sequence[str] = (),
    extra_ldflags: Sequence[str] = (),
    key_extra: Sequence[str] = (),
    what: str = "the CPU kernels",
) -> ModuleType:
    """Import the extension ``name`` built from ``sources``, building it first if no process has.

    The build directory is ``cache_root() / f"{name}_{key}"`` (see :func:`extension_key`). Raises
    :class:`KernelBuildError` naming the directory when the build fails or another build takes longer
    than ``$MILES_KERNEL_BUILD_TIMEOUT`` seconds.
    """
    key = extension_key(sources, extra=[*key_extra, *extra_cflags, *extra_ldflags])
    module_name = f"{name}_{key}"
    directory = cache_root() / module_name
    library = directory / f"{module_name}.so"
    complete = directory / COMPLETE
    if complete.exists() and library.exists():
        return _import(module_name, library)
    directory.mkdir(parents=True, exist_ok=True)
    timeout = float(os.environ.get(BUILD_TIMEOUT_ENV, "1800"))
    with _exclusive(directory / "miles.lock", timeout=timeout, what=what):
        if complete.exists() and library.exists():  # built by the process we waited for
            return _import(module_name, library)
        stale = directory / "lock"
        if stale.exists():  # we hold the only build lock: torch's was left by a build that died
            log.warning("removing %s, left by an interrupted build of %s", stale, what)
        # No COMPLETE mark: whatever is here is a died build's (a SIGKILL mid-link leaves a truncated .so or
        # .o newer than the sources, which ninja would take as up to date); build from nothing.
        for leftover in directory.iterdir():
            if leftover.name == "miles.lock":
                continue
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover)
            else:
                leftover.unlink()
        from torch.utils.cpp_extension import load

        expected = last_build_seconds(what)
        log.info(
            "building %s in %s (once per machine and source version; %s)",
            what,
            directory,
            f"the last build here took {expected:.0f} s" if expected else f"a first build takes {FIRST_BUILD}",
        )
        start = time.monotonic()
        try:
            with build_progress(what, directory, len(sources), expected=expected):
                module = load(
                    name=module_name,
                    sources=[str(path) for path in sources],
                    extra_cflags=list(extra_cflags),
                    extra_ldflags=list(extra_ldflags),
                    build_directory=str(directory),
                    verbose=False,
                )
        except Exception as exc:
            raise KernelBuildError(f"building {what} in {directory} failed: {exc}") from exc
        complete.write_text(f"{key}\n")
        seconds = time.monotonic() - start
        _record_build_seconds(what, seconds)
        log.info("built %s in %.0f s (cached: later starts skip this)", what, seconds)
        return module
