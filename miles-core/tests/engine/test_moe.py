"""MoE serving: routed experts come back as base64 int32 (tokens x layers x topk) and equal the HF
router's top-k over the same sequence (Qwen2-MoE server; Qwen3-MoE in-process)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from miles.testing.engine import EngineProcess

from .conftest import hf_logprobs, start_engine

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]


@pytest.fixture(scope="module")
def engine(engine_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    log = tmp_path_factory.mktemp("logs") / "moe.log"
    yield from start_engine(engine_models["qwen2_moe"], log)


def hf_topk(model_dir: Path, tokens: list[int]) -> np.ndarray:
    """Top-k expert ids per token and layer from the HF model's own routers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    seen: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: seen.append(o[2])) for layer in model.model.layers]
    with torch.no_grad():
        model(torch.tensor([tokens]))
    for hook in hooks:
        hook.remove()
    return torch.stack(seen, dim=1).numpy()


def decode(meta: dict, layers: int, topk: int) -> np.ndarray:
    return np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32).reshape(-1, layers, topk)


def test_routed_experts_match_hf_router(engine: EngineProcess, engine_models: dict[str, Path]) -> None:
    info = httpx.get(engine.url + "/model_info", timeout=30).json()
    layers, topk = len(info["moe_layers"]), info["num_experts_per_tok"]
    assert (layers, topk) == (2, 2)
    for attempt in range(2):  # the second time the prompt's routing comes from the prefix cache
        body = {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 10, "temperature": 0.8, "ignore_eos": True, "sampling_seed": 5},
            "return_routed_experts": True,
            "return_logprob": True,
        }
        out = httpx.post(engine.url + "/generate", json=body, timeout=60).json()
        seq = PROMPT + out["output_ids"]
        routed = decode(out["meta_info"], layers, topk)
        assert routed.shape == (len(seq) - 1, layers, topk)
        ref = hf_topk(engine_models["qwen2_moe"], seq[:-1])
        np.testing.assert_array_equal(np.sort(routed, -1), np.sort(ref, -1))
        if attempt:
            assert out["meta_info"]["cached_tokens"] == len(PROMPT) - 1
        lp = hf_logprobs(engine_models["qwen2_moe"], seq, 0.8)
        got = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
        assert np.allclose(got, lp[len(PROMPT) :].numpy(), atol=1e-5)


def test_qwen3_moe_runner_matches_hf(engine_models: dict[str, Path]) -> None:
    from miles.engine.model_runner import ModelRunner

    runner = ModelRunner(engine_models["qwen3_moe"])
    seq = [*PROMPT, 100, 200, 300]
    # two sequences of different lengths in one padded prefill, the second after a 3-token prefix
    other = [9, 8, 7, 6, 5]
    runner.prefill(1, [other[:3]], [0], [False])
    logits, experts = runner.prefill(0, [seq[:-1], other[3:]], [0, 3], [True, True])
    for got, tokens, rows in ((experts[0], seq[:-1], slice(None)), (experts[1], other, slice(3, None))):
        ref = hf_topk(engine_models["qwen3_moe"], tokens)[rows]
        assert got is not None and got.shape == ref.shape
        np.testing.assert_array_equal(np.sort(got.numpy(), -1), np.sort(ref, -1))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(engine_models["qwen3_moe"])
    with torch.no_grad():
        ref_logits = hf(torch.tensor([other])).logits[0, 3:]
    assert torch.allclose(logits[1], ref_logits, atol=1e-5)
