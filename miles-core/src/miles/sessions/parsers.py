"""Reading the model's text as an assistant message: reasoning, content and tool calls.

Only what the server returns to the agent is parsed; the session's record keeps the sampled tokens.

- tool parsers: ``hermes`` (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks: Qwen2.5,
  Qwen3, Hermes, and the default for ChatML templates), ``llama3_json`` (the whole reply is one
  ``{"name": ..., "parameters": {...}}`` object, optionally after ``<|python_tag|>``: Llama-3.1), ``none``;
- reasoning parsers: ``think`` (``<think>...</think>`` before the answer), ``none``.

``auto`` picks from the chat template: ``llama3_json`` when it writes ``"parameters": ``, else ``hermes``;
``think`` when it mentions ``</think>``. A block that is not valid JSON stays in the content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["ParsedReply", "ReasoningParser", "ToolCall", "ToolParser", "choose_parsers", "parse_reply"]

ToolParser = Literal["hermes", "llama3_json", "none"]
ReasoningParser = Literal["think", "none"]

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Any
    """A JSON value (an object for every well-formed call)."""


@dataclass
class ParsedReply:
    content: str
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


def choose_parsers(template: str, tool_parser: str, reasoning_parser: str) -> tuple[ToolParser, ReasoningParser]:
    """Resolve ``auto`` against the chat template's text."""
    tool: Any = tool_parser
    if tool == "auto":
        tool = "llama3_json" if '"parameters": ' in template else "hermes"
    reasoning: Any = reasoning_parser
    if reasoning == "auto":
        reasoning = "think" if "</think>" in template else "none"
    return tool, reasoning


def _call(text: str, argument_keys: tuple[str, ...]) -> ToolCall | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    for key in argument_keys:
        if key in value:
            args = value[key]
            if isinstance(args, str):  # some models write the arguments as a JSON string
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            return ToolCall(value["name"], args) if isinstance(args, dict) else None
    return ToolCall(value["name"], {})


def _split_reasoning(text: str) -> tuple[str | None, str]:
    if "</think>" in text:
        before, _, after = text.partition("</think>")
        return before.split("<think>")[-1].strip("\n"), after.lstrip("\n")
    if text.lstrip().startswith("<think>"):  # cut off while thinking
        return text.lstrip()[len("<think>") :].strip("\n"), ""
    return None, text


def parse_reply(text: str, *, tool_parser: ToolParser, reasoning_parser: ReasoningParser) -> ParsedReply:
    """The assistant message in ``text`` (the model's reply without its end token)."""
    reasoning, rest = _split_reasoning(text) if reasoning_parser == "think" else (None, text)
    calls: list[ToolCall] = []
    if tool_parser == "hermes":
        kept: list[str] = []
        last = 0
        for match in _HERMES.finditer(rest):
            call = _call(match.group(1), ("arguments", "parameters"))
            if call is None:
                continue
            calls.append(call)
            kept.append(rest[last : match.start()])
            last = match.end()
        kept.append(rest[last:])
        content = "".join(kept).strip() if calls else rest
    elif tool_parser == "llama3_json":
        body = rest.strip()
        body = body[len("<|python_tag|>") :] if body.startswith("<|python_tag|>") else body
        call = _call(body, ("parameters", "arguments")) if body.startswith("{") else None
        calls = [call] if call is not None else []
        content = "" if calls else rest
    else:
        content = rest
    return ParsedReply(content, reasoning or None, calls)
