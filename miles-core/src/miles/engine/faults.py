"""Fault injection for tests of failover: an engine that kills itself at a chosen point, once.

``MILES_TEST_SIGKILL_IN_PUSH=FILE``: on the second bucket of a distributed weight update (so the first one
is already loaded: the push is truly midway), the engine that removes ``FILE`` first sends itself SIGKILL.
The file makes it one-shot across engines and restarts (they share the environment), and the test chooses
the push by creating the file. Unset, nothing happens.
"""

from __future__ import annotations

import logging
import os
import signal

__all__ = ["SIGKILL_IN_PUSH", "die_in_push_if_asked"]

log = logging.getLogger(__name__)

SIGKILL_IN_PUSH = "MILES_TEST_SIGKILL_IN_PUSH"


def die_in_push_if_asked(bucket: int) -> None:
    """Called with the number of the bucket a distributed update is receiving (1 for the first)."""
    path = os.environ.get(SIGKILL_IN_PUSH)
    if not path or bucket < 2:
        return
    try:
        os.remove(path)
    except FileNotFoundError:
        return
    log.error("%s: killing this engine in bucket %d of a weight push (a test of failover)", SIGKILL_IN_PUSH, bucket)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.kill(os.getpid(), signal.SIGKILL)
