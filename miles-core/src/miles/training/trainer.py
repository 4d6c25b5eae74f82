"""The trainer interface. Backends (``fsdp``, ``megatron``) implement it; the driver calls it.

A trainer runs SPMD: one instance per rank of a ``torch.distributed`` world (gloo on CPU, NCCL on GPU),
and every rank calls the same methods in the same order with its share of the batch (collectives inside).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from miles.components import Component, SettingsT

if TYPE_CHECKING:
    import torch

    from miles.algorithms.base import Algorithm
    from miles.precision.base import PrecisionRecipe
    from miles.settings.model import TrainSettings
    from miles.training.adapter import ModelAdapter
    from miles.training.batch import TrainBatch
    from miles.training.offload import ParkedMemory

__all__ = ["DistContext", "LogprobOutput", "Trainer", "WeightBucket", "WeightShard"]

WeightBucket = list[tuple[str, "torch.Tensor"]]
"""A list of (HF parameter name, full tensor) pairs; a transport sends one bucket at a time."""


@dataclass(frozen=True)
class WeightShard:
    """The part of one Hugging Face tensor that one trainer rank holds (see :meth:`Trainer.iter_weight_shards`).

    The slice is the box ``offsets[d] : offsets[d] + tensor.shape[d]`` of the full tensor in every
    dimension ``d`` (an FSDP ``Shard(0)`` slice is a block of rows; a replicated tensor is the whole box
    at offsets 0 on every rank that holds it).
    """

    name: str
    """The tensor's Hugging Face name."""
    global_shape: tuple[int, ...]
    """The full tensor's shape."""
    offsets: tuple[int, ...]
    """Where the slice starts in the full tensor, per dimension."""
    tensor: torch.Tensor
    """The slice itself (this rank's memory: do not modify)."""


@dataclass(frozen=True)
class DistContext:
    """Where this trainer rank sits."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"
    """``cpu`` or ``cuda``; the backend picks gloo or NCCL from it."""


@dataclass
class LogprobOutput:
    """Per-response-token results of a forward pass, packed as the batch's per-token fields are: one ``[R]``
    float32 CPU tensor each, sequence ``i``'s tokens at ``batch.response_offsets[i]:batch.response_offsets[i + 1]``
    (``tensor.split(batch.response_lengths)`` gives them one tensor per sequence)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None


class Trainer(Component[SettingsT], ABC):
    """A training backend. Registered with ``miles_register_trainers``."""

    supports_adapters: ClassVar[bool] = False
    """Whether :meth:`setup` applies :attr:`adapter` (the composition root refuses ``train.adapter`` otherwise)."""
    adapter: ModelAdapter[Any] | None = None
    """The ``train.adapter`` the run selected, set by the composition root before :meth:`setup`."""
    supports_weights_on_every_rank: ClassVar[bool] = False
    """Whether :meth:`iter_weights` can give every rank the full tensors (:attr:`weights_on_every_rank`)."""
    weights_on_every_rank: bool = False
    """Set by a transport (in :meth:`~miles.transport.base.WeightTransport.attach`) whose every rank sends
    the full tensors to its own colocated engine (``tensor_ipc``): :meth:`iter_weights` then fills every rank's
    buckets, which the gather already made on every rank.

    .. versionadded:: 0.1
    """

    def __init__(
        self,
        train: TrainSettings,
        options: SettingsT,
        precision: PrecisionRecipe,
        dist: DistContext,
    ) -> None:
        """
        :param train: the core ``train`` settings section (model path, optimizer, batch sizes ...).
        :param options: this backend's own settings (its ``Settings`` model, from ``train.backend``).
        :param precision: the precision recipe (parameter / reduce dtypes).
        :param dist: this rank's place in the world; the process group is already initialised.
        """
        super().__init__(options)
        self.train_settings = train
        self.precision = precision
        self.dist = dist
        self._parked: ParkedMemory | None = None

    @property
    def options(self) -> SettingsT:
        """This backend's own settings (the same object as :attr:`settings`)."""
        return self.settings

    @abstractmethod
    def setup(self, *, need_ref: bool = False, need_values: bool = False) -> None:
        """Load the model (and a frozen reference and/or a value head when asked) and the optimizer."""

    @abstractmethod
    def compute_logprobs(
        self,
        batch: TrainBatch,
        *,
        model: Literal["actor", "ref"] = "actor",
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> LogprobOutput:
        """Per-token logprobs of the response tokens of ``batch`` (logits divided by ``temperature``,
        as the engine samples), packed as its per-token fields (:class:`LogprobOutput`)."""

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """Critic values per response token (PPO), one ``[R]`` float32 CPU tensor packed as the batch's
        per-token fields. Backends without a value head raise."""
        raise TypeError(f"trainer {self.name!r} has no value head; pick an algorithm that needs no critic")

    @abstractmethod
    def train_step(self, batch: TrainBatch, algorithm: Algorithm, *, temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step over ``batch`` (this rank's share) with ``algorithm``'s loss.

        ``temperature`` is the rollout's sampling temperature: the trainer divides its logits by it, as
        :meth:`compute_logprobs` does, so the ratio against ``old_logprobs`` / ``rollout_logprobs`` is
        taken between the same distributions.

        Returns metrics reduced over ranks: loss parts, ``grad_norm``, ``lr``, ``tokens``, and
        ``train_rollout_logprob_abs_diff`` when the batch carries rollout logprobs.
        """

    @abstractmethod
    def iter_weights(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """Full weights in Hugging Face naming, bucket by bucket (a collective: every rank iterates).

        Rank 0 receives full tensors; other ranks may receive empty buckets (full ones too when
        :attr:`weights_on_every_rank` is set).
        """

    def iter_weight_shards(self, bucket_bytes: int = 256 << 20) -> Iterator[WeightShard]:
        """This rank's slices of every weight, in Hugging Face naming, without gathering anything: for
        transports that send each slice straight to the engines that need it (``p2p``).

        Every rank calls it; the slices of all ranks together cover every tensor (a slice held by
        several ranks, a replica, is sent by one of them). Backends with sharded parameters override it
        (``fsdp``: its DTensor shards, with their offsets). The default yields :meth:`iter_weights`'
        full tensors on rank 0 (a collective, as that is, gathering ``bucket_bytes`` at a time) and
        nothing on other ranks.

        .. versionadded:: 0.1
        """
        for bucket in self.iter_weights(bucket_bytes):
            for name, tensor in bucket:
                yield WeightShard(name, tuple(tensor.shape), (0,) * tensor.dim(), tensor)

    @abstractmethod
    def save_checkpoint(self, path: str) -> None:
        """Save model, optimizer, scheduler, RNG states and step (sharded; every rank calls)."""

    @abstractmethod
    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote, exactly."""

    @abstractmethod
    def export_hf(self, path: str) -> None:
        """Write a Hugging Face safetensors directory that ``transformers`` loads with strict keys."""

    def offloadable(self, part: Literal["state", "weights"]) -> Iterable[torch.Tensor]:
        """The tensors :meth:`offload` moves off the device for ``part``: ``"state"``, what only training
        reads (optimizer state, gradients, the reference and critic models); ``"weights"``, the trained
        model's parameters (the weight push reads them, so they leave after it). The default is none: a
        backend that names nothing keeps its memory while colocated engines roll out.

        .. versionadded:: 0.1
        """
        return ()

    def offload(self, part: Literal["state", "weights"]) -> int:
        """Move :meth:`offloadable` ``part``'s storages to host memory (:class:`~miles.training.offload.
        ParkedMemory`: the tensor objects stay, holding no bytes, until :meth:`onload`); return the bytes
        moved. A colocated run calls it between training and rollout (:mod:`miles.driver.colocate`).

        .. versionadded:: 0.1
        """
        from miles.training.offload import ParkedMemory

        if self._parked is None:
            self._parked = ParkedMemory()
        return self._parked.park(part, self.offloadable(part), device=self.dist.device)

    def onload(self, part: Literal["state", "weights"] | None = None) -> int:
        """Bring back what :meth:`offload` moved (of ``part``, or all), exactly as it was; return the bytes
        moved.

        .. versionadded:: 0.1
        """
        return 0 if self._parked is None else self._parked.restore(part)

    def offloaded(self, part: Literal["state", "weights"]) -> bool:
        """Whether ``part`` is offloaded now."""
        return self._parked is not None and self._parked.holds(part)

    def resident_bytes(self) -> int:
        """Bytes the storages of :meth:`offloadable` (both parts) hold on their device now."""
        from miles.training.offload import device_bytes

        return device_bytes([*self.offloadable("state"), *self.offloadable("weights")])

    def close(self) -> None:
        """Release resources; the launcher destroys the process group afterwards."""
