"""OpenAI's chat-completions schema, as far as a session serves it, and the answers it sends.

Requests are validated by :func:`parse_chat_request`; a malformed one raises :class:`RequestError` naming
the field (``messages[2].tool_call_id: field required``), which the server answers with HTTP 400 in
OpenAI's error shape. Fields OpenAI defines that do not change what is generated (``user``,
``metadata``, ``parallel_tool_calls`` ...) are accepted and ignored, so agent frameworks work unchanged;
fields a session cannot honour (``n > 1``, ``stream``, penalties, ``logit_bias``) are refused by name.
A user message's content may hold ``image_url`` parts (a vision-language policy: :mod:`miles.sessions.images`;
a part that does not parse is named down to its field, ``messages[1].content[0].image_url.url``).
Extensions: ``chat_template_kwargs`` (template variables, e.g. ``enable_thinking``) and
``return_token_ids`` (the turn's prompt and completion token ids in the answer, as vLLM's).
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from miles.sessions.messages import Message

__all__ = ["ChatRequest", "RequestError", "completion", "error_body", "parse_chat_request"]

_ROLES = {"system", "developer", "user", "assistant", "tool"}


class RequestError(ValueError):
    """A request that cannot be served; ``status`` is its HTTP status, ``param`` the field."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, kind: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.kind = kind or ("invalid_request_error" if status == 400 else "server_error")


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _TextPart(_Model):
    type: Literal["text"]
    text: str


class _ImageURL(_Model):
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class _ImagePart(_Model):
    type: Literal["image_url"]
    image_url: _ImageURL


Content = str | list[_TextPart]
UserContent = str | list[Annotated[_TextPart | _ImagePart, Field(discriminator="type")]]
"""A user message may hold images (a vision-language policy: :mod:`miles.sessions.images`)."""


class _Function(_Model):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"


class _ToolCall(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: _Function


class _System(_Model):
    role: Literal["system", "developer"]
    content: Content
    name: str | None = None


class _User(_Model):
    role: Literal["user"]
    content: UserContent
    name: str | None = None


class _Assistant(_Model):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[_ToolCall] | None = None
    reasoning_content: str | None = None
    name: str | None = None


class _Tool(_Model):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


_Message = Annotated[_System | _User | _Assistant | _Tool, Field(discriminator="role")]


class _FunctionDef(_Model):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class _ToolDef(_Model):
    type: Literal["function"]
    function: _FunctionDef


class ChatRequest(_Model):
    """The fields of ``POST /v1/chat/completions`` a session acts on."""

    model: str = "policy"
    messages: list[_Message] = Field(min_length=1)
    tools: list[_ToolDef] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    logprobs: bool = False
    top_logprobs: Literal[0] | None = None
    n: Literal[1] = 1
    stream: Literal[False] = False
    seed: int | None = None
    presence_penalty: Literal[0] = 0
    frequency_penalty: Literal[0] = 0
    logit_bias: dict[str, float] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_ids: bool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > 4 or not all(stops):
            raise ValueError("at most 4 non-empty stop sequences")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("not supported by a session (it would change the sampled distribution)")
        return value

    @property
    def stop_list(self) -> list[str]:
        return list(self.stop or [])

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def message_dicts(self) -> list[Message]:
        return [m.model_dump(exclude_none=True) for m in self.messages]


_BRANCHES = ("str", "list[_TextPart]", "list[tagged-union[_TextPart,_ImagePart]]")
"""Pydantic's names of the content union's branches (not fields)."""


def _loc(loc: tuple[int | str, ...]) -> str:
    parts: list[str] = []
    for i, item in enumerate(loc):
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif i and isinstance(loc[i - 1], int) and (item in _ROLES or item in ("text", "image_url")):
            if item == "image_url" and i + 1 < len(loc) and loc[i + 1] == "image_url":
                continue  # the part's tag, then its field of the same name
            if item in _ROLES or loc[i - 2] in _BRANCHES:
                continue  # the discriminator's tag, not a field
            parts.append("." + str(item))
        elif item in (*_BRANCHES, "function-after[_stops(), union[str,list[str]]]"):
            continue
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or "body"


def _content_error(errors: list[Any]) -> Any:
    """The first error, or where it is the string branch of a content that is a list, the error inside
    one of the list's parts (``messages[0].content[1].image_url.url``)."""
    first = errors[0]
    loc = tuple(first["loc"])
    if loc[-1:] != ("str",):
        return first
    for err in errors[1:]:
        other = tuple(err["loc"])
        if other[: len(loc) - 1] == loc[:-1] and len(other) > len(loc) and other[len(loc) - 1] in _BRANCHES[1:]:
            return err
    return first


_EXPLAIN = {
    "n": "only 1 choice is supported (each choice would be its own branch of the session)",
    "stream": "streaming is not supported by sessions",
    "top_logprobs": "only 0 is supported",
    "presence_penalty": "only 0 is supported (it would change the sampled distribution)",
    "frequency_penalty": "only 0 is supported (it would change the sampled distribution)",
    "tool_choice": "only 'auto' and 'none' are supported",
}


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate a request body; :class:`RequestError` names the first bad field."""
    if not isinstance(body, dict):
        raise RequestError("body: the request body must be a JSON object", param="body")
    try:
        return ChatRequest.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        err = _content_error(errors)
        where = _loc(tuple(err["loc"]))
        detail = _EXPLAIN.get(where, err["msg"])
        if where.endswith(".content") and err["type"] != "missing":
            user = "user" in err["loc"]
            detail = "must be a string or a list of " + (
                "text and image_url parts ({'type': 'text', 'text': ...}, "
                "{'type': 'image_url', 'image_url': {'url': ...}})"
                if user
                else "text parts ({'type': 'text', 'text': ...}); images go in user messages"
            )
        elif err["type"] == "union_tag_invalid":
            detail = f"unknown part type (expected 'text' or 'image_url'): {err['msg']}"
        elif where.endswith(".image_url") and err["type"] == "model_type":
            detail = "must be an object {'url': 'data:image/png;base64,...' or a file path}"
        elif where.endswith(".type") and err["type"] == "literal_error":
            detail = "only text parts here: images go in user messages"
        raise RequestError(f"{where}: {detail}", param=where) from None


def error_body(exc: RequestError) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": str(exc), "type": exc.kind, "param": exc.param, "code": exc.status}}


def completion(
    *,
    completion_id: str,
    model: str,
    message: Message,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    logprobs: list[dict[str, Any]] | None = None,
    token_ids: tuple[list[int], list[int]] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``chat.completion`` object (OpenAI's shape; ``miles`` and token ids are extensions)."""
    out_message: dict[str, Any] = {"role": "assistant", "content": message.get("content") or None}
    if message.get("tool_calls"):
        out_message["tool_calls"] = [
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": call["function"]["name"], "arguments": json.dumps(call["function"]["arguments"])},
            }
            for call in message["tool_calls"]
        ]
    elif out_message["content"] is None:
        out_message["content"] = ""
    if message.get("reasoning_content"):
        out_message["reasoning_content"] = message["reasoning_content"]
    choice: dict[str, Any] = {
        "index": 0,
        "message": out_message,
        "finish_reason": finish_reason,
        "logprobs": {"content": logprobs} if logprobs is not None else None,
    }
    body: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        },
    }
    if token_ids is not None:
        body["prompt_token_ids"] = token_ids[0]
        choice["token_ids"] = token_ids[1]
    if extra:
        body["miles"] = extra
    return body
