"""Routing replay (R3) in the fsdp trainer against a real engine process serving a tiny Qwen3-MoE.

The model's routers are built with near-tied experts (every expert's router row is one shared row plus 1%
noise), and the engine serves bfloat16 while the trainer runs float32: the engine's rounding then flips
which experts win for a share of the tokens. Without replay the trainer's routers choose on their own
(routing agreement < 100%, each flipped token a different expert mix); with replay they take the engine's
recorded experts for every token it routed, and the trainer-vs-rollout logprob difference falls to what the
bfloat16 rounding alone gives.
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
from miles.testing.algorithms import RatioPG
from miles.testing.engine import EngineProcess
from miles.training.batch import TrainBatch
from miles.training.routing import ROUTED_EXPERTS
from miles.types import Sample

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79], [7, 8, 9, 10], [100, 200, 300, 400, 5]]


def build_near_tied_moe(root: Path) -> Path:
    """A tiny Qwen3-MoE (8 experts, top-2) under ``root`` whose router rows are near-ties."""
    from safetensors.torch import load_file, save_file

    from miles.testing.models import build_tiny_model

    path = build_tiny_model(root / "qwen3_moe", "qwen3_moe", seed=3, num_experts=8, num_experts_per_tok=2)
    tensors = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith("mlp.gate.weight")]:
        experts, hidden = tensors[name].shape
        shared = torch.randn(1, hidden, generator=g)
        tensors[name] = (shared + 0.01 * torch.randn(experts, hidden, generator=g)).contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_near_tied_moe(tmp_path_factory.mktemp("r3"))


@pytest.fixture(scope="module")
def engine(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    logs = tmp_path_factory.mktemp("logs")
    with EngineProcess(model, extra_args=["--dtype", "bfloat16"], log_path=logs / "engine.log") as proc:
        yield proc


def new_trainer(model_path: Path, ctx: Any, *, replay: bool) -> Any:
    from miles.precision.builtin import FP32
    from miles.settings.model import TrainSettings
    from miles_fsdp.settings import FSDPSettings
    from miles_fsdp.trainer import FSDPTrainer

    train = TrainSettings(model_path=str(model_path), routing_replay=replay, lr=1e-4)  # type: ignore[call-arg]
    trainer = FSDPTrainer(train, FSDPSettings(), FP32(None), ctx)
    trainer.setup()
    return trainer


def rollout(url: str) -> list[Sample]:
    async def no_reward(samples: Sequence[Sample]) -> None:
        return None

    async def go() -> list[Sample]:
        client = HttpEngineClient([url])
        try:
            settings = RolloutSettings(
                rollout_batch_size=len(PROMPTS), n_samples_per_prompt=2, max_new_tokens=12, temperature=1.0
            )
            manager = RolloutManager(client, settings, scorer=no_reward, seed=7, return_routed_experts=True)
            from miles.data.base import Prompt

            pending = [s for p in PROMPTS for s in manager.new_group(Prompt(prompt="", prompt_ids=p))]
            return list(await asyncio.gather(*(manager.generate_sample(s) for s in pending)))
        finally:
            await client.close()

    return asyncio.run(go())


def differences(trainer: Any, batch: TrainBatch) -> torch.Tensor:
    got = trainer.compute_logprobs(batch, temperature=1.0).logprobs.split(batch.response_lengths)
    want = batch.rows("rollout_logprobs")
    assert want is not None
    return torch.cat([(g - w).abs() for g, w in zip(got, want, strict=True)])


def with_advantages(samples: Sequence[Sample]) -> TrainBatch:
    batch = TrainBatch.from_samples(samples, [[0.5 - i % 2] * s.response_length for i, s in enumerate(samples)])
    batch.old_logprobs = batch.rollout_logprobs
    return batch


@pytest.mark.slow
def test_replay_makes_the_trainer_route_as_the_engine(engine: EngineProcess, model: Path, world: Any) -> None:
    samples = rollout(engine.url)
    batch = TrainBatch.from_samples(samples)
    routed = batch.token_tensors[ROUTED_EXPERTS]
    assert routed.dtype == torch.int16 and tuple(routed.shape) == (batch.num_tokens, 2, 2)
    last = (batch.seq_offsets[1:] - 1).tolist()  # the last token of a sequence is never fed to the model
    assert bool((routed[last] == -1).all()) and int((routed >= 0).all(-1).all(-1).sum()) == batch.num_tokens - len(
        samples
    )

    replaying = new_trainer(model, world, replay=True)
    own = new_trainer(model, world, replay=False)
    try:
        with_replay = differences(replaying, batch)
        without = differences(own, batch)
        off = own.train_step(with_advantages(samples), RatioPG(), temperature=1.0)
        on = replaying.train_step(with_advantages(samples), RatioPG(), temperature=1.0)
    finally:
        replaying.close()
        own.close()
    # the trainer's own routing differs from the engine's on some tokens, in every layer
    assert 0.5 < off["fidelity/routing_agreement"] < 1.0
    assert all(off[f"fidelity/routing_agreement_layer{i}"] < 1.0 for i in range(2))
    # measured before the replay's choice: the first layer sees the same inputs either way (later layers see
    # the replayed layers' outputs)
    assert on["fidelity/routing_agreement_layer0"] == off["fidelity/routing_agreement_layer0"]
    # replaying the engine's experts removes the flipped-routing error
    assert float(with_replay.max()) < 0.5 * float(without.max())
    assert float(with_replay.mean()) < 0.5 * float(without.mean())
    assert on["train_rollout_logprob_abs_diff"] < 0.5 * off["train_rollout_logprob_abs_diff"]
    print(
        f"max |diff| {float(without.max()):.4g} -> {float(with_replay.max()):.4g}, mean {float(without.mean()):.4g}"
        f" -> {float(with_replay.mean()):.4g}, agreement {off['fidelity/routing_agreement']:.3f}"
    )
