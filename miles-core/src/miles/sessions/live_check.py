"""The live check: a session's tokens and logprobs equal a direct ``/generate`` on the same ids.

A short seeded session (a user turn, a tool turn, a user turn) goes through the server's own path;
each turn's prompt ids are then sent straight to the engine with the same sampling parameters and
seed. The outputs must be the same token ids with logprobs within ``tolerance``, and every turn's prompt
must extend the previous turn's prompt and reply exactly. It catches what the CPU check cannot: the
engine seeing other tokens than the session recorded (a template variable the check did not use, a
tokenizer that is not the engine's, a proxy rewriting requests).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

from miles.sessions.append_only import CALCULATOR_TOOL
from miles.sessions.session import SessionSampling

if TYPE_CHECKING:
    from miles.sessions.service import SessionService

__all__ = ["LiveCheckReport", "live_check"]


@dataclass
class LiveCheckReport:
    ok: bool
    turns: int
    max_logprob_diff: float
    problem: str = ""

    def summary(self) -> str:
        if self.ok:
            return f"live check passed: {self.turns} turns equal a direct /generate (max |dlogprob| {self.max_logprob_diff:.2e})"
        return f"live check failed: {self.problem}"


async def live_check(
    server: SessionService, *, tolerance: float = 1e-4, max_tokens: int = 8, seed: int = 20240
) -> LiveCheckReport:
    """Run the check on ``server``'s engines (see the module docstring); the probe session is deleted."""
    session = server.create_session(sampling=SessionSampling(seed=seed, max_tokens=max_tokens, override=True))
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "What is 2 + 3?"},
    ]
    follow_ups: list[dict[str, Any]] = [
        {"role": "tool", "content": "5", "tool_call_id": "call_0"},
        {"role": "user", "content": "And 4 + 5?"},
    ]
    prompts: list[list[int]] = []
    outputs: list[tuple[list[int], list[float]]] = []
    try:
        for step in range(3):
            body = {"messages": messages, "tools": [CALCULATOR_TOOL], "return_token_ids": True, "logprobs": True}
            answer = await server.chat(session.id, body)
            choice = answer["choices"][0]
            prompts.append(list(answer["prompt_token_ids"]))
            outputs.append((list(choice["token_ids"]), [e["logprob"] for e in choice["logprobs"]["content"]]))
            message = {k: v for k, v in choice["message"].items() if v is not None}
            messages = [*messages, message]
            if step < 2:
                follow = dict(follow_ups[step])
                if follow["role"] == "tool" and message.get("tool_calls"):
                    follow["tool_call_id"] = message["tool_calls"][0]["id"]
                messages.append(follow)
        for k in range(1, len(prompts)):
            before = prompts[k - 1] + outputs[k - 1][0]
            if prompts[k][: len(before)] != before:
                return LiveCheckReport(False, k, 0.0, f"turn {k}'s prompt does not extend turn {k - 1}'s tokens")
        worst = 0.0
        for k, (prompt, (ids, logprobs)) in enumerate(zip(prompts, outputs, strict=True)):
            params = server._params(session, _Defaults(), server.context_length - len(prompt), k)
            params = replace(params, max_new_tokens=len(ids) or 1)
            direct = (await server.client.generate(prompt, params, routing_key=session.routing_key))[0]
            if list(direct.output_ids) != ids:
                return LiveCheckReport(
                    False,
                    k,
                    worst,
                    f"turn {k}: the session sampled {ids} but /generate on the same ids gave {direct.output_ids}",
                )
            for a, b in zip(direct.output_logprobs, logprobs, strict=True):
                worst = max(worst, abs(a - b))
            if worst > tolerance:
                return LiveCheckReport(False, k, worst, f"turn {k}: logprobs differ by {worst:.2e} (> {tolerance:.1e})")
        return LiveCheckReport(True, len(prompts), worst)
    finally:
        server.sessions.pop(session.id, None)


class _Defaults:
    """A request with nothing set (the session's sampling applies)."""

    temperature = None
    top_p = None
    limit = None
    seed = None
    stop_list: ClassVar[list[str]] = []
