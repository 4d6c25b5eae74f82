"""SGLang's ``top_logprobs_num`` and scoring-only requests on the local engine over real HTTP, checked
against an independent Hugging Face forward (one server process for the file)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from miles.testing.engine import EngineProcess

from .conftest import hf_logprobs, start_engine

PROMPT = [5, 17, 33, 48, 91, 120, 7, 250, 300, 12, 64, 77]


@pytest.fixture(scope="module")
def engine(engine_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    log = tmp_path_factory.mktemp("logs") / "server.log"
    yield from start_engine(engine_models["qwen2"], log, "--max-cache-tokens", "4096")


def gen(engine: EngineProcess, body: dict) -> httpx.Response:
    return httpx.post(engine.url + "/generate", json=body, timeout=120)


def hf_log_softmax(model_dir: Path, tokens: list[int], temperature: float) -> torch.Tensor:
    """``[L, V]``: row ``i`` is the distribution of token ``i + 1`` (fp32, independent HF forward)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits / temperature, dim=-1)


def check_position(entry: list, row: torch.Tensor, k: int, tok_decode: object) -> None:
    """One position's ``[[logprob, id, text], ...]`` equals the top ``k`` of ``row``, sorted."""
    assert len(entry) == k
    ref_values = torch.topk(row, k).values
    logprobs = [e[0] for e in entry]
    assert logprobs == sorted(logprobs, reverse=True)
    for (lp, tok, text), ref_lp in zip(entry, ref_values.tolist(), strict=True):
        assert abs(lp - ref_lp) < 1e-5
        assert abs(lp - float(row[tok])) < 1e-5  # the id is one whose logprob that is (ties may swap ids)
        assert text == tok_decode(tok)  # type: ignore[operator]
    assert len({e[1] for e in entry}) == k


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_output_and_input_top_logprobs_match_hf(
    engine: EngineProcess, engine_models: dict[str, Path], temperature: float
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(engine_models["qwen2"])
    k = 5
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 10, "temperature": temperature, "ignore_eos": True, "sampling_seed": 3},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": k,
    }
    out = gen(engine, body).json()
    meta = out["meta_info"]
    ids = out["output_ids"]
    ref = hf_log_softmax(engine_models["qwen2"], PROMPT + ids, temperature if temperature > 0 else 1.0)
    tops = meta["output_top_logprobs"]
    assert len(tops) == len(ids) == 10
    for i, entry in enumerate(tops):
        check_position(entry, ref[len(PROMPT) - 1 + i], k, tok.decode)
        # the sampled token's logprob agrees with output_token_logprobs; greedy samples the top-1
        assert abs(meta["output_token_logprobs"][i][0] - float(ref[len(PROMPT) - 1 + i, ids[i]])) < 1e-5
        if temperature == 0.0:
            assert entry[0][1] == ids[i]
    inp = meta["input_top_logprobs"]
    assert len(inp) == len(PROMPT) and inp[0] is None
    for p in range(1, len(PROMPT)):
        check_position(inp[p], ref[p - 1], k, tok.decode)


def test_scoring_only_request_returns_prompt_logprobs_and_no_output(
    engine: EngineProcess, engine_models: dict[str, Path]
) -> None:
    """``max_new_tokens = 0`` with ``logprob_start_len``: how a teacher scores a sequence (slime's OPD)."""
    start = 4
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
        "return_logprob": True,
        "logprob_start_len": start,
        "top_logprobs_num": 3,
    }
    for _ in range(2):  # the second time the prefix is cached: logprobs must not change
        out = gen(engine, body).json()
        meta = out["meta_info"]
        assert out["output_ids"] == [] and out["text"] == ""
        assert meta["finish_reason"] == {"type": "length", "length": 0}
        assert meta["output_token_logprobs"] == [] and meta["output_top_logprobs"] == []
        ref = hf_logprobs(engine_models["qwen2"], PROMPT, 1.0)
        inp = meta["input_token_logprobs"]
        assert [t[1] for t in inp] == PROMPT[start:]
        for j, (lp, _, _) in enumerate(inp):
            assert abs(lp - float(ref[start + j])) < 1e-5
        assert len(meta["input_top_logprobs"]) == len(PROMPT) - start
        for entry, (lp, _, _) in zip(meta["input_top_logprobs"], inp, strict=True):
            assert len(entry) == 3 and entry[0][0] >= lp - 1e-6


def test_per_request_top_logprobs_num_in_a_batch(engine: EngineProcess) -> None:
    body = {
        "input_ids": [PROMPT, PROMPT[:6]],
        "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": [2, 0],
    }
    first, second = gen(engine, body).json()
    assert [len(e) for e in first["meta_info"]["output_top_logprobs"]] == [2, 2, 2]
    assert "output_top_logprobs" not in second["meta_info"]
    # without return_logprob nothing is reported (as in SGLang)
    plain = gen(engine, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, "top_logprobs_num": 2})
    assert "output_top_logprobs" not in plain.json()["meta_info"]


@pytest.mark.parametrize(
    ("value", "fragment"),
    [(-1, "top_logprobs_num must be an integer >= 0"), ("3", "top_logprobs_num must be"), ([1], "one entry per")],
)
def test_bad_top_logprobs_num_is_400(engine: EngineProcess, value: object, fragment: str) -> None:
    body = {"input_ids": [PROMPT, PROMPT], "return_logprob": True, "top_logprobs_num": value}
    response = gen(engine, body)
    assert response.status_code == 400
    assert fragment in response.json()["error"]["message"]
    assert gen(engine, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}).status_code == 200


def test_per_request_logprob_start_len_in_a_batch(engine: EngineProcess, engine_models: dict[str, Path]) -> None:
    """SGLang's list form of ``logprob_start_len``: one start per prompt (a teacher scores a batch)."""
    body = {
        "input_ids": [PROMPT, PROMPT[:7]],
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": [5, 2],
    }
    first, second = gen(engine, body).json()
    assert [t[1] for t in first["meta_info"]["input_token_logprobs"]] == PROMPT[5:]
    ref = hf_logprobs(engine_models["qwen2"], PROMPT[:7], 1.0)
    inp = second["meta_info"]["input_token_logprobs"]
    assert [t[1] for t in inp] == PROMPT[2:7]
    assert all(abs(lp - float(ref[2 + j])) < 1e-5 for j, (lp, _, _) in enumerate(inp))
    bad = gen(engine, {**body, "logprob_start_len": [1]})
    assert bad.status_code == 400 and "one entry per prompt" in bad.json()["error"]["message"]
    assert gen(engine, {**body, "logprob_start_len": [1, "2"]}).status_code == 400
