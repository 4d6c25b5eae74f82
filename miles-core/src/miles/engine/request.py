"""One generation request inside the engine: its tokens, sampling state, logprobs and weight spans."""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from miles.rollout.protocol import FinishReason, SamplingParams

if TYPE_CHECKING:
    import torch

    from miles.engine.multimodal import ImageInputs
    from miles.engine.sampling import KeptSet

__all__ = ["Request"]


def _with_text(
    top: list[tuple[float, int]] | None, decode_each: Callable[[list[int]], list[str]]
) -> list[list[Any]] | None:
    """SGLang's entry of one position's top tokens: ``[[logprob, token_id, text], ...]`` (``None`` stays)."""
    if top is None:
        return None
    texts = decode_each([tok for _, tok in top])
    return [[lp, tok, txt] for (lp, tok), txt in zip(top, texts, strict=True)]


@dataclass
class Request:
    """A single completion (one of the ``n`` of a ``/generate`` prompt), owned by the scheduler thread.

    The sequence is ``prompt_ids + output_ids``; positions ``< kv_len`` are in the KV buffer and the last
    token is fed by the next decode step.
    """

    rid: str
    parent_rid: str
    index: int
    prompt_ids: list[int]
    config: SamplingParams
    sink: Callable[[Request, bool], None]
    """Called on the scheduler thread after each new token (streaming) and once when done."""
    return_logprob: bool = False
    logprob_start_len: int = -1
    return_routed_experts: bool = False
    return_original_logprob: bool = False
    top_logprobs_num: int = 0
    """SGLang's ``top_logprobs_num``: report the ``k`` most likely tokens at each position (with
    ``return_logprob``)."""
    return_sampling_mask: str | None = None
    """SGLang's ``return_sampling_mask``, as its ``sampling_logprobs_mode``: ``selected`` or ``support`` (report
    each output token's kept set, :class:`~miles.engine.sampling.KeptSet`), or ``None``."""
    stream: bool = False
    lora_name: str | None = None
    """SGLang's ``lora_path``: the LoRA adapter this request is generated with (``None``: the base model)."""
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    raw_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    output_kept: list[KeptSet] = field(default_factory=list)
    """Each output token's kept set (with ``return_sampling_mask``)."""
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    cached_tokens: int = 0
    admitted: bool = False
    kv_len: int = 0
    routed: list[torch.Tensor] = field(default_factory=list)
    spans: list[list[Any]] = field(default_factory=list)
    """``[start, end, weight_version]`` of response tokens sampled under each weight version."""
    finish_reason: FinishReason | None = None
    """Why generation stopped (``None`` while it runs)."""
    text: str = ""
    generator: torch.Generator | None = None
    images: ImageInputs | None = None
    """The prompt's images (a vision-language model), shared by the ``n`` requests of one prompt."""

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def cache_tokens(self) -> list[int]:
        """The prefix-cache key of :attr:`tokens`: the tokens, with image placeholders standing for their
        image's content hash (:mod:`miles.engine.multimodal`)."""
        return self.tokens if self.images is None else self.images.key_ids + self.output_ids

    @property
    def rope_delta(self) -> int:
        """Rotary position minus sequence position past the prompt (M-RoPE; 0 without images)."""
        return 0 if self.images is None else self.images.rope_delta

    @property
    def last_token(self) -> int:
        """The token the next decode step feeds."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def record_token(self, token: int, logprob: float, raw: float, version: str, kept: KeptSet | None = None) -> None:
        position = len(self.output_ids)
        self.output_ids.append(token)
        if kept is not None:
            self.output_kept.append(kept)
        self.output_logprobs.append(logprob)
        self.raw_logprobs.append(raw)
        if self.spans and self.spans[-1][2] == version and self.spans[-1][1] == position:
            self.spans[-1][1] = position + 1
        else:
            self.spans.append([position, position + 1, version])

    def to_response(self, decode_each: Callable[[list[int]], list[str]], weight_version: str) -> dict[str, Any]:
        """The ``/generate`` response entry (SGLang's shape); ``decode_each`` gives each token's text."""
        logprobs = self.raw_logprobs if self.return_original_logprob else self.output_logprobs
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": None if self.finish_reason is None else self.finish_reason.to_json(),
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "weight_version": weight_version,
            "weight_version_spans": [list(span) for span in self.spans],
        }
        if self.return_logprob:
            texts = decode_each(self.output_ids)
            meta["output_token_logprobs"] = [
                [lp, tok, txt] for lp, tok, txt in zip(logprobs, self.output_ids, texts, strict=True)
            ]
            if self.input_logprobs is not None:
                start = max(self.logprob_start_len, 0)
                prompt = self.prompt_ids[start:]
                meta["input_token_logprobs"] = [
                    [lp, tok, txt]
                    for lp, tok, txt in zip(self.input_logprobs, prompt, decode_each(prompt), strict=True)
                ]
        if self.return_logprob and self.top_logprobs_num > 0:
            meta["output_top_logprobs"] = [_with_text(top, decode_each) for top in self.output_top_logprobs]
            if self.input_logprobs is not None:
                tops = self.input_top_logprobs or [None] * len(self.input_logprobs)
                meta["input_top_logprobs"] = [_with_text(top, decode_each) for top in tops]
        if self.return_sampling_mask is not None:
            meta["output_token_sampling_mask"] = [k.token_ids for k in self.output_kept]
            meta["output_token_sampling_logprobs"] = [
                k.support_logprobs if self.return_sampling_mask == "support" else k.selected_logprob
                for k in self.output_kept
            ]
            meta["output_token_sampling_mask_length"] = len(self.output_kept)
        if self.return_routed_experts and self.routed:
            import torch

            array = torch.cat(self.routed, dim=0).to(torch.int32).contiguous().numpy()
            meta["routed_experts"] = base64.b64encode(array.tobytes()).decode("ascii")
            meta["routed_experts_shape"] = list(array.shape)
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}
