"""LoRA's Megatron side without a process group (nor Megatron imported): the fused QKV row order, and
the target-module checks that name the field. (The adapters on gloo ranks are tested
in miles-lora: ``miles-lora/tests/test_megatron.py``.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from miles.errors import SettingsError
from miles.training.adapter import LowRankSpec


def test_qkv_layout_interleaves_each_query_group_and_round_trips() -> None:
    from miles_megatron.lora import QkvLayout

    heads, groups, head_dim, rank = 8, 2, 4, 3
    layout = QkvLayout(heads=heads, groups=groups, head_dim=head_dim)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(heads * head_dim, rank, generator=gen)
    k = torch.randn(groups * head_dim, rank, generator=gen)
    v = torch.randn(groups * head_dim, rank, generator=gen)
    fused = layout.to_megatron(q, k, v)
    per_group = heads // groups * head_dim  # group g: its 4 query heads, its key head, its value head
    want = torch.cat(
        [
            torch.cat(
                [
                    q[g * per_group : (g + 1) * per_group],
                    k[g * head_dim : (g + 1) * head_dim],
                    v[g * head_dim : (g + 1) * head_dim],
                ]
            )
            for g in range(groups)
        ]
    )
    assert torch.equal(fused, want)
    assert all(torch.equal(x, y) for x, y in zip(layout.to_hf(fused), (q, k, v), strict=True))


def _spec(*targets: str) -> LowRankSpec:
    return LowRankSpec(r=4, alpha=8.0, dropout=0.0, target_modules=targets)


DENSE = SimpleNamespace(model_type="qwen2")
MOE = SimpleNamespace(model_type="qwen2_moe", num_experts=4)


def test_targets_map_hf_projections_to_megatrons_fused_ones() -> None:
    from miles_megatron.lora import megatron_targets

    all_seven = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert megatron_targets(_spec(*all_seven), DENSE) == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    assert megatron_targets(_spec("v_proj", "q_proj", "k_proj"), DENSE) == ("linear_qkv",)
    assert megatron_targets(_spec("q_proj", "k_proj", "v_proj", "o_proj"), MOE) == ("linear_qkv", "linear_proj")


@pytest.mark.parametrize(
    ("targets", "config", "message"),
    [
        (("q_proj", "v_proj"), DENSE, "fuses q_proj, k_proj, v_proj into one projection .*got q_proj, v_proj"),
        (("up_proj",), DENSE, "fuses gate_proj, up_proj into one projection"),
        (("lm_head",), DENSE, "lm_head cannot be adapted by the megatron trainer"),
        (("down_proj", "o_proj"), MOE, "down_proj of a mixture-of-experts model"),
        ((), DENSE, "empty"),
    ],
)
def test_target_errors_name_the_field(targets: tuple[str, ...], config: object, message: str) -> None:
    from miles_megatron.lora import megatron_targets

    with pytest.raises(SettingsError, match=rf"train\.adapter\.target_modules: .*{message}"):
        megatron_targets(_spec(*targets), config)
