"""A NaN loss refuses the optimizer step (issue 22): the error names the step, the weights and the step
count stay where they were, and the next finite step trains normally (one gloo rank, in process)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from miles.errors import NonFiniteStepError
from miles.net import free_port
from miles.testing.algorithms import RatioPG
from miles.training.batch import TrainBatch


@pytest.fixture
def trainer(tmp_path: Path) -> Iterator[object]:
    from miles.precision.builtin import FP32
    from miles.settings.model import TrainSettings
    from miles.testing.models import build_tiny_model
    from miles_fsdp.distributed import init_distributed, shutdown_distributed
    from miles_fsdp.settings import FSDPSettings
    from miles_fsdp.trainer import FSDPTrainer

    torch.set_num_threads(1)
    model = build_tiny_model(tmp_path / "model", "qwen2", seed=3)
    ctx = init_distributed(0, 1, master_port=free_port())
    try:
        t = FSDPTrainer(TrainSettings(model_path=str(model), lr=1e-2), FSDPSettings(), FP32(None), ctx)  # type: ignore[arg-type, call-arg]
        t.setup()
        yield t
        t.close()
    finally:
        shutdown_distributed()


def _batch(advantage: float) -> TrainBatch:
    tokens = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14]]
    prompts = [3, 2]
    n = [len(t) - p for t, p in zip(tokens, prompts, strict=True)]
    return TrainBatch.from_lists(
        tokens=tokens,
        prompt_lengths=prompts,
        loss_mask=[[1] * k for k in n],
        advantages=[[advantage] * k for k in n],
        rollout_logprobs=[[-1.0] * k for k in n],
        old_logprobs=[[-1.0] * k for k in n],
    )


def test_a_nan_loss_refuses_the_step_and_leaves_the_weights(trainer: object) -> None:
    from miles_fsdp.trainer import FSDPTrainer

    assert isinstance(trainer, FSDPTrainer)
    before = {name: t.clone() for bucket in trainer.iter_weights(1 << 30) for name, t in bucket}
    with pytest.raises(
        NonFiniteStepError, match=r"train step 1: actor grad_norm is nan .* weights stay those of step 0"
    ):
        trainer.train_step(_batch(float("nan")), RatioPG())
    assert trainer.step == 0
    after = {name: t for bucket in trainer.iter_weights(1 << 30) for name, t in bucket}
    assert all(torch.equal(before[name], after[name]) for name in before)
    metrics = trainer.train_step(_batch(1.0), RatioPG())  # the refused gradients were not kept
    assert trainer.step == 1 and torch.isfinite(torch.tensor(metrics["grad_norm"]))
    changed = {name: t for bucket in trainer.iter_weights(1 << 30) for name, t in bucket}
    assert any(not torch.equal(before[name], changed[name]) for name in before)
