"""Fault injection for tests of failover: an engine that kills itself at a chosen point, once.

``MILES_TEST_SIGKILL_IN_PUSH=FILE``: on the second part of a weight push the engine receives (so the first
one is already in: the push is truly midway), the engine that removes ``FILE`` first sends itself SIGKILL.
A part is a bucket of a distributed update (``broadcast``: the other engines have loaded the first one), a
chunk of a ``p2p`` push over the ``torch`` data path, for the one-sided ``p2p`` data paths (the trainer
ranks write, the engine only confirms) the confirmation once every chunk is written, before the commit,
or a tensor a ``disk_delta`` version applies (``/update_weights_from_delta``).
The file makes it one-shot across engines and restarts (they share the environment), and the test chooses
the push by creating the file. Unset, nothing happens.

``MILES_TEST_SIGKILL_IN_GENERATE=FILE``: the same for a ``/generate`` request: the engine that removes
``FILE`` as a request arrives SIGKILLs itself, so the rollout it serves loses it with requests in flight.

A declared public module of the local engine (see :mod:`miles.engine`): a plugin's weight route calls
:func:`die_in_push_if_asked` as the parts of a push arrive.
"""

from __future__ import annotations

import logging
import os
import signal

__all__ = ["SIGKILL_IN_GENERATE", "SIGKILL_IN_PUSH", "die_in_generate_if_asked", "die_in_push_if_asked"]

log = logging.getLogger(__name__)

SIGKILL_IN_PUSH = "MILES_TEST_SIGKILL_IN_PUSH"
SIGKILL_IN_GENERATE = "MILES_TEST_SIGKILL_IN_GENERATE"


def die_in_push_if_asked(part: int, *, unit: str = "bucket") -> None:
    """Called with the number of the part of a weight push this engine is receiving (1 for the first).

    :param unit: what a part is (``bucket``, ``chunk`` ...), for the log line."""
    if part >= 2:
        _die_if_asked(SIGKILL_IN_PUSH, f"in {unit} {part} of a weight push")


def die_in_generate_if_asked() -> None:
    """Called as a ``/generate`` request arrives."""
    _die_if_asked(SIGKILL_IN_GENERATE, "as a /generate request arrives")


def _die_if_asked(variable: str, when: str) -> None:
    path = os.environ.get(variable)
    if not path:
        return
    try:
        os.remove(path)
    except FileNotFoundError:
        return
    log.error("%s: killing this engine %s (a test of failover)", variable, when)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.kill(os.getpid(), signal.SIGKILL)
