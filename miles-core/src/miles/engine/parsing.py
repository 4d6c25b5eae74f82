"""Parsing and validating ``/generate`` bodies (SGLang's ``GenerateReqInput``) into engine requests.

Bad input raises :class:`RequestError`, which the server turns into HTTP 400 with SGLang's error shape
``{"error": {"message": ...}}``. Unknown ``sampling_params`` keys are errors (as in SGLang); unknown
top-level keys are ignored.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from miles.engine.request import Request
from miles.rollout.protocol import SamplingParams

if TYPE_CHECKING:
    from miles.engine.multimodal import ImageInputs, ImageParser

__all__ = ["MAX_N", "GenerateBatch", "RequestError", "parse_generate"]

MAX_N = 256
"""The most completions one prompt may ask for (``sampling_params.n``): beyond it a request is refused."""

_SAMPLING_KEYS = {f.name for f in fields(SamplingParams)}
# keys SGLang accepts that this engine takes but does not act on (they do not change the distribution)
_ACCEPTED_NOOP = {"spaces_between_special_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty"}


class RequestError(ValueError):
    """A malformed request (HTTP 400)."""


@dataclass
class GenerateBatch:
    """The parsed requests of one ``/generate`` call and how to shape the answer."""

    requests: list[Request]
    batched: bool
    stream: bool


def _int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise RequestError(f"{what} must be a list of integers")
    return value


def _sampling(raw: Any) -> SamplingParams:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RequestError("sampling_params must be an object")
    unknown = sorted(set(raw) - _SAMPLING_KEYS - _ACCEPTED_NOOP)
    if unknown:
        raise RequestError(f"sampling_params: unknown key(s) {', '.join(unknown)}")
    for key in ("presence_penalty", "frequency_penalty"):
        if raw.get(key) not in (None, 0, 0.0):
            raise RequestError(f"sampling_params.{key} is not supported by the local engine (only 0)")
    if raw.get("repetition_penalty") not in (None, 1, 1.0):
        raise RequestError("sampling_params.repetition_penalty is not supported by the local engine (only 1)")
    values = {k: v for k, v in raw.items() if k in _SAMPLING_KEYS and v is not None}
    stop = values.get("stop")
    if isinstance(stop, str):
        values["stop"] = [stop]
    try:
        cfg = SamplingParams(**values)
    except TypeError as exc:
        raise RequestError(f"sampling_params: {exc}") from None
    checks: list[tuple[bool, str]] = [
        (isinstance(cfg.max_new_tokens, int) and cfg.max_new_tokens >= 0, "max_new_tokens must be an integer >= 0"),
        (isinstance(cfg.min_new_tokens, int) and cfg.min_new_tokens >= 0, "min_new_tokens must be an integer >= 0"),
        (isinstance(cfg.temperature, (int, float)) and cfg.temperature >= 0, "temperature must be >= 0"),
        (isinstance(cfg.top_p, (int, float)) and 0 < cfg.top_p <= 1, "top_p must be in (0, 1]"),
        (isinstance(cfg.top_k, int) and (cfg.top_k == -1 or cfg.top_k >= 1), "top_k must be -1 or >= 1"),
        (isinstance(cfg.min_p, (int, float)) and 0 <= cfg.min_p <= 1, "min_p must be in [0, 1]"),
        (isinstance(cfg.n, int) and 1 <= cfg.n <= MAX_N, f"n must be an integer in [1, {MAX_N}]"),
        (cfg.sampling_seed is None or isinstance(cfg.sampling_seed, int), "sampling_seed must be an integer"),
        (
            isinstance(cfg.stop, list) and all(isinstance(s, str) and s for s in cfg.stop),
            "stop must be a list of strings",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise RequestError(f"sampling_params.{message}")
    cfg.stop_token_ids = _int_list(cfg.stop_token_ids, "sampling_params.stop_token_ids")
    cfg.min_new_tokens = min(cfg.min_new_tokens, cfg.max_new_tokens)
    return cfg


def _top_logprobs_nums(raw: Any, count: int, vocab_size: int) -> list[int]:
    """SGLang's ``top_logprobs_num``: one integer for every prompt or a list with one per prompt."""
    values = raw if isinstance(raw, list) else [raw] * count
    if len(values) != count:
        raise RequestError(f"top_logprobs_num: a list must have one entry per prompt ({len(values)} for {count})")
    out = []
    for value in values:
        if value is None:
            value = 0
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise RequestError(f"top_logprobs_num must be an integer >= 0, got {value!r}")
        if value > vocab_size:
            raise RequestError(f"top_logprobs_num {value} exceeds the vocabulary size {vocab_size}")
        out.append(value)
    return out


def _sampling_mask_modes(body: dict[str, Any], count: int) -> list[str | None]:
    """SGLang's ``return_sampling_mask`` (a bool, or one per prompt) and ``sampling_logprobs_mode``
    (``selected``, the default, or ``support``; one or one per prompt, only with the former): per prompt,
    the mode of the kept sets to report, or ``None``."""
    raw, modes = body.get("return_sampling_mask"), body.get("sampling_logprobs_mode")
    wants = raw if isinstance(raw, list) else [raw] * count
    chosen = modes if isinstance(modes, list) else [modes] * count
    if len(wants) != count or len(chosen) != count:
        raise RequestError("return_sampling_mask / sampling_logprobs_mode: a list must have one entry per prompt")
    if not all(w is None or isinstance(w, bool) for w in wants):
        raise RequestError("return_sampling_mask must be a boolean or a list of booleans (one per prompt)")
    out: list[str | None] = []
    for want, mode in zip(wants, chosen, strict=True):
        if mode is not None and mode not in ("selected", "support"):
            raise RequestError(f"sampling_logprobs_mode must be 'selected' or 'support', got {mode!r}")
        if mode is not None and not want:
            raise RequestError("sampling_logprobs_mode can only be set when return_sampling_mask is true")
        out.append((mode or "selected") if want else None)
    return out


def _images(
    image_data: Any, prompts: list[list[int]], batched: bool, parser: ImageParser | None
) -> list[ImageInputs | None]:
    """Each prompt's images (``prompts`` expanded in place); a text model refuses ``image_data``."""
    if parser is None:
        if image_data not in (None, []):
            raise RequestError("image_data: the served model is not a vision-language model")
        return [None] * len(prompts)
    from miles.engine.multimodal import image_lists

    try:
        lists = image_lists(image_data, len(prompts), batched)
        out: list[ImageInputs | None] = []
        for i, refs in enumerate(lists):
            prompts[i], inputs = parser(refs, prompts[i], f"input_ids[{i}]" if batched else "input_ids")
            out.append(inputs)
    except ValueError as exc:
        raise RequestError(str(exc)) from None
    return out


def parse_generate(
    body: Any,
    *,
    encode: Callable[[str], list[int]],
    vocab_size: int,
    context_length: int,
    sink_factory: Callable[[int], Callable[[Request, bool], None]],
    return_original_logprob_default: bool = False,
    images: ImageParser | None = None,
) -> GenerateBatch:
    """Turn a ``/generate`` body into :class:`Request` objects (``n`` per prompt, in order).

    :param sink_factory: ``sink_factory(i)`` is the sink of the ``i``-th request of the answer.
    :param images: the served vision-language model's ``image_data`` parser (``None``: a text model, which
        refuses ``image_data``).
    """
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    ids, text = body.get("input_ids"), body.get("text")
    if (ids is None) == (text is None):
        raise RequestError("exactly one of input_ids or text must be given")
    if ids is not None:
        batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        prompts = (
            [_int_list(p, f"input_ids[{i}]") for i, p in enumerate(ids)] if batched else [_int_list(ids, "input_ids")]
        )
    else:
        batched = isinstance(text, list)
        texts: list[Any] = text if isinstance(text, list) else [text]
        if not all(isinstance(t, str) for t in texts):
            raise RequestError("text must be a string or a list of strings")
        prompts = [encode(t) for t in texts]
    if not prompts:
        raise RequestError("empty batch")
    image_inputs = _images(body.get("image_data"), prompts, batched, images)
    raw_params = body.get("sampling_params")
    params_list = raw_params if isinstance(raw_params, list) else [raw_params] * len(prompts)
    if len(params_list) != len(prompts):
        raise RequestError("sampling_params: a list must have one entry per prompt")
    configs = [_sampling(p) for p in params_list]
    for i, prompt in enumerate(prompts):
        where = f"input_ids[{i}]" if batched else "input_ids"
        if not prompt:
            raise RequestError(f"{where}: the prompt is empty")
        bad = [t for t in prompt if t < 0 or t >= vocab_size]
        if bad:
            raise RequestError(f"{where}: token id {bad[0]} is out of the vocabulary (size {vocab_size})")
        if len(prompt) >= context_length:
            raise RequestError(f"{where}: the prompt has {len(prompt)} tokens; the context length is {context_length}")
    return_logprob = bool(body.get("return_logprob", False))
    start = body.get("logprob_start_len", -1)
    starts = start if isinstance(start, list) else [start] * len(prompts)
    if len(starts) != len(prompts):
        raise RequestError(
            f"logprob_start_len: a list must have one entry per prompt ({len(starts)} for {len(prompts)})"
        )
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in starts):
        raise RequestError("logprob_start_len must be an integer or a list of integers (one per prompt)")
    top_nums = _top_logprobs_nums(body.get("top_logprobs_num"), len(prompts), vocab_size)
    mask_modes = _sampling_mask_modes(body, len(prompts))
    rid = body.get("rid")
    rids = rid if isinstance(rid, list) else [rid] * len(prompts)
    if len(rids) != len(prompts):
        raise RequestError("rid: a list must have one entry per prompt")
    lora = body.get("lora_path")
    loras = lora if isinstance(lora, list) else [lora] * len(prompts)
    if len(loras) != len(prompts) or not all(n is None or (isinstance(n, str) and n) for n in loras):
        raise RequestError("lora_path: an adapter name, or a list with one name (or null) per prompt")
    requests: list[Request] = []
    for prompt, cfg, parent, top_num, start, lora_name, mask_mode, prompt_images in zip(
        prompts, configs, rids, top_nums, starts, loras, mask_modes, image_inputs, strict=True
    ):
        parent = str(parent) if parent is not None else uuid.uuid4().hex
        for j in range(cfg.n):
            requests.append(
                Request(
                    rid=parent if cfg.n == 1 else f"{parent}-{j}",
                    parent_rid=parent,
                    index=j,
                    prompt_ids=list(prompt),
                    config=cfg,
                    sink=sink_factory(len(requests)),
                    return_logprob=return_logprob,
                    logprob_start_len=start if return_logprob else -1,
                    return_routed_experts=bool(body.get("return_routed_experts", False)),
                    return_original_logprob=bool(body.get("return_original_logprob", return_original_logprob_default)),
                    top_logprobs_num=top_num if return_logprob else 0,
                    return_sampling_mask=mask_mode,
                    stream=bool(body.get("stream", False)),
                    lora_name=lora_name,
                    images=prompt_images,
                )
            )
    batched = batched or (len(requests) > 1)
    return GenerateBatch(requests, batched, bool(body.get("stream", False)))
