"""Engines that join and leave an engine client's fleet while the run goes on (``miles fleet add|remove``).

An engine that joins takes control calls from the next :meth:`FleetChanges.apply` — the start of a weight
push (:meth:`~miles.rollout.http_client.HttpEngineClient.check_engines`), so that it takes that push whole —
and serves once the push is verified and, with a router, once the router has it (:meth:`route_joined`). An
engine that leaves gets no new generation from the moment it drains (a router is told first: it stops
routing to it and lets its requests finish) and is removed at the first :meth:`apply` after its requests in
flight are done. Which engines serve is :class:`~miles.rollout.failover.EngineHealth`'s; this keeps who is
on the way in or out.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from miles.errors import EngineError

if TYPE_CHECKING:
    from miles.rollout.failover import EngineHealth
    from miles.rollout.smg_workers import SmgWorkers

__all__ = ["FleetChanges"]


class FleetChanges:
    """The joins and departures of one client's engines (``health``: its :class:`EngineHealth`;
    ``outstanding``: its requests in flight per engine, which this adds joined engines to)."""

    def __init__(self, health: EngineHealth, outstanding: dict[str, int]) -> None:
        self.health = health
        self.outstanding = outstanding
        self.arriving: list[str] = []
        """Engines that join at the next :meth:`apply`."""
        self.new: set[str] = set()
        """Engines that joined and have not served yet (they wait for a verified push, then the router)."""
        self.unrouted: set[str] = set()
        """Joined engines that have the weights and wait to be registered with the router."""
        self.departed: list[str] = []
        """Engines that left the fleet (:meth:`drain`, then removed), in order."""
        self.drained_requests = 0
        """Requests that were in flight on an engine when its drain began (they finished there), since the
        client's last ``failover_metrics``."""

    def add(self, url: str) -> None:
        """Engine ``url`` joins at the next :meth:`apply`."""
        url = url.rstrip("/")
        if url not in self.health.engines and url not in self.arriving:
            self.arriving.append(url)

    async def drain(self, url: str, router: SmgWorkers | None) -> None:
        """Engine ``url`` gets no new generation from now on (``router`` told first) and is removed at the
        first :meth:`apply` after its requests in flight are done."""
        url = url.rstrip("/")
        if url in self.arriving:  # (never joined)
            self.arriving.remove(url)
            self.departed.append(url)
            return
        if not self.health.drain(url):
            return
        self.new.discard(url)
        self.unrouted.discard(url)
        self.drained_requests += self.outstanding.get(url, 0)
        if router is not None:
            await router.remove(url)

    async def apply(self, router: SmgWorkers | None) -> bool:
        """Engines that arrived join (rejoining); draining ones whose requests are done (or that died) leave.
        Returns whether the fleet changed."""
        state = self.health
        changed = False
        for url in self.arriving:
            if state.add(url):
                self.outstanding.setdefault(url, 0)
                self.new.add(url)
                changed = True
        self.arriving = []
        for url in [u for u in state.engines if u in state.draining]:
            busy = self.outstanding.get(url, 0) > 0 or (router is not None and await router.has(url))
            if url not in state.down and busy:
                continue
            state.remove(url)
            self.departed.append(url)
            changed = True
        return changed

    def weights_reached(self, back: list[str], *, routed: bool) -> None:
        """A verified push reached ``back``: joined engines among them serve now, or (``routed``) wait to be
        registered with the router (:meth:`route_joined`)."""
        joined = self.new.intersection(back)
        self.new -= joined
        if routed:
            self.unrouted |= joined

    async def route_joined(self, router: SmgWorkers | None, timeout: float) -> list[str]:
        """Register with ``router`` the joined engines that have the weights and wait until it routes to them;
        returns the engines that serve from now on. Without a router they serve at once."""
        joined = sorted(self.unrouted)
        if router is not None:
            for url in joined:
                await router.register(url)
            deadline = time.monotonic() + timeout
            while not all(await asyncio.gather(*(router.has(url, ready=True) for url in joined))):
                if time.monotonic() >= deadline:
                    raise EngineError(
                        f"the router at {router.router_url} did not take {', '.join(joined)} in {timeout:g} s"
                    )
                await asyncio.sleep(0.2)
        self.unrouted.difference_update(joined)
        return joined

    def state(self) -> dict[str, str]:
        """Each engine by URL: ``joining`` (until it serves), ``serving``, ``draining``, ``down`` or ``removed``."""
        health = self.health
        out = {url: "joining" for url in self.arriving}
        for url in health.engines:
            if url in health.draining:
                out[url] = "draining"
            elif url in health.down:
                out[url] = "down"
            elif url in self.new or url in self.unrouted or url in health.rejoining:
                out[url] = "joining"
            else:
                out[url] = "serving"
        out.update({url: "removed" for url in self.departed})
        return out
