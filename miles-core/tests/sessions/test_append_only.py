"""The CPU render check on the real chat templates (and on templates built to fail it)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from miles.errors import SettingsError
from miles.sessions.append_only import PROBES, Probe, check_append_only
from miles.sessions.templates import ChatRenderer, resolve_template
from miles.testing.chat_templates import build_chat_tokenizer

from .conftest import TEMPLATES


@pytest.mark.parametrize("name", TEMPLATES)
def test_real_templates_are_append_only(name: str, renderer_for: Callable[..., ChatRenderer]) -> None:
    report = check_append_only(renderer_for(name))
    assert report.ok, report.summary()
    assert report.failure is None
    # every probe turn boundary was checked (two rules per reply), except probes the template refuses
    assert report.checked >= 20
    if name == "llama3.1":  # one tool call per turn only: the two-call probe is skipped, not failed
        assert [s.split(":")[0] for s in report.skipped] == ["tool calls"]
        assert "only supports single tool-calls" in report.skipped[0]
    else:
        assert report.skipped == []


def test_qwen3_official_template_fails_at_the_first_reply_with_an_empty_thinking_block() -> None:
    report = check_append_only(ChatRenderer(build_chat_tokenizer("qwen3"), name="qwen3"))
    assert not report.ok and report.failure is not None
    f = report.failure
    # the last assistant turn gets an empty <think> block that disappears once a user message follows
    assert (f.probe, f.turn, f.message, f.role) == ("chat", 2, 2, "assistant")
    assert f.rule == "the history renders differently once the next messages arrive"
    assert f.before.startswith("<think>\n\n</think>\n\n2 + 2 = 4.") and f.after.startswith("2 + 2 = 4.")
    assert "qwen3 is not append-only: probe 'chat', turn 2 (message 2, role assistant)" in report.summary()


def test_qwen3_official_template_drops_old_reasoning_once_a_user_query_arrives() -> None:
    """Without the empty-block case, the next failure: reasoning of turns before the last query vanishes."""
    thinking = next(p for p in PROBES if p.name == "thinking")
    report = check_append_only(ChatRenderer(build_chat_tokenizer("qwen3"), name="qwen3"), [thinking])
    assert not report.ok and report.failure is not None
    assert report.failure.role == "assistant" and report.failure.message == 2  # the first reply with reasoning
    assert report.failure.before.startswith("<think>\nI should use the calculator.")


@pytest.mark.parametrize("thinking", [True, False])
def test_fixed_qwen3_template_passes_with_and_without_thinking(thinking: bool) -> None:
    tok = build_chat_tokenizer("qwen3")
    template, name = resolve_template("qwen3", tok)
    kwargs = {} if thinking else {"enable_thinking": False}
    assert check_append_only(ChatRenderer(tok, template, name=name, template_kwargs=kwargs)).ok
    # the official template fails in both modes
    assert not check_append_only(ChatRenderer(tok, name="qwen3", template_kwargs=kwargs)).ok


def test_consecutive_tool_messages_are_one_turn_slime_2263() -> None:
    """slime#2263: splitting consecutive tool messages into turns made Qwen's templates look (and
    tokenise) non-append-only: the shared ``user`` block is closed only after the last tool message."""
    renderer = ChatRenderer(build_chat_tokenizer("qwen2.5"), name="qwen2.5")
    tools = next(p for p in PROBES if p.name == "tool calls")
    assert check_append_only(renderer, [tools]).ok
    split = Probe(
        "tool messages split into turns",
        tuple(t2 for turn in tools.turns for t2 in ([(m,) for m in turn] if turn[0]["role"] == "tool" else [turn])),
        tools=True,
    )
    # the same conversation with each tool message a turn of its own: the history after the first tool
    # message ('</tool_response><|im_end|>') is not a prefix of the rendering with both
    report = check_append_only(renderer, [split])
    assert not report.ok and report.failure is not None
    assert report.failure.before.startswith("<|im_end|>") and report.failure.after.startswith("\n<tool_response>")


def test_a_template_that_rewrites_the_system_prompt_is_reported_with_the_message() -> None:
    counting = (
        "{{ '<|im_start|>system\\n' + (messages|length|string) + ' messages<|im_end|>\\n' }}"
        "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    report = check_append_only(ChatRenderer(build_chat_tokenizer("qwen2.5"), counting, name="counting"))
    assert not report.ok and report.failure is not None
    assert report.failure.message == 0 and report.failure.probe == "chat"
    assert report.failure.role == "system" and report.failure.rule.startswith("the generation prompt is not")
    assert report.failure.before.startswith("2 messages") and report.failure.after.startswith("3 messages")


def test_a_template_that_renders_nothing_of_the_probes_fails() -> None:
    report = check_append_only(
        ChatRenderer(build_chat_tokenizer("qwen2.5"), "{{ raise_exception('no') }}", name="refusing")
    )
    assert not report.ok and len(report.skipped) == len(PROBES)
    assert "renders none of the probe conversations" in report.summary()


def test_resolve_template_names_the_setting() -> None:
    tok = build_chat_tokenizer("qwen2.5")
    assert resolve_template(None, tok)[0] == tok.chat_template
    with pytest.raises(SettingsError, match=r"rollout.sessions.chat_template: 'qwen9' is neither a file nor"):
        resolve_template("qwen9", tok)
    tok.chat_template = None
    with pytest.raises(SettingsError, match="the tokenizer has no chat template"):
        resolve_template(None, tok)
