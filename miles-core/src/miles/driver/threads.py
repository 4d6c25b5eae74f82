"""Where training and staging run: on the event loop's thread (``sync``) or on one dedicated thread.

In the async modes rank 0's event loop keeps feeding the engines while the trainer trains, so training
and staging run on a dedicated thread with the process's torch thread count, and the main thread (event
loop, set-up, checkpoints) runs torch single-threaded. With OpenMP (torch's CPU backend) every thread
that runs parallel regions gets its own thread pool, and libgomp throttles spin-waiting once a process
has more pool threads than cores — the same kernels then run 1.4-1.7x slower (measured on the local
engine's decode). One multi-threaded torch thread per process avoids that.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from miles.torch_threads import set_torch_threads, single_threaded_here

__all__ = ["ComputeThread"]


class ComputeThread:
    """Runs coroutine functions inline, or (``dedicated``) to completion on one worker thread.

    A dedicated thread takes the process's torch thread count and leaves the calling thread with one;
    create it before the model is built. On CUDA it works on the rank's GPU (``cuda_device``): the current
    device is per thread, and a thread that never sets it puts its kernels and collectives on GPU 0.
    """

    def __init__(self, *, dedicated: bool, cuda_device: int | None = None) -> None:
        self.dedicated = dedicated
        self._executor: ThreadPoolExecutor | None = None
        self.threads = 0
        self.cuda_device = cuda_device
        if dedicated:
            import torch

            self.threads = torch.get_num_threads()
            single_threaded_here()
            self._executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="miles-train", initializer=self._on_thread
            )

    def _on_thread(self) -> None:
        """The worker thread's start: the rank's GPU becomes its current device."""
        if self.cuda_device is not None:
            import torch

            torch.cuda.set_device(self.cuda_device)

    async def run(self, coro_fn: Callable[[], Awaitable[Any]]) -> Any:
        """``await coro_fn()`` here, or on the dedicated thread (in its own event loop)."""
        if self._executor is None:
            return await coro_fn()

        threads = self.threads

        def work() -> Any:
            set_torch_threads(threads)

            async def main() -> Any:
                return await coro_fn()

            return asyncio.run(main())

        return await asyncio.get_running_loop().run_in_executor(self._executor, work)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False)
