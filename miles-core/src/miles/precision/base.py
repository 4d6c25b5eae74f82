"""The precision-recipe interface."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from miles.components import Component, SettingsT

if TYPE_CHECKING:
    import torch

__all__ = ["PrecisionRecipe", "Slice", "SliceT"]


class Slice(Protocol):
    """The part of one HF tensor a trainer rank holds: a :class:`~miles.training.trainer.WeightShard` (a
    dataclass; converted slices are copies of it with other fields)."""

    @property
    def name(self) -> str: ...
    @property
    def global_shape(self) -> tuple[int, ...]: ...
    @property
    def offsets(self) -> tuple[int, ...]: ...
    @property
    def tensor(self) -> torch.Tensor: ...


SliceT = TypeVar("SliceT", bound=Slice)


class PrecisionRecipe(Component[SettingsT]):
    """Training dtypes plus an optional conversion of rollout weights (e.g. FP8 with block scales).

    Registered with ``miles_register_precisions``. The base class is the identity recipe in fp32.
    """

    param_dtype: ClassVar[str] = "float32"
    """Dtype the trainer computes in (``float32`` / ``bfloat16``)."""
    reduce_dtype: ClassVar[str] = "float32"
    """Dtype of gradient reduction across ranks."""

    @property
    def engine_quantization(self) -> str | None:
        """The weight format the engines must be launched with to load converted weights
        (``rollout.engine.quantization``; ``None``: the same dtype as sent)."""
        return None

    def rollout_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Convert HF-named trainer weights to what the engines load (may add scale tensors)."""
        yield from named

    def rollout_shards(self, shards: Sequence[SliceT], gather: Callable[[Any], list[Any]]) -> list[SliceT]:
        """What :meth:`rollout_weights` makes of the whole tensors, made from the slices this trainer rank
        holds (the ``p2p`` transport, which never gathers a tensor): the converted tensors' slices at their
        offsets, bit for bit the same bytes. A collective: every rank calls it once per push; ``gather`` is
        an all-gather of JSON values (:func:`miles.training.comm.all_gather_json`).

        The base returns the slices as they are. A recipe that overrides :meth:`rollout_weights` and not
        this raises ``NotImplementedError`` (``p2p`` refuses it before the run starts)."""
        if type(self).rollout_weights is not PrecisionRecipe.rollout_weights:
            raise NotImplementedError(f"precision {self.name!r} converts whole tensors only (rollout_weights)")
        return list(shards)

    @classmethod
    def converts_shards(cls) -> bool:
        """Whether :meth:`rollout_shards` gives what :meth:`rollout_weights` gives (the identity recipes, and
        those that override both)."""
        return (
            cls.rollout_weights is PrecisionRecipe.rollout_weights
            or cls.rollout_shards is not PrecisionRecipe.rollout_shards
        )
