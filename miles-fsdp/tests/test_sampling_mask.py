"""Sampling-mask replay on the fsdp trainer (issue 40; one gloo rank, in process): with each token's kept set
(the 5 most likely ids at the sampling temperature, as top-k 5 keeps) the trainer's logprobs, plain and
fused head alike, are the renormalised ones an independent HF forward gives, and a train step on them
trains (finite loss, a gradient) with the train-vs-rollout difference at float32 noise where the rollout
logprobs are the behaviour ones."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from miles.net import free_port
from miles.training.batch import TrainBatch
from miles.types import Sample

TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from miles.testing.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("replay") / "model", "qwen2", seed=3)


@pytest.fixture(params=[False, True], ids=["plain", "fused"])
def trainer(model: Path, request: pytest.FixtureRequest) -> Iterator[object]:
    from miles.precision.builtin import FP32
    from miles.settings.model import TrainSettings
    from miles_fsdp.distributed import init_distributed, shutdown_distributed
    from miles_fsdp.settings import FSDPSettings
    from miles_fsdp.trainer import FSDPTrainer

    torch.set_num_threads(1)
    ctx = init_distributed(0, 1, master_port=free_port())
    try:
        settings = FSDPSettings(fused_logprobs=request.param)  # type: ignore[call-arg]
        t = FSDPTrainer(TrainSettings(model_path=str(model), lr=1e-3), settings, FP32(None), ctx)  # type: ignore[arg-type, call-arg]
        t.setup()
        yield t
        t.close()
    finally:
        shutdown_distributed()


def _samples(model: Path) -> tuple[list[Sample], list[list[float]]]:
    """Two samples whose responses are each position's second most likely token, with top-5 kept sets and
    the behaviour logprobs (renormalised over them) of an HF forward; and the untruncated logprobs."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    out, whole = [], []
    for prompt in ([5, 6, 7], [11, 12]):
        seq = list(prompt)
        for _ in range(4):
            with torch.no_grad():
                logits = hf(torch.tensor([seq])).logits[0, -1]
            seq.append(int(torch.topk(logits, 2).indices[1]))
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([seq])).logits[0].double() / TEMPERATURE, -1)
        rows = logp[len(prompt) - 1 : -1]
        response = seq[len(prompt) :]
        kept = [torch.topk(row, 5).indices.tolist() for row in rows]
        behaviour = [float(row[t] - torch.logsumexp(row[k], 0)) for row, t, k in zip(rows, response, kept, strict=True)]
        out.append(
            Sample(
                prompt_ids=prompt,
                response_ids=response,
                rollout_logprobs=behaviour,
                loss_mask=[1] * 4,
                sampling_mask=kept,
            )
        )
        whole.append([float(row[t]) for row, t in zip(rows, response, strict=True)])
    return out, whole


def test_the_trainer_scores_the_kept_sets(trainer: object, model: Path) -> None:
    from miles.algorithms.builtin import GRPO
    from miles.algorithms.settings import GRPOSettings
    from miles_fsdp.trainer import FSDPTrainer

    assert isinstance(trainer, FSDPTrainer)
    samples, whole = _samples(model)
    behaviour = torch.tensor([lp for s in samples for lp in s.rollout_logprobs])
    replayed = trainer.compute_logprobs(TrainBatch.from_samples(samples), temperature=TEMPERATURE).logprobs
    assert torch.allclose(replayed.double(), behaviour.double(), atol=2e-5)
    for s in samples:
        s.sampling_mask = None
    unmasked = trainer.compute_logprobs(TrainBatch.from_samples(samples), temperature=TEMPERATURE).logprobs
    assert torch.allclose(unmasked.double(), torch.tensor(whole, dtype=torch.float64).flatten(), atol=2e-5)
    assert float((unmasked - behaviour).abs().mean()) > 0.5  # scored against the whole vocabulary: far off

    samples, _ = _samples(model)
    batch = TrainBatch.from_samples(samples, advantages=[[1.0] * 4, [-1.0] * 4])
    metrics = trainer.train_step(batch, GRPO(GRPOSettings()), temperature=TEMPERATURE)
    assert metrics["grad_norm"] > 0.0 and torch.isfinite(torch.tensor(metrics["loss"]))
    assert metrics["train_rollout_logprob_abs_diff"] < 2e-5
