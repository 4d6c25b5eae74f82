"""The ``grad_zero`` signal check (issue 40) on the fsdp trainer (one gloo rank, in process): a GRPO step
whose every token is clipped (old logprobs far below the policy's, as stale or broken ones would be) has
non-zero advantages and a gradient norm of exactly 0, and the check fires; the same batch with the
policy's own old logprobs trains and the check stays quiet."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from miles.driver.fidelity import optimizer_step_metrics
from miles.driver.signals import SignalChecks, logprob_spread
from miles.net import free_port
from miles.settings.signals import SignalSettings
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
        t = FSDPTrainer(TrainSettings(model_path=str(model), lr=1e-3), FSDPSettings(), FP32(None), ctx)  # type: ignore[arg-type, call-arg]
        t.setup()
        yield t
        t.close()
    finally:
        shutdown_distributed()


def test_a_step_clipped_everywhere_has_no_gradient_and_the_check_fires(trainer: object) -> None:
    from miles.algorithms.builtin import GRPO
    from miles.algorithms.settings import GRPOSettings
    from miles_fsdp.trainer import FSDPTrainer

    assert isinstance(trainer, FSDPTrainer)
    tokens = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14]]
    prompts = [3, 2]
    n = [len(t) - p for t, p in zip(tokens, prompts, strict=True)]
    base = TrainBatch.from_lists(
        tokens=tokens,
        prompt_lengths=prompts,
        loss_mask=[[1] * k for k in n],
        advantages=[[1.0] * k for k in n],
        rollout_logprobs=[[-1.0] * k for k in n],
    )
    own = trainer.compute_logprobs(base, temperature=1.0).logprobs
    checks = SignalChecks(SignalSettings(), vocab_size=None)
    algorithm = GRPO(GRPOSettings())
    for old, fires in ((own - 20.0, True), (own, False)):  # ratio e^20: past the clip on every token
        batch = base.select(range(len(base)))
        batch.set_token_field("old_logprobs", old)
        metrics = {**optimizer_step_metrics([trainer.train_step(batch, algorithm)]), **logprob_spread([batch])}
        assert (metrics["train/grad_norm"] == 0.0) == fires
        assert metrics["signals/advantage_abs_mean"] == 1.0
        assert checks.judge(1, metrics) == (["grad_zero"] if fires else [])
