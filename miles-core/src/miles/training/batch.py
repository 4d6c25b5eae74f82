"""The batch a trainer consumes: packed token sequences and per-response-token tensors.

Every field is a tensor, packed without padding: the token ids of all sequences concatenated (``tokens``,
``[N]``) with ``seq_offsets`` (``[B + 1]``) marking where each sequence starts, and each per-token field
(:data:`TOKEN_FIELDS`, ``[R]`` float32, one value per *response* token of every sequence, in order) next
to it. A batch is validated once, when it is built; :meth:`TrainBatch.set_token_field` validates what it
adds. Trainers pack its sequences into micro-batches by a token budget. Between trainer ranks a batch
travels as its tensors (:meth:`TrainBatch.to_tensors`, over ``torch.distributed``), never as JSON.

:attr:`TrainBatch.response_tensors` holds what a backend needs per response token beyond these fields, any
shape after the first dimension (``[R, ...]``): a diffusion trajectory's latents, one row per denoising
step, or the engine's logit masks (:data:`~miles.training.logit_masks.LOGIT_MASK_IDS`). They come from the
samples and follow every selection and shard. :attr:`TrainBatch.token_tensors` does the same per sequence
token (``[N, ...]``, aligned with ``tokens``): the experts the engine routed each token to
(:data:`~miles.training.routing.ROUTED_EXPERTS`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from miles.training.logit_masks import LOGIT_MASK_IDS, pack_logit_masks
from miles.training.request_spans import REQUEST_INDEX, pack_request_spans
from miles.training.routing import ROUTED_EXPERTS, pack_routed_experts
from miles.types import Sample

if TYPE_CHECKING:
    import torch

    from miles.types import TensorData

__all__ = ["RESPONSE_TENSOR_PREFIX", "TOKEN_FIELDS", "TOKEN_TENSOR_PREFIX", "TOPK_FIELDS", "TrainBatch"]

RESPONSE_TENSOR_PREFIX = "response_tensors."
"""How :meth:`TrainBatch.to_tensors` names each of :attr:`TrainBatch.response_tensors`."""
TOKEN_TENSOR_PREFIX = "token_tensors."
"""How :meth:`TrainBatch.to_tensors` names each of :attr:`TrainBatch.token_tensors`."""

TOKEN_FIELDS: tuple[str, ...] = (
    "loss_mask",
    "advantages",
    "rollout_logprobs",
    "old_logprobs",
    "ref_logprobs",
    "teacher_logprobs",
    "returns",
    "old_values",
)
"""The per-response-token fields (``[R]`` float32); ``loss_mask`` is always set, the others may be ``None``."""

TOPK_FIELDS: tuple[str, ...] = ("teacher_topk_ids", "teacher_topk_logprobs")
"""The teacher's top-k per response token (``[R, k]``: int64 ids, float32 logprobs), set together."""


def _tensor(values: Any, dtype: torch.dtype) -> torch.Tensor:
    import torch

    return torch.as_tensor(values, dtype=dtype)


def _pack_rows(name: str, rows: Sequence[Sequence[float]], lengths: Sequence[int]) -> torch.Tensor:
    """One ``[R]`` float32 tensor of per-sequence rows; a row of the wrong length names the field."""
    import torch

    if len(rows) != len(lengths):
        raise ValueError(f"TrainBatch.{name} has {len(rows)} sequences, tokens has {len(lengths)}")
    for i, (row, length) in enumerate(zip(rows, lengths, strict=True)):
        if len(row) != length:
            raise ValueError(f"TrainBatch.{name}[{i}] has {len(row)} values, the response has {length} tokens")
    if not rows:
        return torch.zeros(0, dtype=torch.float32)
    return torch.cat([torch.as_tensor(row, dtype=torch.float32).reshape(-1) for row in rows])


def _tensor_of(data: TensorData) -> torch.Tensor:
    import torch

    dtype = getattr(torch, data.dtype)
    if not data.data:
        return torch.zeros(data.shape, dtype=dtype)
    return torch.frombuffer(bytearray(data.data), dtype=dtype).reshape(data.shape)


def _pack_response_tensors(samples: Sequence[Sample]) -> dict[str, torch.Tensor]:
    """Each name's rows of every sample, concatenated (``[R, ...]``); a sample without response tokens may
    lack them (a failed rollout), any other must have every name with the same trailing shape and dtype."""
    import torch

    names = sorted({name for s in samples for name in s.response_tensors})
    out: dict[str, torch.Tensor] = {}
    for name in names:
        rows: list[torch.Tensor] = []
        for i, sample in enumerate(samples):
            data = sample.response_tensors.get(name)
            if data is None:
                if sample.response_length:
                    raise ValueError(f"TrainBatch.response_tensors[{name!r}]: sample {i} has none (other samples do)")
                continue
            tensor = _tensor_of(data)
            if tensor.shape[0] != sample.response_length:
                raise ValueError(
                    f"TrainBatch.response_tensors[{name!r}][{i}] has {tensor.shape[0]} rows, "
                    f"the response has {sample.response_length} tokens"
                )
            if rows and (tensor.shape[1:] != rows[0].shape[1:] or tensor.dtype != rows[0].dtype):
                raise ValueError(
                    f"TrainBatch.response_tensors[{name!r}][{i}] is {tensor.dtype} {tuple(tensor.shape[1:])} per "
                    f"token, an earlier sample's is {rows[0].dtype} {tuple(rows[0].shape[1:])}"
                )
            rows.append(tensor)
        out[name] = torch.cat(rows) if rows else torch.zeros(0)
    return out


def _pack_topk(
    name: str, rows: Sequence[Sequence[Sequence[float]]], lengths: Sequence[int], dtype: Any
) -> torch.Tensor:
    """One ``[R, k]`` tensor of per-sequence ``[length][k]`` rows, every row of one ``k``."""
    import torch

    if len(rows) != len(lengths):
        raise ValueError(f"TrainBatch.{name} has {len(rows)} sequences, tokens has {len(lengths)}")
    k = next((len(seq[0]) for seq in rows if seq), 0)
    for i, (seq, length) in enumerate(zip(rows, lengths, strict=True)):
        if len(seq) != length:
            raise ValueError(f"TrainBatch.{name}[{i}] has {len(seq)} rows, the response has {length} tokens")
        bad = next((t for t, row in enumerate(seq) if len(row) != k), None)
        if bad is not None:
            raise ValueError(f"TrainBatch.{name}[{i}][{bad}] has {len(seq[bad])} entries, k is {k}")
    flat = [list(row) for seq in rows for row in seq]
    return torch.tensor(flat, dtype=dtype).reshape(len(flat), k)


@dataclass(eq=False)
class TrainBatch:
    """Sequences to train on, packed (see the module docstring). Build with :meth:`from_samples` or
    :meth:`from_lists`; the constructor checks every shape."""

    tokens: torch.Tensor
    """``[N]`` int64: prompt + response token ids of every sequence, concatenated."""
    seq_offsets: torch.Tensor
    """``[B + 1]`` int64: sequence ``i`` is ``tokens[seq_offsets[i]:seq_offsets[i + 1]]``."""
    prompt_lengths: torch.Tensor
    """``[B]`` int64: prompt tokens at the start of each sequence (the rest is its response)."""
    loss_mask: torch.Tensor
    """``[R]`` float32, per response token: 1 = trained on."""
    advantages: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    """Logprobs the engine reported (for mismatch metrics and importance-sampling correction)."""
    old_logprobs: torch.Tensor | None = None
    """Trainer logprobs before this step's updates (the PPO ratio's denominator)."""
    ref_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    teacher_topk_ids: torch.Tensor | None = None
    """``[R, k]`` int64: the teacher's top-``k`` token ids per response token."""
    teacher_topk_logprobs: torch.Tensor | None = None
    """``[R, k]`` float32: the teacher's logprobs of ``teacher_topk_ids``."""
    weight_versions: torch.Tensor = field(default=None)
    """``[B]`` int64: oldest weight version per sequence (-1: unknown)."""
    response_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per response token tensors a backend needs beyond the fields above (``[R, ...]``, any dtype)."""
    token_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per sequence token tensors (``[N, ...]``, aligned with :attr:`tokens`, any dtype): the engine's
    routed experts (:data:`~miles.training.routing.ROUTED_EXPERTS`)."""
    pixel_values: torch.Tensor | None = None
    """A vision-language policy's images (:mod:`miles.training.vision`): ``[patches, patch_dim]`` float32 of
    every image of every sequence, in order."""
    image_grid_thw: torch.Tensor | None = None
    """``[images, 3]`` int64: each image's patch grid (temporal, height, width)."""
    image_counts: torch.Tensor | None = None
    """``[B]`` int64: images of each sequence's prompt."""

    def __post_init__(self) -> None:
        import torch

        n = int(self.prompt_lengths.numel())
        if self.weight_versions is None:
            self.weight_versions = torch.full((n,), -1, dtype=torch.int64)
        if self.seq_offsets.shape != (n + 1,) or self.weight_versions.shape != (n,):
            raise ValueError(
                f"TrainBatch: seq_offsets must have {n + 1} entries and weight_versions {n} "
                f"(one per sequence), got {tuple(self.seq_offsets.shape)} and {tuple(self.weight_versions.shape)}"
            )
        if int(self.seq_offsets[-1]) != self.tokens.numel():
            raise ValueError(
                f"TrainBatch: seq_offsets end at {int(self.seq_offsets[-1])}, tokens has {self.tokens.numel()}"
            )
        for name in TOKEN_FIELDS:
            self._check_token_field(name, getattr(self, name))
        for name, tensor in self.response_tensors.items():
            if tensor.dim() == 0 or tensor.shape[0] != self.num_response_tokens:
                raise ValueError(
                    f"TrainBatch.response_tensors[{name!r}] has shape {tuple(tensor.shape)}, the batch has "
                    f"{self.num_response_tokens} response tokens ([R, ...] expected)"
                )
        for name, tensor in self.token_tensors.items():
            if tensor.dim() == 0 or tensor.shape[0] != self.num_tokens:
                raise ValueError(
                    f"TrainBatch.token_tensors[{name!r}] has shape {tuple(tensor.shape)}, the batch has "
                    f"{self.num_tokens} tokens ([N, ...] expected)"
                )
        self._check_images()
        ids, logprobs = self.teacher_topk_ids, self.teacher_topk_logprobs
        if (ids is None) != (logprobs is None):
            raise ValueError("TrainBatch.teacher_topk_ids and teacher_topk_logprobs must be set together")
        if ids is not None and logprobs is not None:
            r = self.num_response_tokens
            if ids.dim() != 2 or ids.shape[0] != r or ids.shape != logprobs.shape:
                raise ValueError(
                    f"TrainBatch.teacher_topk_ids {tuple(ids.shape)} and teacher_topk_logprobs "
                    f"{tuple(logprobs.shape)} must both be [{r}, k] (one row per response token)"
                )

    def _check_images(self) -> None:
        values = (self.pixel_values, self.image_grid_thw, self.image_counts)
        if all(v is None for v in values):
            return
        if any(v is None for v in values):
            raise ValueError("TrainBatch.pixel_values, image_grid_thw and image_counts must be set together")
        assert self.pixel_values is not None and self.image_grid_thw is not None and self.image_counts is not None
        if self.image_counts.shape != (len(self),) or int(self.image_counts.sum()) != self.image_grid_thw.shape[0]:
            raise ValueError(
                f"TrainBatch.image_counts {tuple(self.image_counts.shape)} must give each of the {len(self)} "
                f"sequences its images, {self.image_grid_thw.shape[0]} in all (image_grid_thw's rows)"
            )
        if int(self.image_grid_thw.prod(-1).sum()) != self.pixel_values.shape[0]:
            raise ValueError(
                f"TrainBatch.pixel_values has {self.pixel_values.shape[0]} patches, the grids "
                f"{int(self.image_grid_thw.prod(-1).sum())}"
            )

    def image_index(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of :attr:`image_grid_thw` and :attr:`pixel_values` of sequences ``indices``' images."""
        import torch

        assert self.image_counts is not None and self.image_grid_thw is not None
        image_start = torch.cat([torch.zeros(1, dtype=torch.int64), self.image_counts.cumsum(0)]).tolist()
        patches = self.image_grid_thw.prod(-1)
        patch_start = torch.cat([torch.zeros(1, dtype=torch.int64), patches.cumsum(0)]).tolist()
        images = [j for i in indices for j in range(image_start[i], image_start[i + 1])]
        rows = [torch.arange(patch_start[j], patch_start[j + 1]) for j in images]
        empty = torch.zeros(0, dtype=torch.int64)
        return torch.tensor(images, dtype=torch.int64), torch.cat(rows) if rows else empty

    def _check_token_field(self, name: str, value: torch.Tensor | None) -> None:
        if value is None:
            if name == "loss_mask":
                raise ValueError("TrainBatch.loss_mask must be set")
            return
        r = self.num_response_tokens
        if value.dim() != 1 or value.numel() != r:
            raise ValueError(
                f"TrainBatch.{name} has shape {tuple(value.shape)}, the batch has {r} response tokens ([R] expected)"
            )

    # -- shape ------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.prompt_lengths.numel())

    @property
    def lengths(self) -> list[int]:
        """Tokens (prompt + response) of each sequence."""
        return (self.seq_offsets[1:] - self.seq_offsets[:-1]).tolist()

    @property
    def response_lengths(self) -> list[int]:
        return [n - p for n, p in zip(self.lengths, self.prompt_lengths.tolist(), strict=True)]

    @property
    def response_offsets(self) -> list[int]:
        """``[B + 1]``: sequence ``i``'s response tokens are ``[response_offsets[i], response_offsets[i + 1])``
        of every per-token field."""
        out = [0]
        for length in self.response_lengths:
            out.append(out[-1] + length)
        return out

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def num_response_tokens(self) -> int:
        return int(self.seq_offsets[-1] - self.seq_offsets[0]) - int(self.prompt_lengths.sum())

    @property
    def teacher_topk(self) -> int:
        """``k`` of the teacher's top-k rows (0 when the batch has none)."""
        return 0 if self.teacher_topk_ids is None else int(self.teacher_topk_ids.shape[1])

    def sequence(self, i: int) -> torch.Tensor:
        """The token ids of sequence ``i`` (a view)."""
        return self.tokens[int(self.seq_offsets[i]) : int(self.seq_offsets[i + 1])]

    def sequences(self) -> list[list[int]]:
        """Every sequence's token ids as lists (for tests and messages)."""
        return [self.sequence(i).tolist() for i in range(len(self))]

    def rows(self, name: str) -> list[torch.Tensor] | None:
        """A per-token field split into one tensor per sequence (``None`` when unset)."""
        value = getattr(self, name)
        return None if value is None else list(value.split(self.response_lengths))

    def response_index(self, indices: Sequence[int]) -> torch.Tensor:
        """Positions, in the per-token fields, of the response tokens of sequences ``indices`` (in order)."""
        import torch

        offsets = self.response_offsets
        parts = [torch.arange(offsets[i], offsets[i + 1]) for i in indices]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

    def token_field(self, name: str, indices: Sequence[int], device: Any = "cpu") -> torch.Tensor | None:
        """The ``[T]`` float32 values of a per-token field for sequences ``indices`` (``None`` if unset)."""
        import torch

        value = getattr(self, name)
        if value is None:
            return None
        return value[self.response_index(indices)].to(device=device, dtype=torch.float32)

    def response_tensor_rows(self, name: str, indices: Sequence[int], device: Any = "cpu") -> torch.Tensor | None:
        """The rows of response tensor ``name`` for the response tokens of sequences ``indices``, in order
        (``[T, ...]``; ``None`` when the batch has no such tensor)."""
        value = self.response_tensors.get(name)
        return None if value is None else value[self.response_index(indices)].to(device)

    def token_index(self, indices: Sequence[int]) -> torch.Tensor:
        """Positions, in :attr:`tokens` and the token tensors, of the tokens of sequences ``indices`` (in order)."""
        import torch

        starts = self.seq_offsets.tolist()
        parts = [torch.arange(starts[i], starts[i + 1]) for i in indices]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

    def token_tensor_rows(self, name: str, indices: Sequence[int], device: Any = "cpu") -> torch.Tensor | None:
        """The rows of token tensor ``name`` for the tokens of sequences ``indices``, packed in order (``[n, ...]``,
        as the sequences are concatenated; ``None`` when the batch has no such tensor)."""
        value = self.token_tensors.get(name)
        return None if value is None else value[self.token_index(indices)].to(device)

    def teacher_topk_rows(
        self, indices: Sequence[int], k: int, device: Any = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's first ``k`` top-k ids and logprobs (``[T, k]`` each) of sequences ``indices``.

        Raises ``ValueError`` when the batch has no teacher top-k or fewer than ``k`` per position.
        """
        import torch

        if self.teacher_topk_ids is None or self.teacher_topk_logprobs is None:
            raise ValueError(
                f"the algorithm needs the teacher's top-{k} (TrainBatch.teacher_topk_ids is None): "
                "score the samples with a teacher ([rollout.teacher] url, with top_k >= k)"
            )
        if self.teacher_topk < k:
            raise ValueError(f"the algorithm needs the teacher's top-{k}; the batch has top-{self.teacher_topk}")
        index = self.response_index(indices)
        return (
            self.teacher_topk_ids[index, :k].to(device=device, dtype=torch.long),
            self.teacher_topk_logprobs[index, :k].to(device=device, dtype=torch.float32),
        )

    # -- changing -------------------------------------------------------------------------------------
    def set_token_field(self, name: str, value: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Set a per-token field from a packed ``[R]`` tensor or one tensor per sequence (checked)."""
        import torch

        if name not in TOKEN_FIELDS:
            raise ValueError(f"TrainBatch.{name} is not a per-token field ({', '.join(TOKEN_FIELDS)})")
        if not isinstance(value, torch.Tensor):
            rows = list(value)
            if [r.numel() for r in rows] != self.response_lengths:
                raise ValueError(
                    f"TrainBatch.{name}: rows of {[r.numel() for r in rows]} values for responses of "
                    f"{self.response_lengths} tokens"
                )
            value = torch.cat([r.reshape(-1) for r in rows]) if rows else torch.zeros(0)
        value = value.detach().to(device="cpu", dtype=torch.float32)
        self._check_token_field(name, value)
        setattr(self, name, value)

    def select(self, indices: Sequence[int]) -> TrainBatch:
        """A batch of the sequences at ``indices`` (e.g. this rank's share)."""
        import torch

        starts, response = self.seq_offsets.tolist(), self.response_offsets
        tok = [torch.arange(starts[i], starts[i + 1]) for i in indices]
        resp = [torch.arange(response[i], response[i + 1]) for i in indices]
        tok_index = torch.cat(tok) if tok else torch.zeros(0, dtype=torch.int64)
        resp_index = torch.cat(resp) if resp else torch.zeros(0, dtype=torch.int64)
        lengths = [starts[i + 1] - starts[i] for i in indices]
        offsets = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
        index = torch.tensor(list(indices), dtype=torch.int64)
        updates: dict[str, Any] = {
            "tokens": self.tokens[tok_index],
            "seq_offsets": offsets,
            "prompt_lengths": self.prompt_lengths[index],
            "weight_versions": self.weight_versions[index],
        }
        for name in (*TOKEN_FIELDS, *TOPK_FIELDS):
            value = getattr(self, name)
            updates[name] = None if value is None else value[resp_index]
        updates["response_tensors"] = {name: t[resp_index] for name, t in self.response_tensors.items()}
        updates["token_tensors"] = {name: t[tok_index] for name, t in self.token_tensors.items()}
        if self.image_counts is not None and self.pixel_values is not None and self.image_grid_thw is not None:
            images, patches = self.image_index(indices)
            updates["image_counts"] = self.image_counts[index]
            updates["image_grid_thw"] = self.image_grid_thw[images].reshape(-1, 3)
            updates["pixel_values"] = self.pixel_values[patches]
        return replace(self, **updates)

    def shard(self, rank: int, world_size: int) -> TrainBatch:
        """Rank ``rank``'s contiguous share; every rank gets ``len // world_size`` sequences.

        Raises ``ValueError`` when the batch does not divide evenly (the settings check this up front).
        """
        if len(self) % world_size:
            raise ValueError(f"a batch of {len(self)} sequences does not split over {world_size} ranks")
        per = len(self) // world_size
        return self.select(range(rank * per, (rank + 1) * per))

    @classmethod
    def concat(cls, parts: Sequence[TrainBatch]) -> TrainBatch:
        """One batch of the sequences of ``parts``, in order (a field is kept only when every part has it)."""
        import torch

        if not parts:
            raise ValueError("TrainBatch.concat needs at least one batch")
        lengths = [n for part in parts for n in part.lengths]
        out: dict[str, Any] = {
            "tokens": torch.cat([p.tokens for p in parts]),
            "seq_offsets": torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0),
            "prompt_lengths": torch.cat([p.prompt_lengths for p in parts]),
            "weight_versions": torch.cat([p.weight_versions for p in parts]),
        }
        for name in (*TOKEN_FIELDS, *TOPK_FIELDS):
            values = [getattr(p, name) for p in parts]
            out[name] = None if any(v is None for v in values) else torch.cat(values)
        shared = set.intersection(*(set(p.response_tensors) for p in parts))
        out["response_tensors"] = {
            name: torch.cat([p.response_tensors[name] for p in parts]) for name in sorted(shared)
        }
        per_token = set.intersection(*(set(p.token_tensors) for p in parts))
        out["token_tensors"] = {name: torch.cat([p.token_tensors[name] for p in parts]) for name in sorted(per_token)}
        with_images = [p for p in parts if p.pixel_values is not None]
        if with_images:  # a part without images has none in each of its sequences
            dim = with_images[0].pixel_values.shape[1]  # type: ignore[union-attr]
            none = torch.zeros(0, dtype=torch.int64)
            out["image_counts"] = torch.cat(
                [
                    p.image_counts if p.image_counts is not None else torch.zeros(len(p), dtype=torch.int64)
                    for p in parts
                ]
            )
            out["image_grid_thw"] = torch.cat(
                [p.image_grid_thw if p.image_grid_thw is not None else none.reshape(0, 3) for p in parts]
            )
            out["pixel_values"] = torch.cat(
                [p.pixel_values if p.pixel_values is not None else torch.zeros(0, dim) for p in parts]
            )
        return cls(**out)

    # -- across ranks ---------------------------------------------------------------------------------
    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The set fields by name (what crosses a rank boundary); each response tensor as
        ``response_tensors.<name>``."""
        out = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("response_tensors", "token_tensors") and getattr(self, f.name) is not None
        }
        out.update({RESPONSE_TENSOR_PREFIX + name: t for name, t in self.response_tensors.items()})
        out.update({TOKEN_TENSOR_PREFIX + name: t for name, t in self.token_tensors.items()})
        return out

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor]) -> TrainBatch:
        """The batch :meth:`to_tensors` described (checked again)."""
        prefixes = (RESPONSE_TENSOR_PREFIX, TOKEN_TENSOR_PREFIX)
        plain = {k: v for k, v in tensors.items() if not k.startswith(prefixes)}
        extra = {
            k[len(RESPONSE_TENSOR_PREFIX) :]: v for k, v in tensors.items() if k.startswith(RESPONSE_TENSOR_PREFIX)
        }
        per_token = {k[len(TOKEN_TENSOR_PREFIX) :]: v for k, v in tensors.items() if k.startswith(TOKEN_TENSOR_PREFIX)}
        return cls(**plain, response_tensors=extra, token_tensors=per_token)

    # -- building ---------------------------------------------------------------------------------------
    @classmethod
    def from_lists(
        cls,
        *,
        tokens: Sequence[Sequence[int]],
        prompt_lengths: Sequence[int],
        loss_mask: Sequence[Sequence[float]],
        weight_versions: Sequence[int] | None = None,
        teacher_topk_ids: Sequence[Sequence[Sequence[int]]] | None = None,
        teacher_topk_logprobs: Sequence[Sequence[Sequence[float]]] | None = None,
        **token_fields: Sequence[Sequence[float]] | None,
    ) -> TrainBatch:
        """Pack per-sequence lists (``tokens[i]``, ``loss_mask[i]`` ...); a misaligned row names its field and
        sequence."""
        import torch

        if len(prompt_lengths) != len(tokens) or len(loss_mask) != len(tokens):
            raise ValueError("TrainBatch.tokens, prompt_lengths and loss_mask must have one entry per sequence")
        unknown = sorted(set(token_fields) - set(TOKEN_FIELDS))
        if unknown:
            raise ValueError(f"TrainBatch has no per-token field {unknown[0]!r} ({', '.join(TOKEN_FIELDS)})")
        lengths = [len(t) - p for t, p in zip(tokens, prompt_lengths, strict=True)]
        packed: dict[str, Any] = {
            name: _pack_rows(name, rows, lengths) for name, rows in token_fields.items() if rows is not None
        }
        if (teacher_topk_ids is None) != (teacher_topk_logprobs is None):
            raise ValueError("TrainBatch.teacher_topk_ids and teacher_topk_logprobs must be set together")
        if teacher_topk_ids is not None and teacher_topk_logprobs is not None:
            packed["teacher_topk_ids"] = _pack_topk("teacher_topk_ids", teacher_topk_ids, lengths, torch.int64)
            packed["teacher_topk_logprobs"] = _pack_topk(
                "teacher_topk_logprobs", teacher_topk_logprobs, lengths, torch.float32
            )
            if packed["teacher_topk_ids"].shape != packed["teacher_topk_logprobs"].shape:
                raise ValueError("TrainBatch.teacher_topk_ids and teacher_topk_logprobs must have one k")
        flat = [t for seq in tokens for t in seq]
        return cls(
            tokens=_tensor(flat, torch.int64),
            seq_offsets=torch.tensor([0, *[len(t) for t in tokens]], dtype=torch.int64).cumsum(0),
            prompt_lengths=_tensor(list(prompt_lengths), torch.int64),
            loss_mask=_pack_rows("loss_mask", loss_mask, lengths),
            weight_versions=None if weight_versions is None else _tensor(list(weight_versions), torch.int64),
            **packed,
        )

    @classmethod
    def from_samples(cls, samples: Sequence[Sample], advantages: Sequence[Sequence[float]] | None = None) -> TrainBatch:
        """Build a batch from samples (rollout logprobs, the teacher's logprobs / top-k, the response
        tensors, the engine's logit masks and routed experts are taken from them)."""
        teacher = [s.teacher_logprobs for s in samples]
        topk_ids = [s.teacher_topk_ids for s in samples]
        topk_logprobs = [s.teacher_topk_logprobs for s in samples]
        has_topk = bool(samples) and all(t is not None for t in topk_ids) and all(t is not None for t in topk_logprobs)
        batch = cls.from_lists(
            tokens=[s.tokens for s in samples],
            prompt_lengths=[len(s.prompt_ids) for s in samples],
            loss_mask=[s.loss_mask for s in samples],
            weight_versions=[v if (v := s.oldest_weight_version) is not None else -1 for s in samples],
            teacher_topk_ids=[t for t in topk_ids if t is not None] if has_topk else None,
            teacher_topk_logprobs=[t for t in topk_logprobs if t is not None] if has_topk else None,
            advantages=advantages,
            rollout_logprobs=[s.rollout_logprobs for s in samples],
            teacher_logprobs=None if any(t is None for t in teacher) else teacher,  # type: ignore[arg-type]
        )
        if any(s.response_tensors for s in samples):
            batch.response_tensors = _pack_response_tensors(samples)
        masks = pack_logit_masks(samples)
        if masks is not None:
            batch.response_tensors[LOGIT_MASK_IDS] = masks
        requests = pack_request_spans(samples)
        if requests is not None:
            batch.response_tensors[REQUEST_INDEX] = requests
        routed = pack_routed_experts(samples)
        if routed is not None:
            batch.token_tensors[ROUTED_EXPERTS] = routed
        if batch.response_tensors or batch.token_tensors:
            batch.__post_init__()  # check them against the packed sequences
        return batch
