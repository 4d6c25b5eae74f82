"""Sampling-mask replay through the session server (issue 40): a multi-turn session sampled with top-k over
a real local engine keeps each policy token's kept set and its behaviour logprob (under the set,
renormalised), and leaves the tokens no request sampled (the user's turns, the template's) with an empty
row, whose distribution the trainer leaves whole. The behaviour logprobs are an independent HF forward's
renormalised over the recorded sets."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from miles.rollout.http_client import HttpEngineClient
from miles.sessions.server import SessionServer
from miles.settings.sessions import SessionSettings
from miles.testing.engine import EngineProcess
from miles.types import Sample

pytestmark = pytest.mark.slow

TEMPERATURE = 0.8
TOP_K = 5


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from miles.testing.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("mask-session") / "dense", "qwen2", seed=0)


@pytest.fixture(scope="module")
def engine(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    with EngineProcess(model, log_path=tmp_path_factory.mktemp("logs") / "engine.log") as proc:
        yield proc


def three_turns(url: str, *, replay: bool) -> Sample:
    """A 3-turn session at top-k 5; its one sample. ``replay``: the engine client asks for the kept sets, as
    the rollout manager sets it for ``rollout.replay_sampling_mask``."""

    async def run() -> Sample:
        async with HttpEngineClient([url]) as client:
            client.return_sampling_mask = replay
            server = await SessionServer.for_engines(client, SessionSettings(max_tokens=6, live_check=False))
            base = await server.start()
            try:
                async with httpx.AsyncClient(base_url=base, timeout=120) as http:
                    sampling = {"seed": 3, "temperature": TEMPERATURE, "top_k": TOP_K, "override": True}
                    sid = (await http.post("/sessions", json={"sampling": sampling})).json()["id"]
                    messages: list[Any] = [{"role": "user", "content": "Count with me: 1, 2"}]
                    for k in range(3):
                        resp = await http.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": messages})
                        assert resp.status_code == 200, resp.text
                        messages += [resp.json()["choices"][0]["message"], {"role": "user", "content": f"{k + 3}?"}]
                    (data,) = (await http.get(f"/sessions/{sid}/samples")).json()
                    return Sample.from_dict(data)
            finally:
                await server.stop()

    return asyncio.run(run())


def test_a_top_k_session_keeps_every_policy_tokens_kept_set_and_behaviour_logprob(
    engine: EngineProcess, model: Path
) -> None:
    from transformers import AutoModelForCausalLM

    sample = three_turns(engine.url, replay=True)
    sample.validate()
    assert sample.metadata["session"]["turns"] == 3
    assert sample.sampling_mask is not None and len(sample.sampling_mask) == len(sample.response_ids)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([sample.tokens])).logits[0].double() / TEMPERATURE
    rows = torch.log_softmax(logits[len(sample.prompt_ids) - 1 : -1], dim=-1)
    policy = 0
    entries = zip(sample.response_ids, sample.sampling_mask, sample.loss_mask, strict=True)
    for i, (token, kept, in_loss) in enumerate(entries):
        if not in_loss:
            assert kept == [], (i, kept)  # a token no request sampled: its distribution stays whole
            continue
        policy += 1
        assert token in kept and 1 <= len(kept) <= TOP_K, (i, token, kept)
        renormalised = float(rows[i, token] - torch.logsumexp(rows[i, kept], 0))
        assert abs(sample.rollout_logprobs[i] - renormalised) < 1e-4, (i, sample.rollout_logprobs[i], renormalised)
    assert policy == sum(sample.loss_mask) and 0 < policy < len(sample.response_ids)

    plain = three_turns(engine.url, replay=False)  # without replay: no sets, the whole vocabulary's logprobs
    assert plain.sampling_mask is None
