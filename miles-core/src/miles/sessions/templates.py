"""Rendering conversations to token ids with a chat template, and the fixed (append-only) templates.

:class:`ChatRenderer` renders with the tokenizer's template or one configured in its place
(``rollout.sessions.chat_template``: a ``.jinja`` file or the name of a fixed template below), and
tokenises the text with ``add_special_tokens=False`` (templates write their own BOS). A template that
fails to render raises :class:`TemplateRenderError` with the template's own message.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from miles.errors import SettingsError
from miles.sessions.messages import Message

__all__ = ["FIXED_TEMPLATES", "QWEN3_APPEND_ONLY", "ChatRenderer", "TemplateRenderError", "resolve_template"]

log = logging.getLogger(__name__)

QWEN3_APPEND_ONLY = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set no_think = enable_thinking is defined and enable_thinking is false %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if reasoning_content or no_think %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if no_think %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""
"""Qwen3's template made append-only: every assistant turn keeps its thinking block (the official
template drops it from turns before the last user query, and gives only the last turn an empty one), so
the history a model saw is the history the next turn renders. With ``enable_thinking = false`` every
turn carries the empty block the generation prompt adds. Otherwise identical to Qwen3's."""

FIXED_TEMPLATES: dict[str, str] = {"qwen3": QWEN3_APPEND_ONLY}
"""Built-in append-only templates, by name (``rollout.sessions.chat_template = "qwen3"``)."""


class TemplateRenderError(ValueError):
    """The chat template refused a conversation (``raise_exception`` in the template, a missing key ...)."""


def resolve_template(value: str | None, tokenizer: Any) -> tuple[str, str]:
    """``(template, name)`` for ``rollout.sessions.chat_template``: a fixed template's name, a file, or
    ``None`` for the tokenizer's own."""
    if value is None:
        template = getattr(tokenizer, "chat_template", None)
        if not isinstance(template, str) or not template:
            raise SettingsError(
                "rollout.sessions.chat_template: the tokenizer has no chat template; "
                "set one (a .jinja file or one of: " + ", ".join(FIXED_TEMPLATES) + ")"
            )
        return template, f"{getattr(tokenizer, 'name_or_path', '') or 'the tokenizer'}'s chat template"
    if value in FIXED_TEMPLATES:
        return FIXED_TEMPLATES[value], f"the fixed template {value!r}"
    path = Path(value)
    if not path.is_file():
        raise SettingsError(
            f"rollout.sessions.chat_template: {value!r} is neither a file nor a fixed template "
            f"({', '.join(FIXED_TEMPLATES)})"
        )
    return path.read_text(encoding="utf-8"), str(path)


class ChatRenderer:
    """Renders conversations to text and token ids with one chat template.

    :param tokenizer: the policy's Hugging Face tokenizer.
    :param template: a Jinja chat template (default: the tokenizer's).
    :param template_kwargs: extra template variables for every render (e.g. ``enable_thinking``).
    :param end_tokens: token strings that end an assistant turn, besides the tokenizer's ``eos_token``.
    """

    def __init__(
        self,
        tokenizer: Any,
        template: str | None = None,
        *,
        name: str = "",
        template_kwargs: dict[str, Any] | None = None,
        end_tokens: Iterable[str] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.template = template if template is not None else tokenizer.chat_template
        self.name = name or "chat template"
        self.template_kwargs = dict(template_kwargs or {})
        vocab = tokenizer.get_vocab()
        ends = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        ends |= {vocab[t] for t in end_tokens if t in vocab}
        self.end_ids: frozenset[int] = frozenset(int(i) for i in ends)
        """Token ids that close an assistant turn (the turn's stop tokens)."""

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        kwargs = {**self.template_kwargs, **(template_kwargs or {})}
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages),  # Jinja cannot change the dicts: no copy needed
                tools=list(tools) if tools else None,
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except Exception as exc:  # jinja's TemplateError, raise_exception(), TypeError on None + str ...
            raise TemplateRenderError(f"{self.name} cannot render the conversation: {exc}") from exc
        return str(text)

    def ids(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The token ids of :meth:`render`'s text."""
        text = self.render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, template_kwargs=template_kwargs
        )
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens kept (what the template wrote, what the model wrote)."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        return [str(t) for t in self.tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False)]

    def closing(self, rendered_turn: Sequence[int], output_ids: Sequence[int]) -> list[int]:
        """The template's tokens that close an assistant turn after what the model sampled.

        ``rendered_turn`` is the template's rendering of the turn (after its generation prompt). When the
        model stopped on an end token, the turn closes with whatever the template writes after its last
        occurrence (``\\n`` after ChatML's ``<|im_end|>``, nothing after Llama-3's ``<|eot_id|>``); when it
        stopped otherwise (a length limit, a stop string), with the template's closing from its last end
        token on (``<|im_end|>\\n``).
        """
        turn = list(rendered_turn)
        positions = [i for i, t in enumerate(turn) if t in self.end_ids]
        if not positions:
            return []
        last = positions[-1]
        if output_ids and output_ids[-1] in self.end_ids:
            return turn[last + 1 :]
        return turn[last:]
