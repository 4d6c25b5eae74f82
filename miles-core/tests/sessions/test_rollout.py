"""Agent episodes as a rollout function: the rollout manager runs N episodes per prompt through the
openai client against the session server it starts; the samples are the sessions' exact records."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import pytest

from miles.data.base import Prompt
from miles.rollout.http_client import HttpEngineClient
from miles.rollout.manager import RolloutManager
from miles.sessions.rollout import EpisodeContext, SessionRollout
from miles.sessions.server import SessionServer
from miles.settings.model import RolloutSettings
from miles.settings.sessions import SessionSettings
from miles.testing import check_rollout_function
from miles.testing.engine import EngineProcess
from miles.types import Sample, SampleStatus

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    from miles.testing.models import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("rollout-model") / "tiny", "qwen2", seed=0)
    with EngineProcess(model, log_path=tmp_path_factory.mktemp("logs") / "engine.log") as proc:
        yield proc


async def three_turns(ctx: EpisodeContext) -> dict[str, Any]:
    """Ask, then ask to go on twice: any OpenAI client works against ``ctx.base_url``."""
    client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
    messages: list[Any] = ctx.messages
    for _ in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=ctx.max_tokens)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
    await client.close()
    return {"episode_turns": 3, "last_reply": messages[-2]["content"]}


class Prompts:
    def __init__(self, prompts: list[Prompt]) -> None:
        self.prompts = prompts

    def next_batch(self, n: int) -> list[Prompt]:
        return self.prompts[:n]


def prompts(tokenizer: Any, *, chat: bool = False) -> Prompts:
    """Two prompts, as text or (``chat``) as the messages a data set with ``data.system_prompt`` gives."""
    texts = ["What is 2 + 3?", "Name a colour."]
    out = []
    for i, t in enumerate(texts):
        messages = [{"role": "system", "content": "Be brief."}] * chat + [{"role": "user", "content": t}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        out.append(Prompt(messages if chat else t, label=str(i), prompt_ids=list(ids)))
    return Prompts(out)


def ctx_messages(prompt: Prompt) -> list[dict[str, Any]]:
    return prompt.messages or [{"role": "user", "content": prompt.prompt}]


async def score(samples: Sequence[Sample]) -> None:
    for s in samples:
        s.reward = float(len(s.metadata.get("last_reply", "")) % 3)


def settings(**sessions: Any) -> RolloutSettings:
    return RolloutSettings(
        rollout_batch_size=2, n_samples_per_prompt=3, max_new_tokens=5, sessions=SessionSettings(**sessions)
    )


@pytest.mark.parametrize("chat", [False, True], ids=["text-prompts", "chat-prompts"])
def test_the_manager_runs_a_grpo_group_of_episodes_per_prompt(engine: EngineProcess, chat: bool) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(engine.model_path)
    data = prompts(tokenizer, chat=chat)
    function = SessionRollout(three_turns)
    check_rollout_function(function, name="three_turns")

    async def rollout() -> tuple[Any, str | None]:
        async with HttpEngineClient([engine.url]) as client:
            manager = RolloutManager(client, settings(), scorer=score, rollout_function=function, seed=5)
            try:
                return await manager.rollout(data), function.url
            finally:
                await manager.close()

    result, url = asyncio.run(rollout())
    assert url is not None and function.url is None  # started for the rollout, stopped by close()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)
    assert [len(g) for g in result.groups] == [3, 3]
    for group, prompt in zip(result.groups, data.prompts, strict=True):
        for i, s in enumerate(group.samples):
            s.validate()
            assert (s.group_id, s.index, s.label) == (group.group_id, i, prompt.label)
            # the session's first prompt is the data pipeline's: one chat template, applied the same way, to
            # the conversation the data gave (ctx.messages: the system message too, for chat prompts)
            assert s.prompt_ids == prompt.prompt_ids and s.prompt == prompt.text
            assert s.prompt_messages == prompt.messages and (s.prompt_messages is not None) == chat
            assert s.metadata["messages"][: 1 + chat] == ctx_messages(prompt)
            assert s.metadata["session"]["turns"] == 3 and s.metadata["episode_turns"] == 3
            assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
            spans = s.metadata["session"]["policy_spans"]
            assert sum(s.loss_mask) == sum(b - a for a, b in spans) and all(
                s.loss_mask[a:b] == [1] * (b - a) for a, b in spans
            )
        assert len({tuple(s.response_ids) for s in group.samples}) == 3  # a seed per sample: three episodes
    m = result.metrics
    assert m["sessions/episodes"] == 6 and m["sessions/turns_per_episode_mean"] == 3.0
    assert m["sessions/append_only_violations"] == 0 and m["sessions/branches"] == 0
    assert 0 < m["sessions/masked_fraction"] < 1 and m["sessions/prefix_cache_hit_rate"] > 0.5

    # reproducible: the same seed gives the same episodes token for token
    again, _ = asyncio.run(rollout())
    assert [s.tokens for s in again.samples] == [s.tokens for s in result.samples]


def test_episodes_sampled_with_top_k_carry_their_kept_sets_to_the_trainer(engine: EngineProcess) -> None:
    """``rollout.replay_sampling_mask`` with sessions: the manager asks the engines for the kept sets, and each
    episode's sample (the session's, copied into the group) carries one set per policy token and an empty row
    for the tokens no request sampled (sampling-mask replay, issue 40)."""
    from transformers import AutoTokenizer

    data = prompts(AutoTokenizer.from_pretrained(engine.model_path))
    function = SessionRollout(three_turns)
    rollout_settings = settings()
    rollout_settings.top_k, rollout_settings.replay_sampling_mask = 4, True

    async def rollout() -> Any:
        async with HttpEngineClient([engine.url]) as client:
            manager = RolloutManager(client, rollout_settings, scorer=score, rollout_function=function, seed=5)
            try:
                return await manager.rollout(data)
            finally:
                await manager.close()

    result = asyncio.run(rollout())
    for s in result.samples:
        s.validate()
        assert s.sampling_mask is not None and len(s.sampling_mask) == len(s.response_ids)
        for token, kept, in_loss in zip(s.response_ids, s.sampling_mask, s.loss_mask, strict=True):
            assert (token in kept and 1 <= len(kept) <= 4) if in_loss else kept == [], (token, kept, in_loss)


async def one_turn_then_fail(ctx: EpisodeContext) -> dict[str, Any]:
    client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    await client.close()
    raise RuntimeError("the tool sandbox crashed")


async def no_request(ctx: EpisodeContext) -> None:
    return None


def test_failed_episodes_keep_what_the_session_recorded_and_an_external_server_works(engine: EngineProcess) -> None:
    async def run() -> tuple[Sample, Sample]:
        async with HttpEngineClient([engine.url]) as client:
            server = await SessionServer.for_engines(client, SessionSettings(live_check=False))
            url = await server.start()
            try:
                failing, silent = SessionRollout(one_turn_then_fail), SessionRollout(no_request)
                for fn in (failing, silent):
                    await fn.start(client, settings(url=url))
                    assert fn.url == url
                sample = Sample(prompt_ids=[1, 2], group_id=4, index=1)
                params = RolloutManager(client, settings(), scorer=score).sampling_params(seed=9)
                a = await failing(client, sample, params)
                b = await silent(client, sample, params)
                assert server.sessions == {}  # both sessions were deleted
                await failing.aclose()
                await silent.aclose()
                return a, b
            finally:
                await server.stop()

    failed, empty = asyncio.run(run())
    assert failed.status == SampleStatus.FAILED and failed.status_reason == "episode failed: the tool sandbox crashed"
    assert failed.metadata["session"]["turns"] == 1 and sum(failed.loss_mask) > 0
    assert empty.status == SampleStatus.FAILED and empty.status_reason.startswith("the episode recorded no turn")


def test_rollout_settings_carry_the_session_section() -> None:
    s = RolloutSettings.model_validate({"sessions": {"chat_template": "qwen3", "max_tokens": 64}})
    assert s.sessions.chat_template == "qwen3" and s.sessions.live_check
    with pytest.raises(ValueError, match="tool_parser"):
        RolloutSettings.model_validate({"sessions": {"tool_parser": "xml"}})
