"""The phase order of a colocated run (``cluster.colocate``), written once.

A trainer rank and an engine share each GPU, so each side gives its memory back while the other works. One
step, from the rollout on:

1. ``rollout``: the engines generate (the trainer holds nothing on the device);
2. ``engine release``: the engines free their KV cache, weights and CUDA graphs
   (SGLang's ``/release_memory_occupation``; :meth:`~miles.rollout.client.EngineClient.release_memory`);
3. ``trainer onload``: every rank brings back what it offloaded (after rank 0 saw the engines release:
   the engine on a rank's GPU may be another rank's);
4. ``train``;
5. ``trainer offload state``: the optimizer state, gradients, reference and critic models leave the device
   (:meth:`~miles.training.trainer.Trainer.offload`);
6. ``engine resume weights``: the engines take their weights' memory back;
7. ``push``: the new weights go to the engines (the trainer's weights are still on the device: the push reads
   them);
8. ``trainer offload weights``: the trained model's parameters leave the device too;
9. ``engine resume kv``: the engines take their KV cache and CUDA graphs back and generate again (paused
   since the release); the push is verified (a verification by logprobs generates);

then the next step's rollout. Before the engines start, the trainer, loaded (a
resumed run's checkpoint too), offloads everything (``trainer offload``); the engines start once every rank
has (:func:`miles.host.train.run_training` waits for :data:`LOADED_FILE`). A checkpoint or the final export
brings the trainer back for its time (:meth:`Colocation.trainer_back`). Rank 0 logs each phase as
``colocation: <phase>`` with the trainer's memory on the device, which CI reads back from a real run's log to
check the order.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal

from miles.rollout.client import MEMORY_TAGS

if TYPE_CHECKING:
    from miles.rollout.client import EngineClient
    from miles.settings.model import MilesSettings
    from miles.training.trainer import Trainer

__all__ = ["LOADED_FILE", "PHASES", "Colocation"]

log = logging.getLogger(__name__)


LOADED_FILE = "trainer_loaded"
"""In the run directory: trainer rank 0 writes it once every rank has loaded and offloaded (colocated runs
start their engines then)."""

PHASES = (
    "rollout",
    "engine release",
    "trainer onload",
    "train",
    "trainer offload state",
    "engine resume weights",
    "push",
    "trainer offload weights",
    "engine resume kv",
)
"""One step's phases, in order (the module docstring says what each does)."""


class Colocation:
    """The phases of a colocated run on one trainer rank. :attr:`active` is false when the run is not
    colocated; every method is then a no-op."""

    def __init__(self, settings: MilesSettings, trainer: Trainer, *, engines: bool, is_driver: bool) -> None:
        cluster = settings.cluster
        self.active = cluster.colocate and engines
        self.offloads = self.active and (
            cluster.offload_trainer if cluster.offload_trainer is not None else cluster.device == "cuda"
        )
        self.trainer = trainer
        self.is_driver = is_driver
        self.client: EngineClient | None = None
        """Rank 0's engine client (set once the engines are announced)."""
        self.device = cluster.device
        self.engines_released = False
        """Whether the engines gave their memory back (from ``engine release`` to ``engine resume kv``)."""

    def phase(self, name: str, detail: str = "") -> None:
        """Rank 0: ``colocation: <name>`` in the run's log, with the trainer's memory on its device."""
        if self.active and self.is_driver:
            log.info("colocation: %s%s (%s)", name, f": {detail}" if detail else "", self._memory())

    def _memory(self) -> str:
        text = f"trainer holds {self.trainer.resident_bytes() / 1e6:.1f} MB on {self.device}"
        if self.device == "cuda":
            import torch

            text += (
                f"; cuda allocated {torch.cuda.memory_allocated() / 1e6:.1f} MB,"
                f" reserved {torch.cuda.memory_reserved() / 1e6:.1f} MB"
            )
        return text

    def _offload(self, part: Literal["state", "weights"]) -> str:
        if not self.offloads:
            return "kept (cluster.offload_trainer is off)"
        return f"{self.trainer.offload(part) / 1e6:.1f} MB to host memory"

    def after_load(self) -> None:
        """Every rank, once the trainer loaded (a resumed run's checkpoint too), before the engines start:
        everything off the device (rank 0 then tells the launcher, which starts the engines)."""
        if not self.active:
            return
        from miles.training.comm import all_gather_json

        state, weights = self._offload("state"), self._offload("weights")
        all_gather_json(True)
        self.phase("trainer offload", f"state: {state}; weights: {weights}")

    @contextlib.contextmanager
    def trainer_back(self, why: str) -> Iterator[None]:
        """Every rank: the trainer's memory back on the device for ``why`` (a checkpoint, the HF export) and
        off it again after."""
        if not self.offloads or not (self.trainer.offloaded("state") or self.trainer.offloaded("weights")):
            yield
            return
        self.trainer.onload()
        try:
            yield
        finally:
            state, weights = self._offload("state"), self._offload("weights")
            self.phase("trainer offload", f"after {why}: state: {state}; weights: {weights}")

    async def after_rollout(self) -> None:
        """Every rank: the engines release their memory (rank 0 asks them), then the trainer comes back."""
        if not self.active:
            return
        from miles.training.comm import broadcast_json

        self.phase("rollout", "done")
        if self.client is not None:
            await self.client.release_memory(MEMORY_TAGS)
            self.phase("engine release", ", ".join(MEMORY_TAGS))
        self.engines_released = True
        broadcast_json(True)  # every rank waits until rank 0's engines released theirs
        moved = self.trainer.onload() if self.offloads else 0
        self.phase("trainer onload", f"{moved / 1e6:.1f} MB back")
        self.phase("train", "starts")

    async def before_push(self) -> None:
        """Every rank, before a push: what only training reads leaves the device and the engines take their
        weights' memory back. A push while the trainer's weights are off the device (a resumed run's first
        push; a restarted engine taking the current weights during the rollout) brings them back for it."""
        if not self.active:
            return
        if self.trainer.offloaded("weights"):
            moved = self.trainer.onload("weights")
            self.phase("trainer onload weights", f"{moved / 1e6:.1f} MB back for the push")
        else:
            self.phase("trainer offload state", self._offload("state"))
        if self.engines_released and self.client is not None:
            await self.client.resume_memory(("weights",))
            self.phase("engine resume weights")
        self.phase("push", "starts")

    async def after_push(self) -> None:
        """Every rank, once the weights went (before they are verified): the trainer's weights leave too; then
        rank 0's engines take their KV cache and CUDA graphs back."""
        if not self.active:
            return
        from miles.training.comm import all_gather_json

        detail = self._offload("weights")
        all_gather_json(True)  # every rank's weights are off its device before an engine grows again
        self.phase("trainer offload weights", detail)
        if self.engines_released:
            if self.client is not None:
                await self.client.resume_memory(("kv_cache", "cuda_graph"))
                await self.client.continue_generation()  # (paused since the release)
                self.phase("engine resume kv", "kv_cache, cuda_graph; generation continues")
            self.engines_released = False
