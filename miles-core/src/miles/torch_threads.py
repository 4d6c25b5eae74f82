"""Blocking torch work off the event loop without a second OpenMP pool.

With OpenMP (torch's CPU backend) every thread that runs a parallel region gets its own pool of worker
threads, which lives as long as the thread. A process whose pools hold more threads than the machine has
cores makes libgomp throttle spin-waiting in *every* pool, and each of the main thread's thousands of
small parallel regions then waits longer for its workers: one persistent helper thread that ran a single
two-thread copy made a SmolLM2 train step 1.3-1.5x slower on a 2-core machine (the trainer's pushes and the
engines' weight routes run such copies in ``asyncio.to_thread``'s pool). :func:`to_thread` runs the work on
that pool with one torch thread, so the helper threads never create a pool of their own; the calling
thread's torch thread count is untouched.

Helper threads must lower their count without ``torch.set_num_threads``: it also stores the count in a
process-wide variable, and every shared object built against torch (a C++ extension: Miles' CPU kernels)
keeps its own per-thread "initialised" flag, so a thread's first parallel region *in that object* sets the
thread's count from the variable again. ``miles serve``'s HTTP thread setting one thread made the engine's
scheduler decode on one core of two from its first CPU-kernel call on (0.55-0.85x its in-process speed).
:func:`single_threaded_here` sets only the calling thread's OpenMP count (``threadpoolctl``); the threads
that compute set theirs with :func:`set_torch_threads`, which the process-wide variable then follows.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

__all__ = ["set_torch_threads", "single_threaded_here", "to_thread"]

P = ParamSpec("P")
R = TypeVar("R")


def set_torch_threads(threads: int) -> None:
    """Set the calling (computing) thread's torch thread count, and the process-wide count that torch and its
    extensions initialise a thread's count from."""
    import torch

    torch.set_num_threads(threads)
    # the first get_num_threads initialises this thread's count from the process-wide variable, which another
    # thread may have changed since the line above; once initialised, the set below is this thread's
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@functools.cache
def _openmp() -> Any:
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController().select(user_api="openmp")


def single_threaded_here() -> None:
    """Run torch single-threaded on the calling (helper) thread only: no OpenMP pool of its own, and the
    process-wide count other threads initialise theirs from left as it is."""
    import torch

    if torch.get_num_threads() == 1:  # (this also initialises the thread's count, in libtorch)
        return
    controller = _openmp()
    if controller.lib_controllers:
        controller.limit(limits=1)  # omp_set_num_threads: this thread's count alone
    else:  # torch without OpenMP (its own pool is shared, nothing to spare)
        torch.set_num_threads(1)


def _single_threaded(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    single_threaded_here()
    return fn(*args, **kwargs)


async def to_thread(fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
    """``asyncio.to_thread(fn, *args, **kwargs)`` with torch single-threaded in the worker thread."""
    return await asyncio.to_thread(functools.partial(_single_threaded, fn, *args, **kwargs))
