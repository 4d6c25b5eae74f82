"""What a launcher does when an engine dies while the trainers run (``rollout.engine_restarts``).

- Restarts left for that engine: start it again, with the same command line (so the same URL); the
  engine client re-admits it at the next weight push, which brings it to the trainer's version before it
  takes traffic (:mod:`miles.rollout.failover`).
- No restarts left and other engines alive: the run goes on without it (the client already sends its
  requests elsewhere).
- No engine left: the run stops (fail-stop), naming the engine and how it died.

The decision is the launcher-independent part; each launcher starts and reaps the processes its own way.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Literal

from miles.errors import SettingsError

__all__ = ["EngineDeathPolicy"]

log = logging.getLogger(__name__)

Decision = Literal["restart", "continue", "stop"]


class EngineDeathPolicy:
    """Decides, per death, whether an engine is restarted, left out, or the run stops.

    :param restarts: how many times each engine may be restarted (``rollout.engine_restarts``).
    """

    def __init__(self, restarts: int = 0) -> None:
        if restarts < 0:
            raise SettingsError(f"rollout.engine_restarts: {restarts} is negative")
        self.restarts = restarts
        self.restarted: Counter[str] = Counter()
        """Restarts so far, per engine name."""

    def decide(self, name: str, how: str, *, alive: list[str]) -> Decision:
        """Engine ``name`` died (``how``: ``killed by SIGKILL``); ``alive`` names the engines still running.
        Logs the decision, naming the engine."""
        if self.restarted[name] < self.restarts:
            self.restarted[name] += 1
            log.error(
                "%s %s while the trainers ran: restarting it (restart %d of %d, rollout.engine_restarts); "
                "its requests in flight were re-sent to the other engines and it serves again once the next "
                "weight push has reached it",
                name,
                how,
                self.restarted[name],
                self.restarts,
            )
            return "restart"
        if alive:
            log.error(
                "%s %s while the trainers ran; no restarts left (rollout.engine_restarts = %d): the run goes on "
                "with %s",
                name,
                how,
                self.restarts,
                ", ".join(alive),
            )
            return "continue"
        return "stop"
