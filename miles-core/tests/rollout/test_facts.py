"""The MoE client wrapper: an adapter set on it is the inner client's, which puts it in every request; routed
experts come out in one shape whatever the engine (SGLang sends them flat, without one)."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import pytest
import torch

from miles.errors import EngineError
from miles.models import RoutedLayout
from miles.rollout.facts import RoutedExpertsClient, shape_routed_experts
from miles.rollout.http_client import HttpEngineClient
from miles.rollout.manager import sample_from_output
from miles.rollout.protocol import GenerateOutput
from miles.training.routing import pack_routed_experts
from miles.types import Sample


def test_lora_path_set_through_the_wrapper_is_the_inner_clients() -> None:
    inner = HttpEngineClient(["http://127.0.0.1:9"])
    client = RoutedExpertsClient(inner)
    assert client.lora_path is None
    client.lora_path = "policy"  # what the lora transport does after a push
    assert inner.lora_path == "policy" and client.lora_path == "policy"
    asyncio.run(inner.close())


def sglang_response(routed: torch.Tensor, output_ids: list[int]) -> dict[str, Any]:
    """A ``/generate`` answer as SGLang 0.5.23 writes it for ``return_routed_experts``: the capturer's
    ``[prompt + output - 1, num_hidden_layers, topk]`` int32 rows (``batch_result_processor.py``), base64 of
    their bytes (``DetokenizerManager._b64_encode_per_request``), and no shape."""
    encoded = base64.b64encode(routed.numpy().tobytes()).decode("utf-8")
    meta = {
        "finish_reason": {"type": "length", "length": len(output_ids)},
        "prompt_tokens": 3,
        "completion_tokens": len(output_ids),
        "output_token_logprobs": [[-0.5, t, None] for t in output_ids],
        "routed_experts": encoded,
    }
    return {"text": "", "output_ids": output_ids, "meta_info": meta}


def test_sglang_routed_experts_are_read_with_the_models_layout() -> None:
    """SGLang sends every decoder layer and no shape: the rows keep only the MoE layers, shaped as the local
    engine shapes them, so routing replay gets them (they used to be dropped without a word)."""
    layout = RoutedLayout(num_layers=3, moe_layers=(0, 2), topk=2)
    routed = torch.randint(0, 8, (3 + 4 - 1, 3, 2), dtype=torch.int32)
    output = GenerateOutput.from_json(sglang_response(routed, [5, 6, 7, 8]))
    shaped = shape_routed_experts(output, layout)
    assert shaped.meta_info["routed_experts_shape"] == [6, 2, 2]
    assert shaped.routed_experts is not None
    rows = torch.frombuffer(bytearray(shaped.routed_experts), dtype=torch.int32).reshape(6, 2, 2)
    assert torch.equal(rows, routed[:, [0, 2], :])
    sample = sample_from_output(Sample(prompt_ids=[1, 2, 3], group_id=0, index=0), shaped)
    assert sample.routed_experts_shape == (6, 2, 2)
    packed = pack_routed_experts([sample])  # what the trainer replays
    assert packed is not None and torch.equal(packed[:6], routed[:, [0, 2], :].to(torch.int16))


def test_routed_experts_without_a_shape_are_refused_not_dropped() -> None:
    output = GenerateOutput.from_json(sglang_response(torch.zeros(6, 3, 2, dtype=torch.int32), [5, 6, 7, 8]))
    with pytest.raises(EngineError, match="without a shape"):
        sample_from_output(Sample(prompt_ids=[1, 2, 3], group_id=0, index=0), output)
    with pytest.raises(EngineError, match="not whole rows of 4 layers x 2 experts"):
        shape_routed_experts(output, RoutedLayout(num_layers=4, moe_layers=(1,), topk=2))
