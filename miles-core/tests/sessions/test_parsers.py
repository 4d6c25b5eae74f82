"""Reading replies as assistant messages: tool calls (hermes, llama3_json) and thinking."""

from __future__ import annotations

from miles.sessions.parsers import ToolCall, choose_parsers, parse_reply
from miles.testing.chat_templates import LLAMA31_TEMPLATE, QWEN3_TEMPLATE, QWEN25_TEMPLATE
from miles.testing.models import CHATML_TEMPLATE


def test_hermes_calls_and_content() -> None:
    text = (
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calculator", "arguments": "{\\"expression\\": \\"4 * 5\\"}"}\n</tool_call>'
    )
    parsed = parse_reply(text, tool_parser="hermes", reasoning_parser="none")
    assert parsed.content == "Let me compute."
    assert parsed.tool_calls == [
        ToolCall("calculator", {"expression": "2 + 3"}),
        ToolCall("calculator", {"expression": "4 * 5"}),
    ]


def test_hermes_keeps_malformed_blocks_as_content() -> None:
    text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 +\n</tool_call>'
    parsed = parse_reply(text, tool_parser="hermes", reasoning_parser="none")
    assert parsed.tool_calls == [] and parsed.content == text
    bad_args = '<tool_call>{"name": "calculator", "arguments": [1, 2]}</tool_call>'
    assert parse_reply(bad_args, tool_parser="hermes", reasoning_parser="none").tool_calls == []


def test_llama3_json() -> None:
    call = '{"name": "calculator", "parameters": {"expression": "7 * 6"}}'
    for text in (call, "<|python_tag|>" + call, "  " + call + "\n"):
        parsed = parse_reply(text, tool_parser="llama3_json", reasoning_parser="none")
        assert parsed.tool_calls == [ToolCall("calculator", {"expression": "7 * 6"})] and parsed.content == ""
    prose = "The answer is {not json}"
    assert parse_reply(prose, tool_parser="llama3_json", reasoning_parser="none").content == prose


def test_thinking_is_split_from_the_answer() -> None:
    parsed = parse_reply("<think>\nAdd them.\n</think>\n\nANSWER: 5", tool_parser="hermes", reasoning_parser="think")
    assert (parsed.reasoning, parsed.content) == ("Add them.", "ANSWER: 5")
    cut = parse_reply("<think>\nstill thinking", tool_parser="hermes", reasoning_parser="think")
    assert (cut.reasoning, cut.content) == ("still thinking", "")
    plain = parse_reply("ANSWER: 5", tool_parser="none", reasoning_parser="think")
    assert (plain.reasoning, plain.content) == (None, "ANSWER: 5")


def test_auto_reads_the_template() -> None:
    assert choose_parsers(QWEN25_TEMPLATE, "auto", "auto") == ("hermes", "none")
    assert choose_parsers(QWEN3_TEMPLATE, "auto", "auto") == ("hermes", "think")
    assert choose_parsers(LLAMA31_TEMPLATE, "auto", "auto") == ("llama3_json", "none")
    assert choose_parsers(CHATML_TEMPLATE, "auto", "none") == ("hermes", "none")
    assert choose_parsers(QWEN3_TEMPLATE, "none", "none") == ("none", "none")
