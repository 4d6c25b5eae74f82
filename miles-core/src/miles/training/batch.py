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
    teacher_topk_ids: list[list[list[int]]] | None = None
    """Per response token, the teacher's top-``k`` token ids (``[sequence][token][k]``, one ``k`` for all)."""
    teacher_topk_logprobs: list[list[list[float]]] | None = None
    """The teacher's logprobs of ``teacher_topk_ids``, aligned with it."""
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
        self._validate_topk(lengths)

    @property
    def teacher_topk(self) -> int:
        """``k`` of the teacher's top-k rows (0 when the batch has none)."""
        for rows in self.teacher_topk_ids or []:
            if rows:
                return len(rows[0])
        return 0

    def _validate_topk(self, lengths: list[int]) -> None:
        ids, logprobs = self.teacher_topk_ids, self.teacher_topk_logprobs
        if (ids is None) != (logprobs is None):
            raise ValueError("TrainBatch.teacher_topk_ids and teacher_topk_logprobs must be set together")
        if ids is None or logprobs is None:
            return
        k = self.teacher_topk
        named: tuple[tuple[str, Sequence[Sequence[Sequence[float]]]], ...] = (
            ("teacher_topk_ids", ids),
            ("teacher_topk_logprobs", logprobs),
        )
        for name, value in named:
            if len(value) != len(lengths):
                raise ValueError(f"TrainBatch.{name} has {len(value)} sequences, tokens has {len(lengths)}")
            for i, (rows, length) in enumerate(zip(value, lengths, strict=True)):
                if len(rows) != length:
                    raise ValueError(f"TrainBatch.{name}[{i}] has {len(rows)} rows, the response has {length} tokens")
                bad = next((t for t, row in enumerate(rows) if len(row) != k), None)
                if bad is not None:
                    raise ValueError(f"TrainBatch.{name}[{i}][{bad}] has {len(rows[bad])} entries, k is {k}")

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
        """Build a batch from samples (rollout logprobs and the teacher's logprobs / top-k are taken from them)."""
        teacher = [s.teacher_logprobs for s in samples]
        topk_ids = [s.teacher_topk_ids for s in samples]
        topk_logprobs = [s.teacher_topk_logprobs for s in samples]
        has_topk = bool(samples) and all(t is not None for t in topk_ids)
        return cls(
            tokens=[s.tokens for s in samples],
            prompt_lengths=[len(s.prompt_ids) for s in samples],
            loss_mask=[list(s.loss_mask) for s in samples],
            advantages=None if advantages is None else [list(a) for a in advantages],
            rollout_logprobs=[list(s.rollout_logprobs) for s in samples],
            teacher_logprobs=None if any(t is None for t in teacher) else [list(t) for t in teacher],  # type: ignore[arg-type]
            teacher_topk_ids=[[list(r) for r in t] for t in topk_ids if t is not None] if has_topk else None,
            teacher_topk_logprobs=[[list(r) for r in t] for t in topk_logprobs if t is not None] if has_topk else None,
            weight_versions=[v if (v := s.oldest_weight_version) is not None else -1 for s in samples],
        )
