"""The data model: one trajectory as the engine produced it (:class:`Sample`) and its group.

A :class:`Sample` is the training data. Its token ids are exactly what the engine consumed and produced,
so nothing downstream re-tokenises text. Everything it holds survives :meth:`Sample.to_dict` /
:meth:`Sample.from_dict` (and therefore JSONL files and checkpoints) exactly: floats are kept as Python
floats (IEEE doubles), which JSON round-trips bit for bit.
"""

from __future__ import annotations

import base64
import enum
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

__all__ = [
    "LogitMask",
    "PauseMode",
    "PushReport",
    "Sample",
    "SampleGroup",
    "SampleStatus",
    "TensorData",
    "WeightSpan",
    "group_samples",
]


PauseMode = Literal["abort", "retract", "in_place"]
"""How ``/pause_generation`` treats requests in flight (SGLang's modes): ``abort`` them, ``retract`` them
(their KV is recomputed after the pause) or keep them ``in_place``."""


class SampleStatus(str, enum.Enum):
    """How a trajectory ended."""

    PENDING = "pending"
    """Not generated yet (a prompt waiting in the rollout manager)."""
    COMPLETED = "completed"
    """The policy stopped on its own (EOS, a stop string or a stop token)."""
    TRUNCATED = "truncated"
    """Generation hit ``max_new_tokens`` or the context length."""
    ABORTED = "aborted"
    """The engine aborted the request (pause in ``abort`` mode, ``/abort_request``, shutdown)."""
    FAILED = "failed"
    """Something other than the policy failed (the engine, a tool, a reward); ``status_reason`` says what."""


@dataclass(frozen=True)
class WeightSpan:
    """Response tokens ``[start, end)`` were sampled under weight version ``version``."""

    start: int
    end: int
    version: int

    def to_list(self) -> list[int]:
        return [self.start, self.end, self.version]

    @classmethod
    def from_list(cls, value: Sequence[int]) -> WeightSpan:
        start, end, version = value
        return cls(int(start), int(end), int(version))


@dataclass(frozen=True)
class LogitMask:
    """Token ids the engine masked out (logit ``-inf``) before sampling and reporting the logprobs of response
    tokens ``[start, end)``: EOS and ``stop_token_ids`` before ``min_new_tokens``. The trainer applies the same
    mask, so its logprobs are those of the distribution the engine reported."""

    token_ids: tuple[int, ...]
    start: int
    end: int

    def to_list(self) -> list[Any]:
        return [list(self.token_ids), self.start, self.end]

    @classmethod
    def from_list(cls, value: Sequence[Any]) -> LogitMask:
        ids, start, end = value
        return cls(tuple(int(t) for t in ids), int(start), int(end))


_TENSOR_DTYPES = {
    "float32": 4,
    "float64": 8,
    "bfloat16": 2,
    "float16": 2,
    "int64": 8,
    "int32": 4,
    "uint8": 1,
    "bool": 1,
}


@dataclass(frozen=True)
class TensorData:
    """A tensor as raw bytes: C order, little-endian, its dtype name and shape (JSON: base64).

    What a sample carries besides token lists (a diffusion trajectory's latents); built from and turned
    back into a tensor by the code that uses it, so this module needs no torch.
    """

    dtype: str
    """``float32``, ``bfloat16``, ``int64`` ... (torch's names without ``torch.``)."""
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        size = _TENSOR_DTYPES.get(self.dtype)
        if size is None:
            raise ValueError(f"TensorData.dtype {self.dtype!r} is not one of {', '.join(_TENSOR_DTYPES)}")
        count = 1
        for n in self.shape:
            count *= int(n)
        if count * size != len(self.data):
            raise ValueError(
                f"TensorData of shape {self.shape} and dtype {self.dtype} needs {count * size} bytes, got {len(self.data)}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "data": base64.b64encode(self.data).decode("ascii")}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TensorData:
        try:
            return cls(str(data["dtype"]), tuple(int(n) for n in data["shape"]), base64.b64decode(data["data"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"TensorData needs dtype, shape and data (base64): {exc}") from None


@dataclass
class Sample:
    """One trajectory: a prompt and the engine's response, token-exact.

    ``response_ids``, ``rollout_logprobs`` and ``loss_mask`` are aligned: one entry per response token.
    In a multi-turn episode the response holds every turn after the first prompt; tokens the policy did
    not sample (tool output, environment or user turns) have ``loss_mask`` 0 and ``rollout_logprobs`` 0.0.
    """

    prompt_ids: list[int]
    """Prompt token ids, chat template already applied."""
    response_ids: list[int] = field(default_factory=list)
    """Response token ids as the engine produced them (and, multi-turn, the environment's tokens)."""
    rollout_logprobs: list[float] = field(default_factory=list)
    """Per-token logprob of each response token under the distribution it was sampled from."""
    loss_mask: list[int] = field(default_factory=list)
    """Per response token: 1 = sampled by the policy (trained on), 0 = environment / tool / user tokens."""
    reward: float | None = None
    """Scalar reward; ``None`` until scored."""
    reward_parts: dict[str, float] = field(default_factory=dict)
    """Named parts of the reward (one per reward function of a combined reward)."""
    status: SampleStatus = SampleStatus.PENDING
    """How the trajectory ended."""
    status_reason: str = ""
    """Why, for aborted / failed samples (e.g. ``"reward 'math' timed out after 5.0s"``)."""
    group_id: int = 0
    """All samples generated for one prompt share a group id."""
    index: int = 0
    """Index of the sample within its group."""
    prompt: str = ""
    """The prompt as text (for logs and rewards; never re-tokenised): for a chat prompt, the text of its
    last user message."""
    prompt_messages: list[dict[str, Any]] | None = None
    """The prompt as chat messages (``data.system_prompt`` first, when set) when the data set gave messages
    or a system prompt; ``None`` for a plain-text prompt. Agent episodes start from it
    (:attr:`miles.sessions.rollout.EpisodeContext.messages`)."""
    response: str = ""
    """The response as text (decoded by the engine)."""
    label: Any = None
    """The data set's label for the prompt (reference answer, test cases ...), JSON-serialisable."""
    weight_versions: list[WeightSpan] = field(default_factory=list)
    """Which weight version produced which span of the response (several after a mid-rollout update)."""
    request_spans: list[tuple[int, int]] = field(default_factory=list)
    """The response positions ``[start, end)`` each engine request sampled, in order: one per policy turn of
    a multi-turn session (the tool, user and template tokens in between were not sampled). Empty: one
    request sampled the whole response. True on-policy replays each request as the engine ran it."""
    logit_masks: list[LogitMask] = field(default_factory=list)
    """Token ids the engine masked out of the distribution of some response positions (EOS before
    ``min_new_tokens``); the trainer scores the same masked distribution."""
    sampling_mask: list[list[int]] | None = None
    """Sampling-mask replay (``rollout.replay_sampling_mask``): per response token, the token ids the engine
    kept under top-k / top-p / min-p and drew it from (its ``output_token_sampling_mask``); an empty row
    (a token the policy did not sample) leaves the distribution whole. The trainer renormalises over it."""
    routed_experts: bytes | None = None
    """MoE routing replay: int32 array (tokens x layers x topk), raw bytes, as the engine returned it: row ``t``
    is the routing of sequence position ``t`` (the prompt's positions, then the response's; the last token,
    never fed to the model, has none)."""
    routed_experts_shape: tuple[int, int, int] | None = None
    """Shape of ``routed_experts``: (tokens, layers, topk)."""
    teacher_logprobs: list[float] | None = None
    """Per response token logprob under a teacher model (on-policy distillation)."""
    teacher_topk_ids: list[list[int]] | None = None
    """Per response token, the teacher's ``k`` most likely token ids at that position, most likely first
    (top-k distillation); every row has the same ``k``."""
    teacher_topk_logprobs: list[list[float]] | None = None
    """The teacher's logprobs of ``teacher_topk_ids``, aligned with it."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Free, JSON-serialisable data (data set row fields, tool traces, timings)."""
    response_tensors: dict[str, TensorData] = field(default_factory=dict)
    """Per response token tensors beyond the token lists, by name, each with the response length as its first
    dimension (a diffusion trajectory's latents before and after each denoising step). They reach the
    trainer as :attr:`miles.training.batch.TrainBatch.response_tensors`."""

    # -- derived ----------------------------------------------------------------------------------
    @property
    def tokens(self) -> list[int]:
        """Prompt followed by response: the sequence the trainer sees."""
        return self.prompt_ids + self.response_ids

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @property
    def oldest_weight_version(self) -> int | None:
        """The oldest weight version that produced any part of the response (for staleness)."""
        return min((span.version for span in self.weight_versions), default=None)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field when the per-token lists are not aligned."""
        n = len(self.response_ids)
        for name in ("rollout_logprobs", "loss_mask"):
            value = getattr(self, name)
            if len(value) != n:
                raise ValueError(f"Sample.{name} has {len(value)} entries, response_ids has {n}")
        if self.teacher_logprobs is not None and len(self.teacher_logprobs) != n:
            raise ValueError(f"Sample.teacher_logprobs has {len(self.teacher_logprobs)} entries, response_ids has {n}")
        self._validate_teacher_topk(n)
        for name, tensor in self.response_tensors.items():
            if not tensor.shape or tensor.shape[0] != n:
                raise ValueError(
                    f"Sample.response_tensors[{name!r}] has shape {tensor.shape}, response_ids has {n} entries "
                    "(the first dimension must be the response length)"
                )
        end = 0
        for start, stop in self.request_spans:
            if not end <= start <= stop <= n:
                raise ValueError(
                    f"Sample.request_spans: [{start}, {stop}) is not an ordered, non-overlapping span of the {n} "
                    "response tokens"
                )
            end = stop
        if self.sampling_mask is not None and len(self.sampling_mask) != n:
            raise ValueError(f"Sample.sampling_mask has {len(self.sampling_mask)} rows, response_ids has {n} entries")
        for mask in self.logit_masks:
            if not 0 <= mask.start <= mask.end <= n:
                raise ValueError(
                    f"Sample.logit_masks: positions [{mask.start}, {mask.end}) are outside the {n} response tokens"
                )
        if self.routed_experts is not None:
            if self.routed_experts_shape is None:
                raise ValueError("Sample.routed_experts is set but routed_experts_shape is not")
            t, layers, k = self.routed_experts_shape
            if t * layers * k * 4 != len(self.routed_experts):
                raise ValueError(
                    f"Sample.routed_experts holds {len(self.routed_experts)} bytes, "
                    f"shape {self.routed_experts_shape} needs {t * layers * k * 4}"
                )

    def _validate_teacher_topk(self, n: int) -> None:
        ids, logprobs = self.teacher_topk_ids, self.teacher_topk_logprobs
        if (ids is None) != (logprobs is None):
            raise ValueError("Sample.teacher_topk_ids and teacher_topk_logprobs must be set together")
        if ids is None or logprobs is None:
            return
        for name, rows in (("teacher_topk_ids", ids), ("teacher_topk_logprobs", logprobs)):
            if len(rows) != n:
                raise ValueError(f"Sample.{name} has {len(rows)} rows, response_ids has {n}")
        k = len(ids[0]) if ids else 0
        for t, (row_ids, row_lps) in enumerate(zip(ids, logprobs, strict=True)):
            if len(row_ids) != k or len(row_lps) != k or k == 0:
                raise ValueError(
                    f"Sample.teacher_topk_ids / teacher_topk_logprobs row {t} has {len(row_ids)} / {len(row_lps)} "
                    f"entries; every row needs the same k >= 1 ({k} in row 0)"
                )

    @property
    def teacher_topk(self) -> int:
        """``k`` of the teacher's top-k rows (0 when there are none)."""
        return len(self.teacher_topk_ids[0]) if self.teacher_topk_ids else 0

    # -- (de)serialisation -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict from which :meth:`from_dict` rebuilds an equal sample."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "status":
                value = value.value
            elif f.name == "weight_versions":
                value = [span.to_list() for span in value]
            elif f.name == "logit_masks":
                value = [mask.to_list() for mask in value]
            elif f.name == "routed_experts":
                value = None if value is None else base64.b64encode(value).decode("ascii")
            elif f.name == "routed_experts_shape":
                value = None if value is None else list(value)
            elif f.name == "response_tensors":
                value = {name: tensor.to_dict() for name, tensor in value.items()}
            elif isinstance(value, (list, dict)):
                value = json.loads(json.dumps(value))  # detach from the sample
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown Sample field(s): {', '.join(unknown)}")
        if "prompt_ids" not in data:
            raise ValueError("Sample field 'prompt_ids' is required")
        kwargs = dict(data)
        if "status" in kwargs:
            kwargs["status"] = SampleStatus(kwargs["status"])
        if "weight_versions" in kwargs:
            kwargs["weight_versions"] = [WeightSpan.from_list(v) for v in kwargs["weight_versions"]]
        if "request_spans" in kwargs:
            kwargs["request_spans"] = [(int(a), int(b)) for a, b in kwargs["request_spans"]]
        if "logit_masks" in kwargs:
            kwargs["logit_masks"] = [LogitMask.from_list(v) for v in kwargs["logit_masks"]]
        if kwargs.get("routed_experts") is not None:
            kwargs["routed_experts"] = base64.b64decode(kwargs["routed_experts"])
        if kwargs.get("routed_experts_shape") is not None:
            kwargs["routed_experts_shape"] = tuple(int(v) for v in kwargs["routed_experts_shape"])
        if "response_tensors" in kwargs:
            kwargs["response_tensors"] = {n: TensorData.from_dict(t) for n, t in kwargs["response_tensors"].items()}
        if "rollout_logprobs" in kwargs:
            kwargs["rollout_logprobs"] = [float(v) for v in kwargs["rollout_logprobs"]]
        if kwargs.get("teacher_logprobs") is not None:
            kwargs["teacher_logprobs"] = [float(v) for v in kwargs["teacher_logprobs"]]
        if kwargs.get("sampling_mask") is not None:
            kwargs["sampling_mask"] = [[int(v) for v in row] for row in kwargs["sampling_mask"]]
        if kwargs.get("teacher_topk_ids") is not None:
            kwargs["teacher_topk_ids"] = [[int(v) for v in row] for row in kwargs["teacher_topk_ids"]]
        if kwargs.get("teacher_topk_logprobs") is not None:
            kwargs["teacher_topk_logprobs"] = [[float(v) for v in row] for row in kwargs["teacher_topk_logprobs"]]
        return cls(**kwargs)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, allow_nan=True)

    @classmethod
    def from_json(cls, line: str) -> Sample:
        return cls.from_dict(json.loads(line))


@dataclass
class SampleGroup:
    """The samples generated for one prompt; advantages are computed over a group."""

    group_id: int
    samples: list[Sample]

    def __iter__(self) -> Iterator[Sample]:
        return iter(self.samples)

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def rewards(self) -> list[float]:
        """Rewards of the group's samples; an unscored sample counts as 0.0."""
        return [0.0 if s.reward is None else float(s.reward) for s in self.samples]

    @property
    def scored(self) -> list[bool]:
        """Which samples' rewards count in the group's statistics (its mean and spread for advantages, whether
        they differ): those with a reward, but a failed or aborted one (its reward is missing, not 0, and it
        trains on nothing)."""
        unscored = (SampleStatus.FAILED, SampleStatus.ABORTED)
        return [s.reward is not None and s.status not in unscored for s in self.samples]

    def to_dict(self) -> dict[str, Any]:
        return {"group_id": self.group_id, "samples": [s.to_dict() for s in self.samples]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SampleGroup:
        return cls(int(data["group_id"]), [Sample.from_dict(s) for s in data["samples"]])


def group_samples(samples: Iterable[Sample]) -> list[SampleGroup]:
    """Group samples by ``group_id``, keeping first-seen group order and index order within a group."""
    groups: dict[int, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(sample.group_id, []).append(sample)
    return [SampleGroup(gid, sorted(members, key=lambda s: s.index)) for gid, members in groups.items()]


@dataclass
class PushReport:
    """What one weight push moved (rank 0's view); handed to ``miles_on_weights_pushed``."""

    version: str
    num_tensors: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    checksums: dict[str, str] = field(default_factory=dict)
    """Per tensor name, a checksum of what was sent (compared with what the engines report)."""
    verification: dict[str, float] = field(default_factory=dict)
    """Metrics of the verification that followed the push (filled by the driver)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The transport's own metrics of the push (``weight_sync/bytes_written`` ...), logged with the step's."""
