"""Top-k distillation in the fsdp trainer (one gloo rank, in process): the student's logprobs at the
teacher's top-k ids equal an independent Hugging Face forward's gather, over several micro-batches, and
training on the top-k reverse KL lowers it."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from miles.algorithms.base import LossInputs, LossOutput
from miles.algorithms.builtin import Distill
from miles.algorithms.settings import DistillSettings
from miles.net import free_port
from miles.training.batch import TrainBatch

K = 3
TEMPERATURE = 0.8


class RecordingDistill(Distill):
    """Distill (top-k mode) that keeps what the trainer passed in."""

    def __init__(self) -> None:
        super().__init__(DistillSettings(distill_mode="topk", distill_topk=K))
        self.seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def loss(self, inputs: LossInputs) -> LossOutput:
        assert inputs.student_topk_logprobs is not None and inputs.teacher_topk_logprobs is not None
        assert inputs.student_topk_logprobs.requires_grad
        self.seen.append(
            (
                inputs.logprobs.shape[0],
                inputs.student_topk_logprobs.detach().clone(),
                inputs.teacher_topk_logprobs.clone(),
            )
        )
        return super().loss(inputs)


def _batch(vocab: int) -> TrainBatch:
    rng = random.Random(7)
    tokens, prompts, ids, lps = [], [], [], []
    for prompt_len, response_len in ((5, 6), (3, 9), (7, 4)):
        tokens.append([rng.randrange(1, vocab) for _ in range(prompt_len + response_len)])
        prompts.append(prompt_len)
        ids.append([rng.sample(range(vocab), K) for _ in range(response_len)])
        lps.append([sorted((-rng.uniform(0.1, 4.0) for _ in range(K)), reverse=True) for _ in range(response_len)])
    return TrainBatch.from_lists(
        tokens=tokens,
        prompt_lengths=prompts,
        loss_mask=[[1] * (len(t) - p) for t, p in zip(tokens, prompts, strict=True)],
        advantages=[[0.0] * (len(t) - p) for t, p in zip(tokens, prompts, strict=True)],
        teacher_topk_ids=ids,
        teacher_topk_logprobs=lps,
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from miles.testing.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("topk") / "model", "qwen2", seed=5)


@pytest.fixture
def trainer(model: Path) -> Iterator[object]:
    from miles.precision.builtin import FP32
    from miles.settings.model import TrainSettings
    from miles_fsdp.distributed import init_distributed, shutdown_distributed
    from miles_fsdp.settings import FSDPSettings
    from miles_fsdp.trainer import FSDPTrainer

    torch.set_num_threads(1)
    ctx = init_distributed(0, 1, master_port=free_port())
    try:
        train = TrainSettings(model_path=str(model), lr=1e-2, max_tokens_per_micro_batch=16)  # type: ignore[call-arg]
        t = FSDPTrainer(train, FSDPSettings(), FP32(None), ctx)  # type: ignore[arg-type]
        t.setup()
        yield t
        t.close()
    finally:
        shutdown_distributed()


def test_student_topk_logprobs_equal_an_hf_gather_and_training_lowers_the_kl(trainer: object, model: Path) -> None:
    from transformers import AutoModelForCausalLM

    from miles_fsdp.trainer import FSDPTrainer

    assert isinstance(trainer, FSDPTrainer)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    batch = _batch(hf.config.vocab_size)
    algo = RecordingDistill()
    metrics = trainer.train_step(batch, algo, temperature=TEMPERATURE)
    assert len(algo.seen) >= 2  # a budget of 16 tokens splits the 3 sequences over micro-batches
    # the recorded rows, in micro-batch order, against one HF forward per sequence (before the update)
    got = {}
    rows = iter(algo.seen)
    from miles.training.packing import balanced_bins

    lengths = batch.lengths
    for indices in balanced_bins(lengths, 16, len(algo.seen)):
        count, student, teacher = next(rows)
        assert count == sum(batch.response_lengths[i] for i in indices)
        offset = 0
        for i in indices:
            n = batch.response_lengths[i]
            got[i] = (student[offset : offset + n], teacher[offset : offset + n])
            offset += n
    for i, tokens in enumerate(batch.sequences()):
        with torch.no_grad():
            logits = hf(torch.tensor([tokens])).logits[0].float()
        p = int(batch.prompt_lengths[i])
        logp = torch.log_softmax(logits[p - 1 : -1] / TEMPERATURE, dim=-1)
        span = slice(batch.response_offsets[i], batch.response_offsets[i + 1])
        ids = batch.teacher_topk_ids[span]  # type: ignore[index]
        ref = logp.gather(1, ids)
        student, teacher = got[i]
        assert torch.allclose(student, ref, atol=1e-5), (student - ref).abs().max()
        assert torch.equal(teacher, batch.teacher_topk_logprobs[span])  # type: ignore[index]
    first = metrics["distill_topk_reverse_kl"]
    assert first > 0.0
    for _ in range(3):
        metrics = trainer.train_step(batch, algo, temperature=TEMPERATURE)
    assert metrics["distill_topk_reverse_kl"] < first
    # a batch without the teacher's top-k is a clear error
    plain = TrainBatch(
        tokens=batch.tokens,
        seq_offsets=batch.seq_offsets,
        prompt_lengths=batch.prompt_lengths,
        loss_mask=batch.loss_mask,
    )
    plain.advantages = batch.advantages
    with pytest.raises(ValueError, match="needs the teacher's top-3 per response token, the batch has none"):
        trainer.train_step(plain, algo, temperature=TEMPERATURE)
