"""Blocking torch work off the event loop without a second OpenMP pool.

With OpenMP (torch's CPU backend) every thread that runs a parallel region gets its own pool of worker
threads, which lives as long as the thread. A process whose pools hold more threads than the machine has
cores makes libgomp throttle spin-waiting in *every* pool, and each of the main thread's thousands of
small parallel regions then waits longer for its workers: one persistent helper thread that ran a single
two-thread copy made a SmolLM2 train step 1.3-1.5x slower on a 2-core machine (the trainer's pushes and the
engines' weight routes run such copies in ``asyncio.to_thread``'s pool). :func:`to_thread` runs the work on
that pool with one torch thread, so the helper threads never create a pool of their own; the calling
thread's torch thread count is untouched (torch's count is per thread once a thread has started).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["to_thread"]

P = ParamSpec("P")
R = TypeVar("R")


def _single_threaded(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    import torch

    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)  # this helper thread only: no OpenMP pool of its own
    return fn(*args, **kwargs)


async def to_thread(fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
    """``asyncio.to_thread(fn, *args, **kwargs)`` with torch single-threaded in the worker thread."""
    return await asyncio.to_thread(functools.partial(_single_threaded, fn, *args, **kwargs))
