"""The batch a trainer consumes: token sequences plus per-response-token fields, built from samples."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

from miles.types import Sample

__all__ = ["TrainBatch"]

_TOKEN_FIELDS = (
    "advantages",
    "rollout_logprobs",
    "old_logprobs",
    "ref_logprobs",
    "teacher_logprobs",
    "returns",
    "old_values",
)


@dataclass
class TrainBatch:
    """Sequences to train on. Per-token fields hold one value per *response* token of each sequence.

    Sequences keep their own lengths (no padding here); trainers pack them into micro-batches by a token
    budget. A field left ``None`` is not available (e.g. ``ref_logprobs`` when no KL term is used).
    """

    tokens: list[list[int]]
    """Prompt + response token ids, one list per sequence."""
    prompt_lengths: list[int]
    """Number of prompt tokens at the start of each sequence."""
    loss_mask: list[list[int]]
    """Per response token: 1 = trained on."""
    advantages: list[list[float]] | None = None
    rollout_logprobs: list[list[float]] | None = None
    """Logprobs the engine reported (for mismatch metrics and importance-sampling correction)."""
    old_logprobs: list[list[float]] | None = None
    """Trainer logprobs before this step's updates (the PPO ratio's denominator)."""
    ref_logprobs: list[list[float]] | None = None
    teacher_logprobs: list[list[float]] | None = None
    returns: list[list[float]] | None = None
    old_values: list[list[float]] | None = None
    weight_versions: list[int] = field(default_factory=list)
    """Oldest weight version per sequence (for staleness metrics)."""

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def response_lengths(self) -> list[int]:
        return [len(t) - p for t, p in zip(self.tokens, self.prompt_lengths, strict=True)]

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field and sequence when a per-token field is misaligned."""
        n = len(self.tokens)
        if len(self.prompt_lengths) != n or len(self.loss_mask) != n:
            raise ValueError("TrainBatch.tokens, prompt_lengths and loss_mask must have one entry per sequence")
        lengths = self.response_lengths
        for name in ("loss_mask", *_TOKEN_FIELDS):
            value = getattr(self, name)
            if value is None:
                continue
            if len(value) != n:
                raise ValueError(f"TrainBatch.{name} has {len(value)} sequences, tokens has {n}")
            for i, (row, length) in enumerate(zip(value, lengths, strict=True)):
                if len(row) != length:
                    raise ValueError(f"TrainBatch.{name}[{i}] has {len(row)} values, the response has {length} tokens")

    def select(self, indices: Sequence[int]) -> TrainBatch:
        """A batch of the sequences at ``indices`` (e.g. this rank's share)."""
        updates: dict[str, object] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list) and (value or f.name != "weight_versions"):
                updates[f.name] = [value[i] for i in indices] if value else value
        return replace(self, **updates)  # type: ignore[arg-type]

    def shard(self, rank: int, world_size: int) -> TrainBatch:
        """Rank ``rank``'s contiguous share; every rank gets ``len // world_size`` sequences.

        Raises ``ValueError`` when the batch does not divide evenly (the settings check this up front).
        """
        if len(self) % world_size:
            raise ValueError(f"a batch of {len(self)} sequences does not split over {world_size} ranks")
        per = len(self) // world_size
        return self.select(range(rank * per, (rank + 1) * per))

    @classmethod
    def from_samples(cls, samples: Sequence[Sample], advantages: Sequence[Sequence[float]] | None = None) -> TrainBatch:
        """Build a batch from samples (rollout logprobs and teacher logprobs are taken from them)."""
        teacher = [s.teacher_logprobs for s in samples]
        return cls(
            tokens=[s.tokens for s in samples],
            prompt_lengths=[len(s.prompt_ids) for s in samples],
            loss_mask=[list(s.loss_mask) for s in samples],
            advantages=None if advantages is None else [list(a) for a in advantages],
            rollout_logprobs=[list(s.rollout_logprobs) for s in samples],
            teacher_logprobs=None if any(t is None for t in teacher) else [list(t) for t in teacher],  # type: ignore[arg-type]
            weight_versions=[v if (v := s.oldest_weight_version) is not None else -1 for s in samples],
        )
