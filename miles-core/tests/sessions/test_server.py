"""The session server over a real local engine: OpenAI's client unchanged, exact samples, the error
contract (400 naming the field, 404, 409, ``length`` at the context limit), branches, routed experts."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles.rollout.http_client import HttpEngineClient
from miles.sessions.server import SessionServer, TemplateNotAppendOnly
from miles.settings.sessions import SessionSettings
from miles.testing.chat_templates import build_chat_tokenizer
from miles.testing.engine import EngineProcess
from miles.types import Sample, SampleStatus

from .conftest import serving

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from miles.testing.models import build_tiny_model

    root = tmp_path_factory.mktemp("session-models")
    return {
        "dense": build_tiny_model(root / "dense", "qwen2", seed=0),
        "moe": build_tiny_model(root / "moe", "qwen2_moe", seed=0),
    }


@pytest.fixture(scope="module")
def engine(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    with EngineProcess(models["dense"], log_path=tmp_path_factory.mktemp("logs") / "engine.log") as proc:
        yield proc


async def new_session(http: httpx.AsyncClient, **body: Any) -> str:
    resp = await http.post("/sessions", json=body)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["id"])


def test_openai_client_drives_a_session_and_the_samples_are_exact(engine: EngineProcess) -> None:
    openai = pytest.importorskip("openai")

    async def run() -> None:
        async with serving(engine.url, max_tokens=6) as (server, http):
            assert server.live is not None and server.live.ok, server.live
            sid = await new_session(http, sampling={"seed": 7, "temperature": 0.8, "override": True})
            client = openai.AsyncOpenAI(base_url=f"{server.url}/sessions/{sid}/v1", api_key="unused", max_retries=0)
            messages: list[Any] = [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 2 + 3?"},
            ]
            turns = []
            for k in range(4):
                reply = await client.chat.completions.create(
                    model="policy", messages=messages, logprobs=True, temperature=0.1,  # overridden by the session
                    extra_body={"return_token_ids": True},
                )  # fmt: skip
                choice = reply.choices[0]
                extra = reply.model_extra or {}
                turns.append((extra["prompt_token_ids"], choice.model_extra["token_ids"], choice.logprobs))
                assert reply.usage is not None and reply.usage.completion_tokens == len(turns[-1][1])
                assert extra["miles"]["session_id"] == sid and extra["miles"]["branch"] is False
                messages.append(choice.message.model_dump(exclude_none=True))  # as agents keep history
                messages.append({"role": "user", "content": f"And then {k}?"})
            await client.close()
            samples = [Sample.from_dict(d) for d in (await http.get(f"/sessions/{sid}/samples")).json()]
            assert len(samples) == 1
            sample = samples[0]
            sample.validate()
            prompt0 = turns[0][0]
            assert sample.prompt_ids == prompt0
            last_prompt, last_out, _ = turns[-1]
            assert sample.tokens == last_prompt + last_out  # the last request's prompt held every earlier token
            mask = [0] * len(sample.tokens)
            logprobs = [0.0] * len(sample.tokens)
            for k, (prompt, _out, lps) in enumerate(turns):
                if k:
                    previous = turns[k - 1][0] + turns[k - 1][1]
                    assert prompt[: len(previous)] == previous  # each prompt extends the last, exactly
                for i, entry in enumerate(lps.content):
                    mask[len(prompt) + i] = 1
                    logprobs[len(prompt) + i] = entry.logprob
            n = len(prompt0)
            assert sample.loss_mask == mask[n:] and sample.rollout_logprobs == logprobs[n:]
            info = sample.metadata["session"]
            assert info["turns"] == 4 and info["branches"] == 0 and info["append_only_violations"] == 0
            assert info["cached_tokens"] > 0  # later turns reuse the engine's cache of the session's prefix
            assert (await http.delete(f"/sessions/{sid}")).json() == {"id": sid, "deleted": True}
            assert (await http.get(f"/sessions/{sid}/samples")).status_code == 404

    asyncio.run(run())


TINY_PNG = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
)
"""A 1x1 PNG."""

BAD = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "tool", "content": "5"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content[0].image_url.url"),
    ({"messages": [{"role": "user", "content": ["hi", {"type": "image_url", "image_url": {"url": TINY_PNG}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": TINY_PNG}}]}]}, "messages[0].content[1].image_url.url"),  # a text policy
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}]}, "messages[0].tool_calls[0].function.name"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": True}, "stream"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "prefilled"}]}, "messages[1]"),
    ([1, 2], "body"),
]  # fmt: skip


def test_malformed_requests_are_400_naming_the_field_and_unknown_sessions_404(engine: EngineProcess) -> None:
    async def run() -> None:
        async with serving(engine.url, live_check=False) as (_, http):
            sid = await new_session(http)
            url = f"/sessions/{sid}/v1/chat/completions"
            for body, param in BAD:
                resp = await http.post(url, json=body)
                assert resp.status_code == 400, (body, resp.text)
                error = resp.json()["error"]
                assert error["param"] == param and error["message"].startswith(param), (body, error)
                assert error["type"] == "invalid_request_error"
            resp = await http.post(url, content=b"{not json")
            assert resp.status_code == 400 and resp.json()["error"]["message"].startswith("malformed JSON body")
            resp = await http.post("/sessions", json={"sampling": {"temperature": -1}})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "sampling.temperature"
            for method, path in [("POST", "/sessions/nope/v1/chat/completions"), ("GET", "/sessions/nope/samples"),
                                 ("GET", "/sessions/nope"), ("DELETE", "/sessions/nope")]:  # fmt: skip
                resp = await http.request(method, path, json={"messages": [{"role": "user", "content": "hi"}]})
                assert resp.status_code == 404 and resp.json()["error"]["message"] == "unknown session 'nope'"
            # nothing new after the stored reply
            first = await http.post(url, json={"messages": [{"role": "user", "content": "hi"}]})
            reply = first.json()["choices"][0]["message"]
            resp = await http.post(url, json={"messages": [{"role": "user", "content": "hi"}, reply]})
            assert (
                resp.status_code == 400
                and "nothing after the assistant's last reply" in resp.json()["error"]["message"]
            )

    asyncio.run(run())


def test_a_session_at_the_context_length_finishes_with_length_never_a_500(engine: EngineProcess) -> None:
    async def run() -> None:
        async with serving(engine.url, live_check=False, context_length=96, max_tokens=16) as (_, http):
            sid = await new_session(http, sampling={"seed": 1, "override": True})
            url = f"/sessions/{sid}/v1/chat/completions"
            messages: list[Any] = [{"role": "user", "content": "Tell me a long story about the sea."}]
            finishes = []
            lengths = []
            for k in range(12):
                resp = await http.post(url, json={"messages": messages, "return_token_ids": True})
                assert resp.status_code == 200, resp.text
                body = resp.json()
                finishes.append(body["choices"][0]["finish_reason"])
                lengths.append(body["usage"]["total_tokens"])
                if body["miles"]["turn"] is None:  # nothing fits any more
                    assert body["miles"]["reason"].startswith("context length 96 reached")
                    break
                messages += [body["choices"][0]["message"], {"role": "user", "content": f"More {k}."}]
            assert finishes[-1] == "length" and max(lengths) <= 96 + 8
            (sample,) = [Sample.from_dict(d) for d in (await http.get(f"/sessions/{sid}/samples")).json()]
            assert sample.status == SampleStatus.TRUNCATED and len(sample.tokens) <= 96
            assert sample.status_reason.startswith(("context length 96", "length"))

    asyncio.run(run())


def test_an_edited_history_starts_a_branch_and_both_trajectories_are_kept(engine: EngineProcess) -> None:
    async def run() -> None:
        async with serving(engine.url, live_check=False, max_tokens=4) as (_, http):
            sid = await new_session(http)
            url = f"/sessions/{sid}/v1/chat/completions"
            m = [{"role": "user", "content": "What is 2 + 2?"}]
            r1 = (await http.post(url, json={"messages": m})).json()
            m += [r1["choices"][0]["message"], {"role": "user", "content": "Sure?"}]
            r2 = (await http.post(url, json={"messages": m})).json()
            edited = [*m[:2], {"role": "user", "content": "Really sure?"}]
            r3 = (await http.post(url, json={"messages": edited})).json()
            assert (r1["miles"]["branch"], r2["miles"]["branch"], r3["miles"]["branch"]) == (False, False, True)
            info = (await http.get(f"/sessions/{sid}")).json()
            assert info["branches"] == 1 and info["trajectories"] == 2 and info["turns"] == 3
            samples = [Sample.from_dict(d) for d in (await http.get(f"/sessions/{sid}/samples")).json()]
            assert samples[0].prompt_ids == samples[1].prompt_ids
            assert samples[-1].metadata["messages"][-2]["content"] == "Really sure?"  # the latest path last

    asyncio.run(run())


def test_moe_routed_experts_of_a_session_equal_a_fresh_prefill(models: dict[str, Path], tmp_path: Path) -> None:
    async def run(url: str) -> None:
        async with serving(url, live_check=False, max_tokens=5, return_routed_experts=True) as (server, http):
            sid = await new_session(http, sampling={"seed": 3, "override": True})
            messages: list[Any] = [{"role": "user", "content": "Hi"}]
            for k in range(3):
                body = (await http.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": messages})).json()
                messages += [body["choices"][0]["message"], {"role": "user", "content": f"again {k}"}]
            (sample,) = [Sample.from_dict(d) for d in (await http.get(f"/sessions/{sid}/samples")).json()]
            sample.validate()
            assert sample.routed_experts is not None and sample.routed_experts_shape is not None
            assert sample.routed_experts_shape[0] == len(sample.tokens) - 1
            await server.client.flush_cache()
            async with httpx.AsyncClient(timeout=60) as direct:
                out = (await direct.post(url + "/generate", json={
                    "input_ids": sample.tokens, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                    "return_routed_experts": True})).json()  # fmt: skip
            import base64

            fresh = base64.b64decode(out["meta_info"]["routed_experts"])
            assert fresh[: len(sample.routed_experts)] == sample.routed_experts

    with EngineProcess(models["moe"], log_path=tmp_path / "moe.log") as proc:
        asyncio.run(run(proc.url))


def test_the_official_qwen3_template_is_refused_and_the_fixed_one_accepted() -> None:
    tok = build_chat_tokenizer("qwen3")
    client = HttpEngineClient(["http://127.0.0.1:9"])  # never called: the check runs before any generation
    try:
        with pytest.raises(TemplateNotAppendOnly, match=r"probe 'chat', turn 2 \(message 2, role assistant\)") as exc:
            SessionServer(client, tok, SessionSettings())
        assert "rollout.sessions.chat_template" in str(exc.value) and not exc.value.report.ok
        server = SessionServer(client, tok, SessionSettings(chat_template="qwen3"))
        assert server.report.ok and (server.tool_parser, server.reasoning_parser) == ("hermes", "think")
        info = server.info()
        assert info["append_only"]["ok"] and info["template"] == "the fixed template 'qwen3'"
    finally:
        asyncio.run(client.close())


def test_requests_are_validated_before_sampling_json_tools_round_trip() -> None:
    """``tools`` are rendered exactly as sent (key order kept): the session key includes them."""
    from miles.sessions.messages import tools_key

    a = [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}]
    assert tools_key(a, {}) == tools_key(json.loads(json.dumps(a)), {})
    assert tools_key(a, {}) != tools_key(a, {"enable_thinking": False})
