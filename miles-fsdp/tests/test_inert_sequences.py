"""Sequences that train nothing (every trained token at advantage 0, under a loss that is then 0) are scored
without a backward pass (``[train.backend] skip_zero_advantage_backward``): the same update and metrics as
the step that back-propagates them, one gloo rank in process, a tiny Qwen2."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from miles.algorithms.builtin import GRPO, PPO
from miles.algorithms.settings import GRPOSettings, PPOSettings
from miles.net import free_port
from miles.training.batch import TrainBatch
from miles_fsdp.step import inert_sequences

TOKENS = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 11, 12], [13, 14, 15, 16], [13, 14, 17, 18, 19, 20]]
PROMPTS = [3, 3, 2, 2]


def _batch(advantages: list[float]) -> TrainBatch:
    n = [len(t) - p for t, p in zip(TOKENS, PROMPTS, strict=True)]
    return TrainBatch.from_lists(
        tokens=TOKENS,
        prompt_lengths=PROMPTS,
        loss_mask=[[1] * k for k in n],
        advantages=[[a] * k for a, k in zip(advantages, n, strict=True)],
        rollout_logprobs=[[-2.0] * k for k in n],
        old_logprobs=[[-2.0] * k for k in n],
    )


@pytest.fixture
def trainers(tmp_path: Path) -> Iterator[tuple[Any, Any, Any]]:
    from miles.precision.builtin import FP32
    from miles.settings.model import TrainSettings
    from miles.testing.models import build_tiny_model
    from miles_fsdp.distributed import init_distributed, shutdown_distributed
    from miles_fsdp.settings import FSDPSettings
    from miles_fsdp.trainer import FSDPTrainer

    torch.set_num_threads(1)
    model = build_tiny_model(tmp_path / "model", "qwen2", seed=3)
    ctx = init_distributed(0, 1, master_port=free_port())
    made = []
    try:
        for options in (
            {"skip_zero_advantage_backward": True},
            {"skip_zero_advantage_backward": False},
            {"skip_zero_advantage_backward": True, "wrap_single_rank": True},  # DTensor parameters
        ):
            settings = TrainSettings(model_path=str(model), lr=1e-2)  # type: ignore[call-arg]
            t = FSDPTrainer(settings, FSDPSettings(**options), FP32(None), ctx)
            t.setup()
            made.append(t)
        yield made[0], made[1], made[2]
    finally:
        for t in made:
            t.close()
        shutdown_distributed()


def _weights(trainer: Any) -> dict[str, torch.Tensor]:
    return {name: t.clone() for bucket in trainer.iter_weights(1 << 30) for name, t in bucket}


def _passes(trainer: Any) -> dict[str, int]:
    """Counts of the actor's forward and backward passes (hooks on its input embedding)."""
    counts = {"forward": 0, "backward": 0}

    def backward(_: torch.Tensor) -> None:
        counts["backward"] += 1

    def forward(_module: Any, _inputs: Any, out: torch.Tensor) -> None:
        counts["forward"] += 1
        if out.requires_grad:
            out.register_hook(backward)

    trainer.actor.get_input_embeddings().register_forward_hook(forward)
    return counts


def test_inert_sequences_are_those_whose_trained_tokens_all_have_advantage_zero() -> None:
    grpo = GRPO(GRPOSettings())
    assert inert_sequences(_batch([1.0, 0.0, -0.5, 0.0]), grpo) == [1, 3]
    # a nonzero advantage on an untrained token does not make a sequence live
    batch = _batch([0.0, 0.0, 0.0, 0.0])
    batch.advantages[0] = 3.0  # type: ignore[index]
    batch.loss_mask[0] = 0.0
    assert inert_sequences(batch, grpo) == [0, 1, 2, 3]
    batch.loss_mask[0] = 1.0
    assert inert_sequences(batch, grpo) == [1, 2, 3]
    # loss terms that do not vanish at advantage 0: no sequence is inert
    for algorithm in (
        GRPO(GRPOSettings(kl_coef=0.1)),
        GRPO(GRPOSettings(entropy_coef=0.01)),
        GRPO(GRPOSettings(sft_coef=0.1)),
        PPO(PPOSettings()),
    ):
        assert not algorithm.zero_advantage_trains_nothing
        assert inert_sequences(_batch([0.0] * 4), algorithm) == []
    assert GRPO(GRPOSettings(kl_coef=0.1, kl_in_reward=True)).zero_advantage_trains_nothing


def test_inert_sequences_skip_the_backward_pass_for_the_same_update_and_metrics(
    trainers: tuple[Any, Any, Any],
) -> None:
    """Two sequences of four inert, then all four (the optimizer still steps, on its momentum): the weights and
    every metric of the trainer that back-propagates everything, to float32 rounding, with fewer backward
    passes; the same with the module wrapped by FSDP (DTensor parameters, whose zero gradients are DTensors)."""
    skip, full, wrapped = trainers
    assert all(torch.equal(a, b) for a, b in zip(_weights(skip).values(), _weights(full).values(), strict=True))
    seen = {id(skip): _passes(skip), id(full): _passes(full)}
    grpo = GRPO(GRPOSettings())
    for advantages in ([1.0, 0.0, -0.5, 0.0], [0.0, 0.0, 0.0, 0.0]):
        want = full.train_step(_batch(advantages), grpo, temperature=1.0)
        for trainer in (skip, wrapped):
            got = trainer.train_step(_batch(advantages), grpo, temperature=1.0)
            assert got.keys() == want.keys()
            for key in want:
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
            for (name, a), b in zip(_weights(trainer).items(), _weights(full).values(), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert want["grad_norm"] == 0.0  # the second step: no gradient, yet the weights moved (momentum)
    # the full trainer: one forward and one backward a step; the skipping one: the first step scores its two
    # inert sequences in a micro-batch of their own without a backward pass, the second none of them
    assert seen[id(full)] == {"forward": 2, "backward": 2}
    assert seen[id(skip)] == {"forward": 3, "backward": 1}
