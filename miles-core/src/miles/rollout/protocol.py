"""SGLang's native ``/generate`` protocol as typed values.

Both engines Miles drives speak it: the local engine (``miles serve``) and SGLang servers. Field names
are SGLang's (``srt/managers/io_struct.py``): a request carries ``input_ids`` and ``sampling_params``;
the response carries ``text``, ``output_ids`` and ``meta_info`` with ``output_token_logprobs`` as
``[logprob, token_id, text | None]`` triples, ``finish_reason`` and ``weight_version``.
"""

from __future__ import annotations

import base64
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from miles.types import PauseMode

__all__ = ["INSTANCE_HEADER", "LAUNCH_WEIGHT_VERSION", "FinishReason", "GenerateOutput", "PauseMode", "SamplingParams"]

INSTANCE_HEADER = "x-miles-instance"
"""A Miles addition: the header in which the local engine's ``/health`` names its process (a random id made
at start), so that a client tells a restarted engine from the one it knew at the same URL. SGLang sends
none: its restarts are told by :data:`LAUNCH_WEIGHT_VERSION`."""

LAUNCH_WEIGHT_VERSION = "0"
"""The weight version every engine of a run starts with (the local engine's default; ``--weight-version 0`` on
SGLang's command line). Pushes bring step numbers from 1 on, so an engine that reports this version after a
verified push is a new process at the engine's URL, serving the weights it loaded at start."""


@dataclass
class SamplingParams:
    """SGLang ``sampling_params`` (only keys SGLang accepts; unknown keys are a 400 there): what the engine
    client sends and what the local engine parses a request into."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    sampling_seed: int | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    @property
    def greedy(self) -> bool:
        """Temperature 0 (or top-k 1): the most likely token, scored at temperature 1."""
        return self.temperature <= 1e-6 or self.top_k == 1

    def to_json(self) -> dict[str, Any]:
        """The dict sent on the wire, without keys left at ``None`` or empty."""
        return {k: v for k, v in asdict(self).items() if v is not None and v != []}


@dataclass(frozen=True)
class FinishReason:
    """``meta_info.finish_reason``: ``stop`` (with what matched), ``length`` or ``abort``."""

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> FinishReason:
        if data is None:
            return cls("abort", message="no finish_reason in the response")
        return cls(data["type"], matched=data.get("matched"), length=data.get("length"), message=data.get("message"))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type == "stop":
            out["matched"] = self.matched
        elif self.type == "length":
            out["length"] = self.length
        else:
            out["message"] = self.message
        return out


@dataclass
class GenerateOutput:
    """One completion as returned by ``/generate`` (one entry of a batch response)."""

    text: str
    output_ids: list[int]
    output_logprobs: list[float]
    """Logprob of each output token (``meta_info.output_token_logprobs[i][0]``)."""
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    weight_version: str | None = None
    input_logprobs: list[float | None] | None = None
    """Logprobs of prompt tokens from ``logprob_start_len`` on (the first prompt token has none)."""
    routed_experts: bytes | None = None
    """int32 array (tokens x layers x topk) when ``return_routed_experts`` was asked."""
    rid: str | None = None
    weight_version_spans: list[tuple[int, int, str]] | None = None
    """``(start, end, version)``: output tokens ``[start, end)`` were sampled under weight ``version`` (the
    local engine's ``meta_info.weight_version_spans``, or SGLang's ``meta_info.weight_versions``: objects with
    ``version``, ``start`` and ``end``, sent once the weights changed under a request; ``None`` when neither
    is sent)."""
    sampling_mask: list[list[int]] | None = None
    """Each output token's kept set under top-k / top-p / min-p, most likely first
    (``meta_info.output_token_sampling_mask``, with ``return_sampling_mask``)."""
    sampling_logprobs: list[float] | None = None
    """Each output token's behaviour logprob: under its kept set renormalised
    (``meta_info.output_token_sampling_logprobs`` in SGLang's default ``selected`` mode)."""
    meta_info: dict[str, Any] = field(default_factory=dict)
    """The raw ``meta_info`` for fields not mapped above."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GenerateOutput:
        meta = data.get("meta_info", {})
        triples = meta.get("output_token_logprobs") or []
        ids = data.get("output_ids")
        if ids is None:
            ids = [int(t[1]) for t in triples]
        input_lp = meta.get("input_token_logprobs")
        routed = meta.get("routed_experts")
        spans = meta.get("weight_version_spans")
        if spans is None and meta.get("weight_versions"):  # SGLang (0.5.23: utils/weight_versions.py)
            spans = [(s["start"], s["end"], s["version"]) for s in meta["weight_versions"]]
        masks, behaviour = meta.get("output_token_sampling_mask"), meta.get("output_token_sampling_logprobs")
        return cls(
            text=data.get("text", ""),
            output_ids=[int(t) for t in ids],
            output_logprobs=[float(t[0]) for t in triples],
            finish_reason=FinishReason.from_json(meta.get("finish_reason")),
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            completion_tokens=int(meta.get("completion_tokens", len(ids))),
            cached_tokens=int(meta.get("cached_tokens", 0)),
            weight_version=None if meta.get("weight_version") is None else str(meta["weight_version"]),
            input_logprobs=None if input_lp is None else [None if t[0] is None else float(t[0]) for t in input_lp],
            routed_experts=None if routed is None else base64.b64decode(routed),
            rid=meta.get("id"),
            weight_version_spans=None if spans is None else [(int(a), int(b), str(v)) for a, b, v in spans],
            sampling_mask=None if masks is None else [[int(t) for t in row] for row in masks],
            sampling_logprobs=None if behaviour is None else [float(v) for v in behaviour],
            meta_info=meta,
        )
