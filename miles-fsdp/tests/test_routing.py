"""The patched routers compute the Hugging Face routers' formula (Qwen2-MoE, Qwen3-MoE, Mixtral): without
rollout data the model's logits are bit for bit the unpatched model's; replaying the model's own choices
changes nothing either; replaying other experts changes the output and keeps the gate's gradient."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from miles_fsdp.routing import patch_routers


def tiny_moe(arch: str) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    common: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        num_experts_per_tok=2,
    )
    if arch == "mixtral":
        common.update(num_local_experts=4)
    else:
        common.update(num_experts=4, moe_intermediate_size=32, decoder_sparse_step=1, norm_topk_prob=True)
        if arch == "qwen2_moe":
            common.update(shared_expert_intermediate_size=32)
    torch.manual_seed(0)
    config = AutoConfig.for_model(arch, **common)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for layer in model.model.layers:  # HF initialises the routers to zero: give them something to choose
        torch.nn.init.normal_(layer.mlp.gate.weight, std=1.0)
    return model.eval()


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_patched_routers_are_the_models_own(arch: str) -> None:
    model = tiny_moe(arch)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    own: list[torch.Tensor] = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, i, out: own.append(out[2].clone()))
        for layer in model.model.layers
    ]
    with torch.no_grad():
        want = model(input_ids=ids).logits
    for hook in hooks:
        hook.remove()
    replay = patch_routers(model, replay=True)
    assert replay is not None and replay.num_layers == 2
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, want)  # no rows: the router's own choice
        replay.set_rows(torch.stack(own, dim=1).to(torch.int16))  # [tokens, layers, k]
        assert torch.equal(model(input_ids=ids).logits, want)  # its own choice replayed
    assert replay.stats.metrics(2, reduce=False)["fidelity/routing_agreement"] == 1.0

    other = torch.stack(own, dim=1)
    other = (other + 1) % 4  # every token through other experts
    replay.set_rows(other.to(torch.int16))
    out = model(input_ids=ids).logits
    assert not torch.allclose(out, want)
    out.sum().backward()
    assert all(float(layer.mlp.gate.weight.grad.abs().sum()) > 0 for layer in model.model.layers)


def test_dense_models_are_not_patched() -> None:
    from transformers import AutoModelForCausalLM

    from miles.testing.models import tiny_config

    assert patch_routers(AutoModelForCausalLM.from_config(tiny_config("qwen2")), replay=True) is None
