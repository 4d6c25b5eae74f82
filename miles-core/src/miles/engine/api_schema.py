"""The request bodies of the local engine's HTTP API, as JSON schemas in its OpenAPI document.

The routes parse their bodies by hand (SGLang's protocol accepts a prompt as ``text`` or ``input_ids``, one
or a batch, and answers a bad field with its own error shape, not FastAPI's 422), so these models are not
used to parse: they describe what each route reads, for ``/docs`` and for the fuzz tests, which generate
bodies from them (valid and invalid) and require a 4xx naming the field, never a 5xx.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from miles.engine.parsing import MAX_N

__all__ = ["BODIES", "describe_bodies", "openapi_body"]


class _Body(BaseModel):
    # the engine ignores keys it does not know (SGLang has many), the document lists those it reads
    model_config = ConfigDict(extra="forbid")


class SamplingParamsBody(_Body):
    """SGLang's ``sampling_params``."""

    max_new_tokens: Annotated[int, Field(ge=0)] | SkipJsonSchema[None] = None
    min_new_tokens: Annotated[int, Field(ge=0)] | SkipJsonSchema[None] = None
    temperature: Annotated[float, Field(ge=0)] | SkipJsonSchema[None] = None
    top_p: Annotated[float, Field(gt=0, le=1)] | SkipJsonSchema[None] = None
    top_k: int | SkipJsonSchema[None] = None
    min_p: Annotated[float, Field(ge=0, le=1)] | SkipJsonSchema[None] = None
    stop: str | list[str] | SkipJsonSchema[None] = None
    stop_token_ids: list[int] | SkipJsonSchema[None] = None
    ignore_eos: bool | SkipJsonSchema[None] = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | SkipJsonSchema[None] = None
    sampling_seed: int | SkipJsonSchema[None] = None
    skip_special_tokens: bool | SkipJsonSchema[None] = None
    no_stop_trim: bool | SkipJsonSchema[None] = None


class GenerateBody(_Body):
    """``/generate``: one prompt or a batch, as token ids or text."""

    input_ids: list[int] | list[list[int]] | SkipJsonSchema[None] = None
    text: str | list[str] | SkipJsonSchema[None] = None
    sampling_params: SamplingParamsBody | list[SamplingParamsBody] | SkipJsonSchema[None] = None
    return_logprob: bool | SkipJsonSchema[None] = None
    logprob_start_len: int | list[int] | SkipJsonSchema[None] = None
    top_logprobs_num: int | list[int] | SkipJsonSchema[None] = None
    return_routed_experts: bool | SkipJsonSchema[None] = None
    return_original_logprob: bool | SkipJsonSchema[None] = None
    return_sampling_mask: bool | list[bool] | SkipJsonSchema[None] = None
    sampling_logprobs_mode: (
        Literal["selected", "support"] | list[Literal["selected", "support"] | None] | SkipJsonSchema[None]
    ) = None
    stream: bool | SkipJsonSchema[None] = None
    rid: str | list[str] | SkipJsonSchema[None] = None
    lora_path: str | list[str | None] | SkipJsonSchema[None] = None


class AbortBody(_Body):
    rid: str | SkipJsonSchema[None] = None
    abort_all: bool | SkipJsonSchema[None] = None


class PauseBody(_Body):
    mode: Annotated[str, Field(description="abort, retract or in_place")] | SkipJsonSchema[None] = None


class UpdateWeightsFromDiskBody(_Body):
    model_path: str
    weight_version: str | SkipJsonSchema[None] = None
    flush_cache: bool | SkipJsonSchema[None] = None
    abort_all_requests: bool | SkipJsonSchema[None] = None


class UpdateWeightVersionBody(_Body):
    new_version: str | SkipJsonSchema[None] = None
    abort_all_requests: bool | SkipJsonSchema[None] = None


class InitWeightsUpdateGroupBody(_Body):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str | SkipJsonSchema[None] = None
    backend: str | SkipJsonSchema[None] = None


class UpdateWeightsFromDistributedBody(_Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str | SkipJsonSchema[None] = None
    weight_version: str | SkipJsonSchema[None] = None
    flush_cache: bool | SkipJsonSchema[None] = None


class UpdateWeightsFromTensorBody(_Body):
    """SGLang's ``UpdateWeightsFromTensorReqInput``: one base64 payload of tensor handles per TP rank."""

    serialized_named_tensors: list[str]
    load_format: str | SkipJsonSchema[None] = None
    flush_cache: bool | SkipJsonSchema[None] = None
    weight_version: str | SkipJsonSchema[None] = None


class GroupNameBody(_Body):
    group_name: str | SkipJsonSchema[None] = None


class MemoryTagsBody(_Body):
    tags: list[str] | SkipJsonSchema[None] = None


class WeightsByNameBody(_Body):
    name: str
    truncate_size: int | SkipJsonSchema[None] = None


class LoadLoraAdapterBody(_Body):
    """SGLang's ``LoadLoRAAdapterReqInput``."""

    lora_name: str
    lora_path: str
    pinned: bool | SkipJsonSchema[None] = None
    lora_id: str | SkipJsonSchema[None] = None


class LoadLoraAdapterFromTensorsBody(_Body):
    """SGLang's ``LoadLoRAAdapterFromTensorsReqInput`` (``serialized_tensors``: base64 of a safetensors file)."""

    lora_name: str
    config_dict: dict[str, Any]
    serialized_tensors: str
    load_format: str | SkipJsonSchema[None] = None
    lora_id: str | SkipJsonSchema[None] = None
    pinned: bool | SkipJsonSchema[None] = None


class UnloadLoraAdapterBody(_Body):
    lora_name: str
    lora_id: str | SkipJsonSchema[None] = None


class RandomizeBody(_Body):
    seed: int | SkipJsonSchema[None] = None


BODIES: dict[str, type[BaseModel]] = {
    "/generate": GenerateBody,
    "/abort_request": AbortBody,
    "/pause_generation": PauseBody,
    "/update_weights_from_disk": UpdateWeightsFromDiskBody,
    "/update_weight_version": UpdateWeightVersionBody,
    "/init_weights_update_group": InitWeightsUpdateGroupBody,
    "/update_weights_from_distributed": UpdateWeightsFromDistributedBody,
    "/update_weights_from_tensor": UpdateWeightsFromTensorBody,
    "/destroy_weights_update_group": GroupNameBody,
    "/release_memory_occupation": MemoryTagsBody,
    "/resume_memory_occupation": MemoryTagsBody,
    "/get_weights_by_name": WeightsByNameBody,
    "/debug/randomize_weights": RandomizeBody,
    "/load_lora_adapter": LoadLoraAdapterBody,
    "/load_lora_adapter_from_tensors": LoadLoraAdapterFromTensorsBody,
    "/unload_lora_adapter": UnloadLoraAdapterBody,
}
"""The body model of each route that reads one."""


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    """``node`` with every local ``$ref`` replaced by its definition (OpenAPI's ``openapi_extra`` is copied
    verbatim into the document, where pydantic's ``#/$defs/...`` would not resolve)."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node


def _bound_generate(schema: dict[str, Any], vocab_size: int, context_length: int) -> None:
    """This engine's limits in ``/generate``'s schema: token ids in the vocabulary, a prompt shorter than
    the context, ``top_logprobs_num`` at most the vocabulary, and exactly one of ``input_ids`` / ``text``."""
    props = schema["properties"]
    for option in props["input_ids"]["anyOf"]:
        ids = option if option["items"].get("type") == "integer" else option["items"]
        ids["items"].update(minimum=0, maximum=vocab_size - 1)
        ids.update(minItems=1, maxItems=context_length - 1)
        if ids is not option:
            option.update(minItems=1)
    for option in props["top_logprobs_num"]["anyOf"]:
        target = option if option.get("type") == "integer" else option["items"]
        target.update(minimum=0, maximum=vocab_size)
    schema["oneOf"] = [{"required": ["input_ids"]}, {"required": ["text"]}]


def openapi_body(
    path: str, *, vocab_size: int | None = None, context_length: int | None = None
) -> dict[str, Any] | None:
    """``openapi_extra`` describing ``path``'s JSON body (``None`` for routes without one); with the engine's
    ``vocab_size`` and ``context_length`` the generation schema carries its limits."""
    model = BODIES.get(path)
    if model is None:
        return None
    schema = model.model_json_schema()
    schema = _inline(schema, schema.get("$defs", {}))
    if path == "/generate" and vocab_size is not None and context_length is not None:
        _bound_generate(schema, vocab_size, context_length)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def describe_bodies(app: Any, *, vocab_size: int | None = None, context_length: int | None = None) -> None:
    """Put each route's body schema (:data:`BODIES`) into ``app``'s OpenAPI document."""
    from fastapi.routing import APIRoute

    for route in app.routes:
        if not isinstance(route, APIRoute):
            continue
        extra = openapi_body(route.path, vocab_size=vocab_size, context_length=context_length)
        if extra is not None:
            route.openapi_extra = {**(route.openapi_extra or {}), **extra}
    app.openapi_schema = None  # regenerated with the bodies on the next request
