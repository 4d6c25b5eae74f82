"""A session's token record, with the model's replies given (no engine): suffix-only tokenisation,
exact policy tokens and loss mask, closing tokens, branches, and the slime#2288 regression."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any

import pytest

from miles.rollout.protocol import FinishReason, GenerateOutput
from miles.sessions.append_only import CALCULATOR_TOOL
from miles.sessions.messages import template_messages
from miles.sessions.session import AppendOnlyViolation
from miles.sessions.templates import ChatRenderer
from miles.testing.chat_templates import build_chat_tokenizer
from miles.types import SampleStatus

from .conftest import TEMPLATES, expected_suffix, new_session, openai_reply, play

TOOLS = [CALCULATOR_TOOL]


def hermes_call(*expressions: str) -> str:
    return "\n".join(
        "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": e}}) + "\n</tool_call>"
        for e in expressions
    )


def tool_reply(name: str, *expressions: str) -> str:
    """The reply of a model of ``name``'s family calling the calculator, as its template writes it."""
    if name == "llama3.1":
        return json.dumps({"name": "calculator", "parameters": {"expression": expressions[0]}})
    text = hermes_call(*expressions)
    return f"<think>\nUse the tool.\n</think>\n\n{text}" if name == "qwen3-fixed" else text


def answer(name: str, text: str) -> str:
    return f"<think>\nDone.\n</think>\n\n{text}" if name == "qwen3-fixed" else text


@pytest.mark.parametrize("name", TEMPLATES)
def test_turns_append_only_the_new_messages_and_keep_the_models_tokens(
    name: str, renderer_for: Callable[..., ChatRenderer]
) -> None:
    r = renderer_for(name)
    session = new_session(r)
    two = name != "llama3.1"  # Llama-3.1 writes one tool call per turn
    script = [
        [
            {"role": "system", "content": "You are a calculator agent."},
            {"role": "user", "content": "What is 2 + 3 and 4 * 5?"},
        ],
        tool_reply(name, "2 + 3", "4 * 5") if two else tool_reply(name, "2 + 3"),
        "tools",
        answer(name, "ANSWER: 5 and 20"),
        [{"role": "user", "content": "And 7 * 6?"}],
        tool_reply(name, "7 * 6"),
        "tools",
        answer(name, "ANSWER: 42"),
        [{"role": "user", "content": "Thanks!"}],
        answer(name, "You are welcome."),
    ]
    client: list[dict[str, Any]] = []  # the conversation as the agent keeps it (OpenAI shapes)
    outputs: list[list[int]] = []
    expected: list[int] = []
    mask: list[int] = []
    pending: list[dict[str, Any]] = []
    for step in script:
        if isinstance(step, list):
            pending += step
            continue
        if step == "tools":
            calls = client[-1]["tool_calls"]
            pending += [{"role": "tool", "content": str(10 + i), "tool_call_id": c["id"]} for i, c in enumerate(calls)]
            continue
        if outputs:
            suffix = expected_suffix(r, template_messages(client), template_messages(pending), outputs[-1], TOOLS)
        else:
            suffix = r.ids(template_messages(pending), tools=TOOLS, add_generation_prompt=True)
        client += pending
        turn, branch = play(session, client, step, tools=TOOLS)
        assert not branch
        assert turn.prompt_ids == suffix  # only the new messages (and the closing) were tokenised
        expected += suffix
        assert turn.output_ids == [*r.encode(step), r.tokenizer.eos_token_id]  # the model's tokens, exactly
        expected += turn.output_ids
        mask += [0] * len(suffix) + [1] * len(turn.output_ids)
        outputs.append(turn.output_ids)
        client.append(openai_reply(turn))
        pending = []
        assert turn.sequence() == expected
    assert session.branches == 0 and session.violations == 0
    assert [bool(t.reply.get("tool_calls")) for t in session.turns] == [True, False, True, False, False]
    assert len(session.turns[0].reply["tool_calls"]) == (2 if two else 1)
    (sample,) = session.samples()
    sample.validate()
    first = session.turns[0]
    assert sample.prompt_ids == first.prompt_ids and sample.tokens == expected
    assert sample.loss_mask == mask[len(first.prompt_ids) :]  # token by token
    assert [lp for lp, m in zip(sample.rollout_logprobs, sample.loss_mask, strict=True) if m] == [-0.25] * sum(mask)
    assert all(lp == 0.0 for lp, m in zip(sample.rollout_logprobs, sample.loss_mask, strict=True) if not m)
    info = sample.metadata["session"]
    assert info["turns"] == 5 and info["tool_calls"] == (3 if two else 2) and info["policy_tokens"] == sum(mask)
    assert [s.version for s in sample.weight_versions] == [3] * 5
    assert sample.status == SampleStatus.COMPLETED
    if name in ("qwen2.5", "qwen3-fixed", "llama3.1"):
        # replies written as the template writes them: the record is exactly the template's rendering
        full = r.ids(template_messages(client), tools=TOOLS)
        assert sample.tokens == full[: len(sample.tokens)]


@pytest.mark.parametrize(("family", "closing"), [("qwen2.5", "<|im_end|>\n"), ("llama3.1", "<|eot_id|>")])
def test_a_reply_cut_by_the_length_limit_is_closed_with_masked_template_tokens(family: str, closing: str) -> None:
    r = ChatRenderer(build_chat_tokenizer(family))
    session = new_session(r)
    first = [{"role": "user", "content": "Count to ten."}]
    turn, _ = play(session, first, "one two three", stop=False)
    second, _ = play(session, [*first, openai_reply(turn), {"role": "user", "content": "Go on."}], "four")
    assert r.decode(second.prompt_ids).startswith(closing)
    (sample,) = session.samples()
    start = len(turn.output_ids)
    assert sample.loss_mask[start : start + len(second.prompt_ids)] == [0] * len(second.prompt_ids)
    truncated = session.sample(turn)
    assert truncated.status == SampleStatus.TRUNCATED and truncated.status_reason == f"length {start}"


def test_reformatted_echoes_are_the_same_history_slime_2288() -> None:
    """slime#2288: agents echo replies in other shapes; treating them as edits re-templated the history
    and forked every turn (1.8M-token trajectories). Here 20 turns stay one linear trajectory."""
    r = ChatRenderer(build_chat_tokenizer("qwen2.5"))
    session = new_session(r)
    client: list[dict[str, Any]] = [{"role": "user", "content": "What is 1 + 1?"}]
    for k in range(20):
        turn, branch = play(session, client, hermes_call(f"{k} + 1") if k % 2 == 0 else f"ANSWER: {k}", tools=TOOLS)
        assert not branch
        echo = openai_reply(turn)
        if k % 4 == 0:  # arguments re-serialised with other spacing and key order, new ids, explicit nulls
            echo["tool_calls"] = [
                {
                    "id": f"other-{k}",
                    "type": "function",
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": json.dumps(json.loads(c["function"]["arguments"]), separators=(",", ":")),
                    },
                }
                for c in echo["tool_calls"]
            ]
            echo.update(refusal=None, audio=None, function_call=None)
        elif k % 4 == 1:
            echo["content"] = echo["content"] or ""
        elif k % 4 == 2:  # content "" instead of None
            echo["content"] = ""
        client.append(echo)
        if echo.get("tool_calls"):
            client += [{"role": "tool", "content": str(k + 1), "tool_call_id": c["id"]} for c in echo["tool_calls"]]
        else:
            client.append({"role": "user", "content": f"Next: {k} + 2?"})
    assert session.branches == 0 and len(session.leaves()) == 1
    (sample,) = session.samples()
    assert sample.metadata["session"]["turns"] == 20
    # linear growth: the record is each turn's suffix and reply once, never the history again
    assert len(sample.tokens) == sum(len(t.prompt_ids) + len(t.output_ids) for t in session.turns)
    assert max(len(t.prompt_ids) for t in session.turns[1:]) < 40  # a turn appends its messages, not the history
    full = r.ids(template_messages(client[:-1]), tools=TOOLS)  # through the last reply
    assert sample.tokens == full[: len(sample.tokens)] and len(full) - len(sample.tokens) == 1  # + the closing "\n"


def test_an_edited_message_starts_a_counted_branch() -> None:
    r = ChatRenderer(build_chat_tokenizer("qwen2.5"))
    session = new_session(r)
    history = [{"role": "user", "content": "What is 2 + 2?"}]
    t1, _ = play(session, history, "4")
    history += [openai_reply(t1), {"role": "user", "content": "And 3 + 3?"}]
    t2, _ = play(session, history, "6")
    edited = [*history[:2], {"role": "user", "content": "And 5 + 5?"}]  # the second question edited
    t3, branch = play(session, edited, "10")
    assert branch and session.branches == 1 and t3.parent is t1
    assert t3.start == t2.start and t3.sequence()[: t3.start] == t1.sequence()  # shares the prefix exactly
    retry, branch = play(session, history, "six")  # the original history again: a third child of t1
    assert branch and session.branches == 2 and retry.parent is t1
    fresh, branch = play(session, [{"role": "user", "content": "Hello"}], "Hi")  # a new first message
    assert branch and fresh.parent is None and session.branches == 3
    samples = session.samples()
    assert len(samples) == 4 and samples[-1].metadata["session"]["latest"]
    assert samples[-1].prompt_ids == fresh.prompt_ids
    assert [s.metadata["session"]["branches"] for s in samples] == [3] * 4


def test_a_template_that_rewrites_history_is_refused_with_the_message() -> None:
    """The official Qwen3 template (a server refuses it at start; a session on it refuses the turn)."""
    r = ChatRenderer(build_chat_tokenizer("qwen3"), name="qwen3")
    session = new_session(r)
    history = [{"role": "user", "content": "Hi"}]
    turn, _ = play(session, history, "Hello!")  # no thinking: the template's empty block vanishes later
    with pytest.raises(AppendOnlyViolation, match=r"renders messages\[1\] \(assistant\) differently") as exc:
        play(session, [*history, openai_reply(turn), {"role": "user", "content": "Bye"}], "Bye!")
    assert exc.value.message_index == 1 and session.violations == 1
    assert len(session.turns) == 1  # nothing recorded


def test_routed_experts_cover_every_fed_token_from_the_turn_that_computed_it() -> None:
    r = ChatRenderer(build_chat_tokenizer("qwen2.5"))
    session = new_session(r)
    layers, topk = 2, 2

    def output(turn_prompt: int, ids: list[int], tag: int) -> GenerateOutput:
        rows = turn_prompt + len(ids) - 1
        data = b"".join(struct.pack("<4i", tag, p, 0, 0) for p in range(rows))
        return GenerateOutput("x", ids, [-1.0] * len(ids), FinishReason("stop", matched=ids[-1]), turn_prompt, len(ids),
                              routed_experts=data, meta_info={"routed_experts_shape": [rows, layers, topk]})  # fmt: skip

    eos = r.tokenizer.eos_token_id
    history = [{"role": "user", "content": "Hi"}]
    parent, new, _ = session.match(template_messages(history), "k")
    append, ids = session.plan(parent, new, tools=None, template_kwargs={})
    t1 = session.add_turn(parent, new, key="k", prompt_ids=append, template_ids=ids, branch=False)
    session.record(t1, output(len(append), [11, 12, eos], tag=1))
    history += [openai_reply(t1), {"role": "user", "content": "More"}]
    parent, new, _ = session.match(template_messages(history), "k")
    append, ids = session.plan(parent, new, tools=None, template_kwargs={})
    t2 = session.add_turn(parent, new, key="k", prompt_ids=append, template_ids=ids, branch=False)
    session.record(t2, output(t1.end + len(append), [13, eos], tag=2))
    (sample,) = session.samples()
    sample.validate()
    assert sample.routed_experts_shape == (len(sample.tokens) - 1, layers, topk)
    rows = [
        struct.unpack("<4i", sample.routed_experts[i * 16 : i * 16 + 16])[:2] for i in range(len(sample.tokens) - 1)
    ]  # type: ignore[index]
    covered = t1.end - 1
    assert rows == [(1, p) for p in range(covered)] + [(2, p) for p in range(covered, len(sample.tokens) - 1)]


def test_other_tools_or_template_arguments_are_another_conversation() -> None:
    r = ChatRenderer(build_chat_tokenizer("qwen2.5"))
    session = new_session(r)
    history = [{"role": "user", "content": "What is 2 + 2?"}]
    t1, _ = play(session, history, "4", tools=TOOLS)
    follow = [*history, openai_reply(t1), {"role": "user", "content": "Sure?"}]
    t2, branch = play(session, follow, "Yes.", tools=None)  # the same messages without the tools
    assert branch and t2.parent is None and session.branches == 1
    assert t2.prompt_ids == r.ids(template_messages(follow), add_generation_prompt=True)  # rendered afresh
