"""Chat messages in the two forms a session needs: what templates render, and what identifies a message.

*Template form* is what Hugging Face chat templates expect: ``content`` a string (a list of parts only where
it holds images: ``{"type": "text", "text": ...}`` and ``{"type": "image", "sha256": ...}``, see
:mod:`miles.sessions.images`), ``developer``
as ``system``, tool-call ``arguments`` as a JSON object (the templates ``tojson`` them), keys that are
``None`` left out (Llama-3.1's template tests ``'tool_calls' in message``).

*Identity* decides whether a request repeats a stored message. Agents echo the assistant's reply back in
many shapes — ``content`` ``None`` or ``""``, ``arguments`` as a re-serialised string, extra ``null``
fields (``refusal``, ``audio``), the reasoning dropped, tool-call ids regenerated — none of which changes
what the policy saw, so none of them makes a different message (slime#2288: treating them as edits forked
every turn). What does count: role, content (an image by its bytes' digest), the tool calls' names and
arguments (as JSON values), a tool result's content, and the reasoning when the request carries it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from miles.data.base import content_text

__all__ = ["Message", "images_of", "same_message", "template_message", "template_messages", "tools_key"]

Message = dict[str, Any]
"""A chat message (OpenAI's shape in requests, template form in the session's record)."""


def _arguments(value: Any) -> Any:
    """Tool-call arguments as a JSON value (OpenAI sends a JSON string; invalid JSON stays a string)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _content(content: Any) -> Any:
    """Template form of a message's content: its text, or its parts where it holds images."""
    if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image" for p in content):
        return [
            {"type": "image", "sha256": p["sha256"]}
            if p.get("type") == "image"
            else {"type": "text", "text": p["text"]}
            for p in content
        ]
    return content_text(content)


def images_of(message: Message) -> list[str]:
    """Digests of a template-form message's images, in order."""
    content = message.get("content")
    if not isinstance(content, list):
        return []
    return [str(p["sha256"]) for p in content if p.get("type") == "image"]


def template_message(message: Message) -> Message:
    """``message`` (OpenAI's shape) in template form."""
    role = "system" if message.get("role") == "developer" else str(message.get("role"))
    out: Message = {"role": role, "content": _content(message.get("content"))}
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [
            {
                "id": call.get("id") or f"call_{i}",
                "type": "function",
                "function": {
                    "name": call["function"]["name"],
                    "arguments": _arguments(call["function"].get("arguments", {})),
                },
            }
            for i, call in enumerate(calls)
        ]
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        out["reasoning_content"] = reasoning
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = str(message[key])
    return out


def template_messages(messages: Sequence[Message]) -> list[Message]:
    return [template_message(m) for m in messages]


def _calls(message: Message) -> list[tuple[str, str]]:
    return [
        (call["function"]["name"], json.dumps(call["function"]["arguments"], sort_keys=True))
        for call in message.get("tool_calls", [])
    ]


def same_message(stored: Message, incoming: Message) -> bool:
    """Whether ``incoming`` (template form) repeats ``stored`` (see the module docstring)."""
    if stored["role"] != incoming["role"] or stored["content"] != incoming["content"]:
        return False
    if _calls(stored) != _calls(incoming):
        return False
    if "reasoning_content" in incoming and incoming["reasoning_content"] != stored.get("reasoning_content"):
        return False
    return stored.get("name") == incoming.get("name")


def tools_key(tools: Sequence[Any] | None, template_kwargs: dict[str, Any] | None) -> str:
    """What else a rendering depends on: the tool definitions and the template arguments."""
    return json.dumps({"tools": list(tools or []), "kwargs": template_kwargs or {}}, sort_keys=True)
