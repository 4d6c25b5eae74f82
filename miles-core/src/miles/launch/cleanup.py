"""Process-wide teardown: every live launcher is shut down at exit and on SIGINT / SIGTERM / SIGHUP.

Children run in their own sessions, so a Ctrl-C in the terminal reaches only the driver; these handlers
pass it on. The previous handler runs afterwards (``KeyboardInterrupt`` for SIGINT; for a default
SIGTERM or SIGHUP the signal is re-raised so the process still dies of it). An ignored SIGHUP or SIGTERM
stays ignored (``nohup``); SIGINT is always handled, even when the shell ignores it — a run started with
``cmd &`` from a script inherits an ignored SIGINT, and ``kill -INT`` must still stop it cleanly. Signal handlers can only be installed from the main thread; elsewhere only the ``atexit``
hook is registered.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles.launch.base import Launcher

__all__ = ["track", "untrack"]

log = logging.getLogger(__name__)

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_live: list[Launcher] = []
_previous: dict[int, Any] = {}
_atexit_registered = False
_in_teardown = False


def track(launcher: Launcher, *, handle_signals: bool = True) -> None:
    """Shut ``launcher`` down at exit (and on SIGINT / SIGTERM / SIGHUP when ``handle_signals``)."""
    global _atexit_registered
    if launcher not in _live:
        _live.append(launcher)
    if not _atexit_registered:
        atexit.register(shutdown_all)
        _atexit_registered = True
    if handle_signals and threading.current_thread() is threading.main_thread():
        for sig in _SIGNALS:
            current = signal.getsignal(sig)
            if sig in _previous:
                continue
            if current == signal.SIG_IGN and sig == signal.SIGINT:
                # ``cmd &`` from a non-interactive shell ignores SIGINT: handle it anyway (KeyboardInterrupt)
                _previous[sig] = signal.default_int_handler
                signal.signal(sig, _on_signal)
            elif current != signal.SIG_IGN:  # an ignored SIGHUP / SIGTERM stays ignored (``nohup``)
                _previous[sig] = signal.SIG_DFL if current is None else current  # None: set outside Python
                signal.signal(sig, _on_signal)


def untrack(launcher: Launcher) -> None:
    """Forget ``launcher`` (it was shut down); restore the signal handlers when none is left."""
    if launcher in _live:
        _live.remove(launcher)
    if not _live and _previous and threading.current_thread() is threading.main_thread():
        for sig, handler in list(_previous.items()):
            if signal.getsignal(sig) is _on_signal:
                signal.signal(sig, handler)
            del _previous[sig]


def shutdown_all() -> None:
    """Shut every live launcher down (errors are logged, never raised: this runs at exit)."""
    global _in_teardown
    if _in_teardown:
        return
    _in_teardown = True
    try:
        _shutdown_live()
    finally:
        _in_teardown = False


def _shutdown_live() -> None:
    for launcher in list(_live):
        try:
            launcher.shutdown()
        except Exception:
            log.exception("shutting down launcher %r failed", launcher)


def _say(line: str) -> None:
    """Write ``line`` to stderr's file descriptor directly (async-signal-safe; no Python stream buffer)."""
    try:
        os.write(2, (line + "\n").encode(errors="replace"))
    except OSError:
        pass


def _on_signal(signum: int, frame: FrameType | None) -> None:
    global _in_teardown
    # test-and-set first, with no call in between: a second signal may arrive at any call
    if _in_teardown:
        # this signal interrupted the teardown, possibly in the middle of a log line on stderr: logging again
        # would be a reentrant write on the same buffered stream (the line would be lost), so say it unbuffered
        _say(
            f"WARNING:{log.name}:received {signal.Signals(signum).name} during shutdown; still stopping child processes"
        )
        return
    _in_teardown = True
    try:
        name = signal.Signals(signum).name
        if any(getattr(launcher, "stopping", False) for launcher in _live):
            log.warning("received %s during shutdown; still stopping child processes", name)
            return
        previous = _previous.get(signum, signal.SIG_DFL)
        log.warning("received %s: stopping %d launcher(s) and their processes", name, len(_live))
        _shutdown_live()  # untrack() of the last launcher restores the previous handlers
    finally:
        _in_teardown = False
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
