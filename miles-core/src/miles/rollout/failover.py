"""Engine failover: which engines of a client serve generation, which are down, which rejoin.

An engine that gives no answer (refused or reset connection, a timeout: its process died) is marked
*down* by the :class:`~miles.rollout.http_client.HttpEngineClient` that saw it; the requests it had in
flight are re-sent, with the same payload and so the same ``sampling_seed``, to another serving engine,
which produces what the dead one would have (the sampler is seeded per request). A request gets exactly
one answer: a ``/generate`` is not streamed, so a dead engine leaves nothing behind but the error.

A down engine takes no traffic and no control calls. When it answers ``/health`` again (the launcher
restarted it, ``rollout.engine_restarts``), :meth:`EngineHealth.back_up` makes it *rejoining*: it takes
the control calls of the next weight push, so it loads the trainer's current weights, and only after
that push (verified) does :meth:`EngineHealth.rejoined` give it generation again. When no engine serves,
generation raises :class:`NoEngineLeftError` and the run stops (fail-stop) — unless a down engine may
still be restarted (:attr:`EngineHealth.restarts`, ``rollout.engine_restarts``, in ``sync`` runs): then
generation waits for an engine to serve again, while the training loop has the trainer's current weights
pushed to the restarted engine (:meth:`miles.driver.loop.TrainingLoop.obtain_groups_or_republish`).

The fleet may also change on purpose while the run goes on (``miles fleet add|remove``,
:mod:`miles.driver.fleet`): an engine that joins (:meth:`EngineHealth.add`) is rejoining from the start — it
takes the next weight push and serves once that push is verified; an engine that leaves is first
*draining* (:meth:`EngineHealth.drain`: no new generation, its requests in flight finish, it still takes
control calls) and then removed (:meth:`EngineHealth.remove`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

from miles.errors import EngineError

__all__ = ["EngineHealth", "NoEngineLeftError"]

log = logging.getLogger(__name__)


class NoEngineLeftError(EngineError):
    """Every engine of the client is down: nothing can generate (the run stops)."""


class EngineHealth:
    """The state of each engine of one client: serving, down (with why) or rejoining."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.engines = list(urls)
        """Every engine the client was given, in order."""
        self.down: dict[str, str] = {}
        """Engines that gave no answer, with what the client saw."""
        self.rejoining: set[str] = set()
        """Engines back up that wait for the next weight push before they serve."""
        self.engine_failures = 0
        """Engines marked down since the last :meth:`take_metrics`."""
        self.requests_retried = 0
        """Requests re-sent to another engine since the last :meth:`take_metrics`."""
        self.deaths: Counter[str] = Counter()
        """Times each engine was marked down."""
        self.restarts = 0
        """Times the launcher may restart each engine (``rollout.engine_restarts``, where a run waits for it)."""
        self.draining: set[str] = set()
        """Engines leaving the fleet: no new generation; removed once their requests in flight are done."""
        self.added = 0
        """Engines that joined the fleet since the last :meth:`take_metrics`."""
        self.removed = 0
        """Engines removed from the fleet since the last :meth:`take_metrics`."""

    def serving(self) -> list[str]:
        """Engines that take generation."""
        return [u for u in self.engines if u not in self.down and u not in self.rejoining and u not in self.draining]

    def add(self, url: str) -> bool:
        """``url`` joins the fleet: it takes control calls from now on and generation once a verified weight
        push has reached it (it rejoins, as a restarted engine does). Whether it was new."""
        if url in self.engines:
            return False
        self.engines.append(url)
        self.rejoining.add(url)
        self.added += 1
        log.warning("engine %s joins the fleet; it serves once the next weight push has reached it", url)
        return True

    def drain(self, url: str) -> bool:
        """``url`` leaves the fleet: it takes no new generation (its requests in flight finish) until it is
        removed. Whether it was news."""
        if url not in self.engines or url in self.draining:
            return False
        self.draining.add(url)
        self.rejoining.discard(url)
        log.warning("engine %s is draining: no new requests go to it; it leaves once those in flight are done", url)
        return True

    def remove(self, url: str) -> bool:
        """``url`` is no longer part of the fleet (no traffic, no control calls). Whether it was."""
        if url not in self.engines:
            return False
        self.engines.remove(url)
        for state in (self.rejoining, self.draining):
            state.discard(url)
        self.down.pop(url, None)
        self.removed += 1
        log.warning("engine %s left the fleet; %d engine(s) serve", url, len(self.serving()))
        return True

    def reachable(self) -> list[str]:
        """Engines that take control calls (pause, weights, verification): serving and rejoining ones."""
        return [u for u in self.engines if u not in self.down]

    def mark_down(self, url: str, why: str) -> bool:
        """Record that ``url`` gave no answer; whether it was news (each death is logged and counted once)."""
        if url in self.down or url not in self.engines:
            return False
        self.down[url] = why
        self.rejoining.discard(url)
        self.engine_failures += 1
        self.deaths[url] += 1
        left = self.serving()
        log.error(
            "engine %s is down (%s); %s",
            url,
            why,
            f"its requests go to {', '.join(left)}" if left else "no engine is left to generate",
        )
        return True

    def back_up(self, url: str) -> None:
        """``url`` answers again: it rejoins at the next weight push."""
        if self.down.pop(url, None) is not None:
            self.rejoining.add(url)
            log.warning("engine %s answers again; it serves once the next weight push has reached it", url)

    def rejoined(self, version: str) -> list[str]:
        """The rejoining engines loaded weight version ``version``: they serve again; returns them."""
        back = [u for u in self.engines if u in self.rejoining]
        self.rejoining.clear()
        for url in back:
            log.warning("engine %s rejoined at weight version %s and serves again", url, version)
        return back

    def may_return(self) -> list[str]:
        """Engines that do not serve but may again: rejoining ones, and down ones the launcher may still
        restart (each dies at most ``restarts`` times and comes back)."""
        return [u for u in self.engines if u in self.rejoining or (u in self.down and self.deaths[u] <= self.restarts)]

    def no_engine_left(self) -> NoEngineLeftError:
        why = "; ".join(f"{url}: {reason}" for url, reason in self.down.items()) or "none is serving"
        return NoEngineLeftError(f"no engine is left to generate (every engine is down: {why})")

    def take_metrics(self) -> dict[str, float]:
        """``rollout/engine_failures``, ``rollout/requests_retried`` (since the last call) and
        ``rollout/engines_serving`` (now); once the fleet changed, ``fleet/engines_added``,
        ``fleet/engines_removed`` (since the last call) and ``fleet/engines_draining`` (now)."""
        out = {
            "rollout/engine_failures": float(self.engine_failures),
            "rollout/requests_retried": float(self.requests_retried),
            "rollout/engines_serving": float(len(self.serving())),
        }
        if self.added or self.removed or self.draining:
            out.update(
                {
                    "fleet/engines_added": float(self.added),
                    "fleet/engines_removed": float(self.removed),
                    "fleet/engines_draining": float(len(self.draining)),
                }
            )
        self.engine_failures = self.requests_retried = self.added = self.removed = 0
        return out
