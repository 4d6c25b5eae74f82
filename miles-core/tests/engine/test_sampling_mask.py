"""The local engine's sampling masks (SGLang 0.5.23's ``return_sampling_mask``, issue 40): over real HTTP each
output token's kept set under top-k / top-p equals a reference computed from the engine's own distribution
at that position (its ``output_top_logprobs`` over the whole vocabulary), most likely first, and the
reported behaviour logprob is the sampled token's under that set renormalised; greedy rows are the token
alone; bad requests are 400s naming the field."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from miles.engine.sampling import sample_rows
from miles.rollout.protocol import SamplingParams
from miles.testing.engine import EngineProcess

from .conftest import start_engine

VOCAB = 512
PROMPT = [5, 17, 33, 48, 91, 120, 7, 250, 300, 12, 64, 77]


@pytest.fixture(scope="module")
def engine(engine_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    yield from start_engine(engine_models["qwen2"], tmp_path_factory.mktemp("logs") / "server.log")


def reference_kept(logprobs: dict[int, float], top_k: int, top_p: float) -> list[int]:
    """The kept set by the definitions (top-k with ties at the k-th probability, then top-p over what is
    left, renormalised), from one position's full distribution; most likely first."""
    ranked = sorted(logprobs.items(), key=lambda kv: -kv[1])
    if 0 < top_k < len(ranked):
        kth = ranked[top_k - 1][1]
        ranked = [(t, lp) for t, lp in ranked if lp >= kth]
    total = sum(math.exp(lp) for _, lp in ranked)
    kept, before = [], 0.0
    for token, lp in ranked:
        if before > top_p * total:
            break
        kept.append(token)
        before += math.exp(lp)
    return kept


@pytest.mark.parametrize(("top_k", "top_p"), [(20, 0.9), (-1, 0.9), (20, 1.0)])
def test_masks_equal_a_reference_from_the_engines_distribution(engine: EngineProcess, top_k: int, top_p: float) -> None:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {
            "max_new_tokens": 12,
            "temperature": 0.7,
            "top_k": top_k,
            "top_p": top_p,
            "sampling_seed": 11,
            "n": 2,
        },
        "return_logprob": True,
        "top_logprobs_num": VOCAB,
        "return_sampling_mask": True,
    }
    answer = httpx.post(engine.url + "/generate", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    for out in answer.json():
        meta = out["meta_info"]
        masks, behaviour = meta["output_token_sampling_mask"], meta["output_token_sampling_logprobs"]
        assert len(masks) == len(behaviour) == meta["output_token_sampling_mask_length"] == len(out["output_ids"])
        for token, mask, lp, top in zip(out["output_ids"], masks, behaviour, meta["output_top_logprobs"], strict=True):
            full = {int(t): float(v) for v, t, _ in top}
            assert len(full) == VOCAB
            expected = reference_kept(full, top_k, top_p)
            assert sorted(mask) == sorted(expected)
            ordered = [full[t] for t in mask]  # most likely first (equal probabilities in id order)
            assert all(a >= b - 1e-7 for a, b in itertools.pairwise(ordered))
            assert token in mask
            assert 1 < len(mask) <= (top_k if top_k > 0 else VOCAB)
            renormalised = full[token] - math.log(sum(math.exp(full[t]) for t in mask))
            assert lp == pytest.approx(renormalised, abs=1e-5)
        # the reported token logprobs stay those of the untruncated distribution (SGLang's convention)
        tops = [{int(t): float(v) for v, t, _ in top} for top in meta["output_top_logprobs"]]
        expected_lps = [top[tok] for tok, top in zip(out["output_ids"], tops, strict=True)]
        assert [row[0] for row in meta["output_token_logprobs"]] == pytest.approx(expected_lps, abs=1e-6)


def test_greedy_rows_support_mode_and_bad_requests(engine: EngineProcess) -> None:
    def post(extra: dict, params: dict) -> httpx.Response:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, **params}, **extra}
        return httpx.post(engine.url + "/generate", json=body, timeout=120)

    greedy = post({"return_sampling_mask": True}, {"temperature": 0.0}).json()["meta_info"]
    assert greedy["output_token_sampling_logprobs"] == [0.0] * 4
    assert all(len(m) == 1 for m in greedy["output_token_sampling_mask"])

    support = post(
        {"return_sampling_mask": True, "sampling_logprobs_mode": "support"},
        {"temperature": 1.0, "top_k": 8, "sampling_seed": 3},
    ).json()["meta_info"]
    for mask, lps in zip(support["output_token_sampling_mask"], support["output_token_sampling_logprobs"], strict=True):
        assert len(mask) == len(lps) == 8
        assert sum(math.exp(v) for v in lps) == pytest.approx(1.0, abs=1e-6)
        assert lps == sorted(lps, reverse=True)

    plain = post({}, {"temperature": 1.0, "top_k": 8}).json()["meta_info"]
    assert "output_token_sampling_mask" not in plain
    refused = post({"sampling_logprobs_mode": "support"}, {"top_k": 8})
    assert refused.status_code == 400 and "return_sampling_mask" in refused.text
    refused = post({"return_sampling_mask": True, "sampling_logprobs_mode": "all"}, {"top_k": 8})
    assert refused.status_code == 400 and "sampling_logprobs_mode" in refused.text


def test_sample_rows_reports_the_set_it_drew_from() -> None:
    """In process, many draws: every drawn token is in its row's kept set, and the kept set is exactly the
    ids the truncation leaves (top-k 5 over distinct logits: the 5 largest)."""
    torch.manual_seed(0)
    logits = torch.randn(4, 64)
    cfg = SamplingParams(temperature=1.0, top_k=5)
    generators = [torch.Generator().manual_seed(i) for i in range(4)]
    for _ in range(20):
        kept: list = []
        ids, _, _ = sample_rows(logits.clone(), [cfg] * 4, generators, [[]] * 4, kept=kept, masks=["selected"] * 4)
        for row, (token, k) in enumerate(zip(ids, kept, strict=True)):
            assert k.token_ids == torch.topk(logits[row], 5).indices.tolist()
            assert token in k.token_ids
            probs = torch.softmax(logits[row].double(), -1)
            assert k.selected_logprob == pytest.approx(
                float(torch.log(probs[token] / probs[k.token_ids].sum())), abs=1e-6
            )


def test_the_client_carries_kept_sets_onto_the_sample(engine: EngineProcess) -> None:
    """``EngineClient.return_sampling_mask`` (set by the rollout manager for ``rollout.replay_sampling_mask``):
    the sample gets the kept sets and the behaviour logprobs as its rollout logprobs; a client that does not
    ask gets neither."""
    import asyncio

    from miles.rollout.http_client import HttpEngineClient
    from miles.rollout.manager import sample_from_output
    from miles.types import Sample

    params = SamplingParams(max_new_tokens=6, temperature=0.9, top_k=20, top_p=0.9, sampling_seed=5)

    async def generate(replay: bool) -> Sample:
        async with HttpEngineClient([engine.url]) as client:
            client.return_sampling_mask = replay
            (out,) = await client.generate(PROMPT, params)
        sample = sample_from_output(Sample(prompt_ids=PROMPT), out)
        sample.validate()
        return sample

    replayed, plain = asyncio.run(generate(True)), asyncio.run(generate(False))
    assert replayed.response_ids == plain.response_ids  # the same seed: the same tokens
    assert replayed.sampling_mask is not None and plain.sampling_mask is None
    assert all(
        t in kept and len(kept) <= 20 for t, kept in zip(replayed.response_ids, replayed.sampling_mask, strict=True)
    )
    # the behaviour logprob is above the untruncated one by the log of the mass the truncation dropped
    assert all(b >= w for b, w in zip(replayed.rollout_logprobs, plain.rollout_logprobs, strict=True))
    assert Sample.from_json(replayed.to_json()) == replayed
