"""One episode: a question, calculator calls as the model asks for them, a final ``ANSWER: <n>``.

This is an ordinary OpenAI tool-use loop (``openai.AsyncOpenAI`` against ``ctx.base_url``); nothing in
it knows about tokens. The session server behind ``base_url`` records what the policy sampled.
"""

from __future__ import annotations

import json
import re
from typing import Any

from miles.sessions.rollout import EpisodeContext
from miles_calculator_agent.calculator import CALCULATOR_TOOL, calculate

__all__ = ["MAX_TURNS", "SYSTEM_PROMPT", "calculator_episode", "final_answer"]

SYSTEM_PROMPT = "You are a calculator agent. Call the calculator for every sum, then reply with ANSWER: <number>."
MAX_TURNS = 4
"""Model turns per episode at most (``sample.metadata["max_turns"]`` overrides it)."""
_NUDGE = "Reply with ANSWER: <number>, or call the calculator."
_ANSWER = re.compile(r"ANSWER:\s*(-?\d+(?:\.\d+)?)")


def final_answer(text: str | None) -> str | None:
    """The number after ``ANSWER:`` in ``text`` (the last one), if any."""
    found = _ANSWER.findall(text or "")
    return found[-1] if found else None


def _arguments(raw: str) -> str:
    try:
        value = json.loads(raw)
    except ValueError:
        return ""
    return str(value.get("expression", "")) if isinstance(value, dict) else ""


async def calculator_episode(ctx: EpisodeContext) -> dict[str, Any]:
    """Arithmetic with a calculator tool through the openai client (the question is the data's prompt;
    :data:`SYSTEM_PROMPT` goes first unless the data set gives a system message)."""
    import openai

    client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
    messages: list[Any] = ctx.messages
    if messages[0].get("role") not in ("system", "developer"):
        messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
    answer: str | None = None
    tool_calls = 0
    turns = int(ctx.sample.metadata.get("max_turns", MAX_TURNS))
    try:
        for _ in range(turns):
            reply = await client.chat.completions.create(
                model="policy",
                messages=messages,
                tools=[CALCULATOR_TOOL],  # type: ignore[list-item]  # a plain dict in OpenAI's shape
                max_tokens=ctx.max_tokens,
            )
            choice = reply.choices[0]
            messages.append(choice.message.model_dump(exclude_none=True))
            if choice.message.tool_calls:
                for call in choice.message.tool_calls:
                    tool_calls += 1
                    result = calculate(_arguments(call.function.arguments))  # type: ignore[union-attr]
                    messages.append({"role": "tool", "content": result, "tool_call_id": call.id})
                continue
            answer = final_answer(choice.message.content)
            if answer is not None or choice.finish_reason == "length":
                break
            messages.append({"role": "user", "content": _NUDGE})
    finally:
        await client.close()
    return {"answer": answer, "calculator_calls": tool_calls}
