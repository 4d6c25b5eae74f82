"""The CPU render check: does a chat template render conversations append-only?

A session tokenises each request's new messages as a suffix of what it stored, so a template must keep
rendering the past the same way while a conversation grows. The check renders probe conversations —
system / user / assistant / tool turns, consecutive tool messages, tool calls (one and two per turn),
thinking blocks, with and without tools, and for a vision-language policy user messages with images — one *turn* at a time, where a turn is an assistant reply or the
run of other messages between two replies (consecutive tool messages are one turn: they arrive in one
request, and templates like Qwen's close the shared ``user`` block only after the last one; checking them
one by one was slime#2263). For every turn it asserts, on token ids:

1. the generation prompt is a prefix of the assistant turn it starts;
2. the conversation through an assistant turn is a prefix of the next request's prompt (the history
   plus the new messages plus the generation prompt);
3. where a probe has two non-reply turns in a row (a caller that splits one request's messages), the
   first renders as a prefix of both (what per-message tokenisation assumes).

The first violation is reported with the probe, the message that made the history render differently
and the text on both sides of the first differing token. A probe the template refuses to render (e.g.
Llama-3.1 and two tool calls in one turn) is skipped and listed, not failed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from miles.sessions.messages import Message
from miles.sessions.templates import ChatRenderer, TemplateRenderError

__all__ = [
    "CALCULATOR_TOOL",
    "IMAGE_PROBES",
    "PROBES",
    "Probe",
    "TemplateFailure",
    "TemplateReport",
    "check_append_only",
    "first_difference",
    "offending_message",
]

CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12 * (3 + 4)"}},
            "required": ["expression"],
        },
    },
}


def _call(expression: str, i: int) -> dict[str, Any]:
    return {
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": "calculator", "arguments": {"expression": expression}},
    }


def _calls(content: str, *expressions: str, reasoning: str | None = None) -> Message:
    message: Message = {
        "role": "assistant",
        "content": content,
        "tool_calls": [_call(e, i) for i, e in enumerate(expressions)],
    }
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


def _say(content: str, reasoning: str | None = None) -> Message:
    message: Message = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


def _tool(content: str, i: int = 0) -> Message:
    return {"role": "tool", "content": content, "tool_call_id": f"call_{i}"}


SYSTEM: Message = {"role": "system", "content": "You are a careful assistant. Use the calculator for arithmetic."}


@dataclass(frozen=True)
class Probe:
    """A conversation as turns: each turn is one assistant reply or the messages between two replies."""

    name: str
    turns: tuple[tuple[Message, ...], ...]
    tools: bool = False


def _user(text: str) -> tuple[Message, ...]:
    return ({"role": "user", "content": text},)


PROBES: tuple[Probe, ...] = (
    Probe(
        "chat",
        (
            (SYSTEM, *_user("Hi! What is 2 + 2?")),
            (_say("2 + 2 = 4."),),
            _user("And times 3?"),
            (_say("12."),),
            _user("Thanks."),
            (_say("You are welcome."),),
        ),
    ),
    Probe(
        "chat without a system message",
        (_user("Hello."), (_say("Hello! How can I help?"),), _user("Bye."), (_say("Bye!"),)),
    ),
    Probe(
        "tool calls",
        (
            (SYSTEM, *_user("What is 17 * 23, and 5 + 6?")),
            (_calls("", "17 * 23"),),
            (_tool("391"),),
            (_calls("", "5 + 6", "391 + 11"),),
            (_tool("11", 0), _tool("402", 1)),
            (_say("17 * 23 = 391 and 5 + 6 = 11."),),
            _user("Now 2 ** 10?"),
            (_calls("Let me compute that.", "2 ** 10"),),
            (_tool("1024"),),
            (_say("1024."),),
        ),
        tools=True,
    ),
    Probe(
        "one tool call a turn",
        (
            _user("Compute 3 + 4 with the calculator."),
            (_calls("", "3 + 4"),),
            (_tool("7"),),
            (_calls("", "7 * 6"),),
            (_tool("42"),),
            (_say("3 + 4 = 7 and 7 * 6 = 42."),),
        ),
        tools=True,
    ),
    Probe(
        "thinking",
        (
            (SYSTEM, *_user("What is 9 * 8?")),
            (_calls("", "9 * 8", reasoning="I should use the calculator."),),
            (_tool("72"),),
            (_say("9 * 8 = 72.", reasoning="The tool says 72."),),
            _user("And 72 - 5?"),
            (_say("67.", reasoning="72 - 5 is 67."),),
            _user("Thanks!"),
            (_say("Any time."),),
        ),
        tools=True,
    ),
)
"""The probe conversations of the render check."""


def _look(text: str, *digests: str) -> tuple[Message, ...]:
    parts: list[dict[str, Any]] = [{"type": "image", "sha256": d} for d in digests]
    return ({"role": "user", "content": [*parts, {"type": "text", "text": text}]},)


IMAGE_PROBES: tuple[Probe, ...] = (
    Probe(
        "images",
        (
            (SYSTEM, *_look("How many red squares are there?", "a" * 64)),
            (_say("Two."),),
            _look("And in these two?", "b" * 64, "c" * 64),
            (_say("One and three."),),
            _user("Thanks."),
            (_say("You are welcome."),),
        ),
    ),
)
"""Probes of a vision-language policy's template: user messages with image parts (template form, see
:mod:`miles.sessions.images`), in the first turn and a later one."""


@dataclass
class TemplateFailure:
    """Where a template stops being append-only."""

    probe: str
    turn: int
    """Index of the turn whose rendering broke the prefix (0-based)."""
    message: int
    """Index (in the conversation) of the first message that renders differently, or of the turn's first."""
    role: str
    rule: str
    """Which of the two rules of the module docstring failed."""
    before: str
    """Text of the earlier rendering from the first differing token on (truncated)."""
    after: str
    """Text of the later rendering from the same token on (truncated)."""

    def __str__(self) -> str:
        return (
            f"probe {self.probe!r}, turn {self.turn} (message {self.message}, role {self.role}): {self.rule}; "
            f"it rendered {self.before!r} and now renders {self.after!r}"
        )


@dataclass
class TemplateReport:
    """The result of :func:`check_append_only`."""

    template: str
    ok: bool
    checked: int = 0
    """Prefix relations checked."""
    failure: TemplateFailure | None = None
    skipped: list[str] = field(default_factory=list)
    """Probes the template refused to render, with its message."""

    def summary(self) -> str:
        if self.ok:
            skipped = f"; skipped: {'; '.join(self.skipped)}" if self.skipped else ""
            return f"{self.template} is append-only ({self.checked} prefix checks){skipped}"
        return f"{self.template} is not append-only: {self.failure}"


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """The first index where ``a`` and ``b`` differ (``len(a)`` when ``a`` is a prefix of ``b``)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _excerpt(renderer: ChatRenderer, ids: Sequence[int], start: int, width: int = 48) -> str:
    return renderer.decode(ids[start : start + width]) or "<end>"


def offending_message(
    renderer: ChatRenderer,
    history: Sequence[Message],
    later: Sequence[int],
    tools: Sequence[Any] | None,
    template_kwargs: dict[str, Any] | None = None,
) -> int:
    """Index of the first message of ``history`` whose rendering is no longer a prefix of ``later``."""
    for i in range(1, len(history) + 1):
        try:
            ids = renderer.ids(history[:i], tools=tools, template_kwargs=template_kwargs)
        except TemplateRenderError:
            continue
        if ids != list(later[: len(ids)]):
            return i - 1
    return max(len(history) - 1, 0)


def _check_probe(renderer: ChatRenderer, probe: Probe, report: TemplateReport) -> TemplateFailure | None:
    tools = [CALCULATOR_TOOL] if probe.tools else None
    history: list[Message] = []
    previous: list[int] | None = None  # rendering of the history through the last assistant turn
    for t, turn in enumerate(probe.turns):
        is_reply = len(turn) == 1 and turn[0]["role"] == "assistant" and t > 0
        if is_reply:
            prompt = renderer.ids(history, tools=tools, add_generation_prompt=True)
            history = [*history, *turn]
            full = renderer.ids(history, tools=tools)
            report.checked += 1
            i = first_difference(prompt, full)
            if i < len(prompt):
                m = offending_message(renderer, history[:-1], full, tools)
                m = m if renderer.ids(history[: m + 1], tools=tools) != full[: i + 1] else len(history) - 1
                return TemplateFailure(
                    probe.name, t, m, history[m]["role"],
                    "the generation prompt is not a prefix of the assistant turn it starts",
                    _excerpt(renderer, prompt, i), _excerpt(renderer, full, i),
                )  # fmt: skip
            previous = full
            continue
        before, history = history, [*history, *turn]
        if t and probe.turns[t - 1][0]["role"] != "assistant":
            # two non-reply turns in a row (messages a caller split): each must extend the last
            split = renderer.ids(before, tools=tools)
            now = renderer.ids(history, tools=tools)
            report.checked += 1
            i = first_difference(split, now)
            if i < len(split):
                return TemplateFailure(
                    probe.name, t, len(before) - 1, before[-1]["role"],
                    "messages of one turn do not render as a prefix of each other when split into turns",
                    _excerpt(renderer, split, i), _excerpt(renderer, now, i),
                )  # fmt: skip
        if previous is None:
            continue
        later = renderer.ids(history, tools=tools, add_generation_prompt=True)
        report.checked += 1
        i = first_difference(previous, later)
        if i < len(previous):
            earlier = history[: len(history) - len(turn)]
            m = offending_message(renderer, earlier, later, tools)
            return TemplateFailure(
                probe.name, t, m, earlier[m]["role"],
                "the history renders differently once the next messages arrive",
                _excerpt(renderer, previous, i), _excerpt(renderer, later, i),
            )  # fmt: skip
    return None


def _without_reasoning(probe: Probe) -> Probe:
    turns = tuple(tuple({k: v for k, v in m.items() if k != "reasoning_content"} for m in turn) for turn in probe.turns)
    return Probe(probe.name, turns, probe.tools)


def check_append_only(renderer: ChatRenderer, probes: Sequence[Probe] = PROBES) -> TemplateReport:
    """Render every probe turn by turn and check both prefix rules (see the module docstring).

    With ``enable_thinking = false`` among the template arguments the probes carry no reasoning (the
    generation prompt closes the thinking block, so a reply cannot have one).
    """
    report = TemplateReport(renderer.name, ok=True)
    rendered = 0
    if renderer.template_kwargs.get("enable_thinking", True) is False:
        probes = [_without_reasoning(p) for p in probes]
    for probe in probes:
        try:
            failure = _check_probe(renderer, probe, report)
        except TemplateRenderError as exc:
            report.skipped.append(f"{probe.name}: {exc}")
            continue
        rendered += 1
        if failure is not None:
            report.ok = False
            report.failure = failure
            return report
    if rendered == 0:
        report.ok = False
        report.failure = TemplateFailure(
            "all", 0, 0, "", "the template renders none of the probe conversations", "", ""
        )
    return report
