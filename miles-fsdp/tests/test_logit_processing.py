"""The trainer scores the distribution the engine reported, for every sampling setting that changes it.

Real engine processes sample through the rollout manager's own path (single-turn, the manager recording the
engine's logit masks); the fsdp trainer (one gloo rank, in process) recomputes the logprobs of those samples.
For each setting the trainer's logprobs equal the engine's to float rounding (the engine's packed oneDNN
matmuls against the trainer's MKL ones), and the same comparison without the trainer-side processing shows
the error the setting used to cause.

- ``min_new_tokens`` with ``stop_token_ids``: EOS and the stop ids are masked before ``min_new_tokens``;
- ``top_k`` / ``top_p``: the engine reports logprobs before truncation, the trainer needs nothing;
- ``top_k = 1`` (greedy at any temperature) and ``return_original_logprob``: scored at temperature 1.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from miles.rollout.http_client import HttpEngineClient
from miles.rollout.manager import RolloutManager
from miles.settings.model import RolloutSettings
from miles.testing.engine import EngineProcess
from miles.training.batch import TrainBatch
from miles.training.logit_masks import LOGIT_MASK_IDS
from miles.training.logprobs import scoring_temperature
from miles.types import Sample

ROUNDING = 1e-5
"""|trainer - engine| allowed: float32 rounding of two GEMM implementations (observed ~1e-6)."""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from miles.testing.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("logit-processing") / "qwen2", "qwen2", seed=11)


@pytest.fixture(scope="module")
def engine(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    with EngineProcess(model, log_path=tmp_path_factory.mktemp("logs") / "engine.log") as proc:
        yield proc


def new_trainer(model_path: Path, ctx: Any) -> Any:
    from miles.precision.builtin import FP32
    from miles.settings.model import TrainSettings
    from miles_fsdp.settings import FSDPSettings
    from miles_fsdp.trainer import FSDPTrainer

    trainer = FSDPTrainer(TrainSettings(model_path=str(model_path)), FSDPSettings(), FP32(None), ctx)  # type: ignore[call-arg]
    trainer.setup()
    return trainer


@pytest.fixture(scope="module")
def trainer(model: Path, world: Any) -> Iterator[Any]:
    t = new_trainer(model, world)
    yield t
    t.close()


def rollout(url: str, model_path: Path, prompts: Sequence[list[int]], n: int = 2, **settings: Any) -> list[Sample]:
    """Samples as a run gets them: the manager's single-turn generate, with the engine's EOS ids."""
    from miles.models import eos_token_ids

    async def go() -> list[Sample]:
        client = HttpEngineClient([url])
        try:

            async def no_reward(samples: Sequence[Sample]) -> None:
                return None

            rollout_settings = RolloutSettings(rollout_batch_size=len(prompts), n_samples_per_prompt=n, **settings)
            manager = RolloutManager(
                client, rollout_settings, scorer=no_reward, eos_token_ids=eos_token_ids(model_path)
            )
            pending = [s for p in prompts for s in manager.new_group(_prompt(p))]
            return list(await asyncio.gather(*(manager.generate_sample(s) for s in pending)))
        finally:
            await client.close()

    return asyncio.run(go())


def _prompt(ids: list[int]) -> Any:
    from miles.data.base import Prompt

    return Prompt(prompt="", prompt_ids=ids)


def differences(trainer: Any, samples: Sequence[Sample], temperature: float, *, masks: bool = True) -> torch.Tensor:
    """|trainer - rollout| logprob of every response token (the trainer at ``temperature``; ``masks=False``
    drops the engine's logit masks from the batch, as the trainer scored before)."""
    batch = TrainBatch.from_samples(samples)
    if not masks:
        batch.response_tensors.pop(LOGIT_MASK_IDS, None)
    got = trainer.compute_logprobs(batch, temperature=temperature).logprobs.split(batch.response_lengths)
    want = batch.rows("rollout_logprobs")
    return torch.cat([(g - w).abs() for g, w in zip(got, want, strict=True)])


PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79], [7, 8, 9]]


def test_min_new_tokens_masks_eos_and_stop_token_ids(engine: EngineProcess, model: Path, trainer: Any) -> None:
    stops = list(range(3, 43))  # many likely ids: the mask removes several percent of the probability mass
    samples = rollout(
        engine.url, model, PROMPTS, max_new_tokens=12, min_new_tokens=8, stop_token_ids=stops, temperature=0.9
    )
    eos = samples[0].logit_masks[0].token_ids
    for s in samples:
        assert s.logit_masks and s.logit_masks[0].start == 0 and s.logit_masks[0].end == 8
        assert set(s.logit_masks[0].token_ids) == set(stops) | set(eos) and len(eos) > len(stops)
        assert not set(s.response_ids[:8]) & set(eos)  # the engine never sampled a masked id
    diff = differences(trainer, samples, 0.9)
    assert float(diff.max()) < ROUNDING, float(diff.max())
    before = differences(trainer, samples, 0.9, masks=False)
    masked = torch.cat([torch.arange(s.response_length) < 8 for s in samples])
    assert float(before[masked].min()) > 1e-2  # what the trainer used to compute at every masked position
    assert float(before[~masked].max()) < ROUNDING  # unmasked positions never differed


def test_top_k_and_top_p_change_nothing_the_trainer_scores(engine: EngineProcess, model: Path, trainer: Any) -> None:
    samples = rollout(engine.url, model, PROMPTS, max_new_tokens=10, temperature=0.8, top_k=5, top_p=0.7)
    assert all(not s.logit_masks for s in samples)
    assert float(differences(trainer, samples, 0.8).max()) < ROUNDING


def test_top_k_1_is_greedy_and_scored_at_temperature_1(engine: EngineProcess, model: Path, trainer: Any) -> None:
    samples = rollout(engine.url, model, PROMPTS, max_new_tokens=8, temperature=0.7, top_k=1)
    t = scoring_temperature(0.7, top_k=1)
    assert t == 1.0
    assert float(differences(trainer, samples, t).max()) < ROUNDING
    assert float(differences(trainer, samples, 0.7).mean()) > 1e-2


def test_return_original_logprob_is_scored_at_temperature_1(engine: EngineProcess, trainer: Any) -> None:
    """``return_original_logprob`` (the engine option ``--return-original-logprob`` sets its default): the
    logprobs of the raw logits, whatever the sampling temperature."""
    from miles.rollout.manager import sample_from_output
    from miles.rollout.protocol import GenerateOutput, SamplingParams

    async def go() -> list[Sample]:
        client = HttpEngineClient([engine.url])
        try:
            out = []
            for i, prompt in enumerate(PROMPTS):
                params = SamplingParams(max_new_tokens=8, temperature=0.7, sampling_seed=i)
                body = {"input_ids": prompt, "sampling_params": params.to_json(), "return_logprob": True}
                answer = await client.call(engine.url, "/generate", {**body, "return_original_logprob": True})
                out.append(sample_from_output(Sample(prompt_ids=prompt), GenerateOutput.from_json(answer)))
            return out
        finally:
            await client.close()

    samples = asyncio.run(go())
    t = scoring_temperature(0.7, original_logprobs=True)
    assert t == 1.0
    assert float(differences(trainer, samples, t).max()) < ROUNDING
    assert float(differences(trainer, samples, 0.7).mean()) > 1e-2
