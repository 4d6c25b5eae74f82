"""The signal checks (issue 40) on real parts: a dead teacher (a tiny model whose final norm is zero, so its
logits are all 0) scores real samples and reads as uniform and constant, a healthy one does not; a reward
that matches nothing is constant across the step, a length reward is not; a reward built to be unrelated to
every feature is found over the window; ``log.signals.stop`` turns a warning into an error naming the check.
The probe and gradient checks run against a real engine and trainer (``tests/integration/test_signals.py``,
``miles-fsdp/tests/test_signals.py``)."""

from __future__ import annotations

import asyncio
import logging
import math
from pathlib import Path

import pytest
import torch

from miles.driver.signals import SignalChecks, logprob_spread, pearson
from miles.errors import SignalCheckError
from miles.rewards.text import LengthPenaltyReward, LengthPenaltySettings, RegexReward, RegexSettings
from miles.settings.signals import SIGNAL_CHECKS, SignalSettings
from miles.training.batch import TrainBatch
from miles.types import Sample, SampleGroup

VOCAB = 512


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny policy, a healthy teacher (other weights) and a dead one (its final norm zeroed)."""
    from safetensors.torch import load_file, save_file

    from miles.testing.models import build_tiny_model

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("signal-models")
    policy = build_tiny_model(root / "policy", "qwen2", seed=0, vocab_size=VOCAB)
    healthy = build_tiny_model(root / "teacher", "qwen2", seed=1, vocab_size=VOCAB)
    dead = build_tiny_model(root / "dead", "qwen2", seed=1, vocab_size=VOCAB)
    weights = load_file(dead / "model.safetensors")
    weights["model.norm.weight"] = torch.zeros_like(weights["model.norm.weight"])
    save_file(weights, dead / "model.safetensors", metadata={"format": "pt"})
    return {"policy": policy, "teacher": healthy, "dead": dead}


def _samples(policy: Path, n: int = 6) -> list[Sample]:
    """``n`` responses sampled by the policy (HF ``generate``), with their rollout logprobs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    torch.manual_seed(0)
    out = []
    for i in range(n):
        prompt = tokenizer.encode(f"What is {i} + 3?")
        gen = model.generate(
            torch.tensor([prompt]),
            do_sample=True,
            max_new_tokens=4 + i,
            min_new_tokens=4 + i,
            output_scores=True,
            return_dict_in_generate=True,
        )
        response = gen.sequences[0, len(prompt) :].tolist()
        logps = [float(torch.log_softmax(s[0], -1)[t]) for s, t in zip(gen.scores, response, strict=True)]
        out.append(
            Sample(
                prompt_ids=prompt,
                response_ids=response,
                rollout_logprobs=logps,
                loss_mask=[1] * len(response),
                response=tokenizer.decode(response),
                index=i,
            )
        )
    return out


def _scored_by(teacher: Path, samples: list[Sample]) -> TrainBatch:
    """The batch of ``samples`` with ``teacher``'s logprobs of each response token (an HF forward)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32)
    rows = []
    with torch.no_grad():
        for s in samples:
            tokens = torch.tensor([s.prompt_ids + s.response_ids])
            logp = torch.log_softmax(model(tokens).logits[0, :-1].float(), -1)
            picked = logp.gather(1, tokens[0, 1:, None])[:, 0]
            rows.append(picked[len(s.prompt_ids) - 1 :].tolist())
    return TrainBatch.from_lists(
        tokens=[s.prompt_ids + s.response_ids for s in samples],
        prompt_lengths=[len(s.prompt_ids) for s in samples],
        loss_mask=[s.loss_mask for s in samples],
        rollout_logprobs=[s.rollout_logprobs for s in samples],
        teacher_logprobs=rows,
    )


def test_a_dead_teacher_reads_as_uniform_and_constant_a_healthy_one_does_not(
    models: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    samples = _samples(models["policy"])
    checks = SignalChecks(SignalSettings(), vocab_size=VOCAB)

    dead = logprob_spread([_scored_by(models["dead"], samples)])
    assert dead["signals/teacher_logprob_mean"] == pytest.approx(-math.log(VOCAB), abs=1e-5)
    with caplog.at_level(logging.WARNING, logger="miles.driver.signals"):
        fired = checks.judge(3, dead)
    assert fired == ["teacher_logprobs_uniform", "teacher_logprobs_constant"]
    assert dead["signals/teacher_logprobs_uniform"] == dead["signals/teacher_logprobs_constant"] == 1.0
    assert dead["signals/teacher_uniform_rms"] < 1e-5
    assert "step 3: signal check teacher_logprobs_uniform" in caplog.text
    assert "log.signals.uniform_tolerance" in caplog.text

    as_reference = _scored_by(models["dead"], samples)  # a dead reference model reads the same
    as_reference.set_token_field("ref_logprobs", as_reference.teacher_logprobs)
    as_reference.teacher_logprobs = None
    assert checks.judge(3, logprob_spread([as_reference])) == ["ref_logprobs_uniform", "ref_logprobs_constant"]

    healthy = logprob_spread([_scored_by(models["teacher"], samples)])
    assert checks.judge(3, healthy) == []
    assert healthy["signals/teacher_logprobs_uniform"] == healthy["signals/teacher_logprobs_constant"] == 0.0
    assert healthy["signals/teacher_uniform_rms"] > 10 * SignalSettings().uniform_tolerance  # a random tiny model
    assert "signals/ref_logprobs_uniform" not in healthy  # no reference in these batches: not measured


def test_a_reward_that_matches_nothing_is_constant_across_the_step(models: dict[str, Path]) -> None:
    samples = _samples(models["policy"])
    never = RegexReward(RegexSettings(pattern="(?!)"))  # a format reward whose pattern cannot match
    by_length = LengthPenaltyReward(LengthPenaltySettings(max_length=16, mode="linear"))
    checks = SignalChecks(SignalSettings(), vocab_size=VOCAB)

    for reward, expected in ((never, ["reward_constant"]), (by_length, [])):
        for s in samples:
            s.reward = asyncio.run(reward.score(s))
        metrics = checks.reward_metrics([SampleGroup(0, samples[:3]), SampleGroup(1, samples[3:])])
        assert checks.judge(1, metrics) == expected
        assert metrics["signals/reward_constant"] == float(bool(expected))


def test_a_reward_unrelated_to_every_feature_is_found_over_the_window() -> None:
    """Pairs of samples alike in every feature (length, prompt length, confidence) get rewards +1 and -1:
    the reward varies in every step yet says nothing the samples show; a length reward over the same
    samples correlates fully. The check waits for ``reward_window`` steps."""
    settings = SignalSettings(reward_window=3)

    def step(reward_of: str, k: int) -> list[SampleGroup]:
        groups = []
        for g in range(2):
            pair = []
            for sign in (1.0, -1.0):
                n = 3 + g + k
                s = Sample(prompt_ids=[1] * (2 + g), response_ids=[7] * n, rollout_logprobs=[-0.5 - g] * n)
                s.loss_mask = [1] * n
                s.reward = sign if reward_of == "nothing" else -float(n)
                pair.append(s)
            groups.append(SampleGroup(g, pair))
        return groups

    for reward_of, fires in (("nothing", True), ("length", False)):
        checks = SignalChecks(settings, vocab_size=VOCAB)
        for k in range(3):
            metrics = checks.reward_metrics(step(reward_of, k))
            fired = checks.judge(k + 1, metrics)
            assert ("reward_feature_corr" in "".join(metrics)) == (k == 2)  # measured once the window is full
        assert ("reward_uncorrelated" in fired) == fires
        assert metrics["signals/reward_feature_corr"] == pytest.approx(0.0 if fires else 1.0, abs=1e-12)


def test_stop_raises_naming_the_check_and_disable_skips_it(models: dict[str, Path]) -> None:
    samples = _samples(models["policy"], n=2)
    measured = logprob_spread([_scored_by(models["dead"], samples)])
    stopping = SignalChecks(SignalSettings(stop=True), vocab_size=VOCAB)
    fired = stopping.judge(2, dict(measured))
    with pytest.raises(
        SignalCheckError, match=r"step 2: signal check 'teacher_logprobs_uniform' fired: .*log.signals.stop"
    ):
        stopping.stop_if_fired(2, fired)

    quiet = SignalChecks(
        SignalSettings(stop=True, disable=["teacher_logprobs_uniform", "teacher_logprobs_constant"]), vocab_size=VOCAB
    )
    metrics = dict(measured)
    assert quiet.judge(2, metrics) == []
    quiet.stop_if_fired(2, [])
    assert not any(k in metrics for k in ("signals/teacher_logprobs_uniform", "signals/teacher_logprobs_constant"))
    off = SignalChecks(SignalSettings(enabled=False), vocab_size=VOCAB)
    assert off.judge(2, dict(measured)) == []


def test_the_gradient_check_needs_non_zero_advantages() -> None:
    checks = SignalChecks(SignalSettings(), vocab_size=VOCAB)
    assert checks.judge(1, {"train/grad_norm": 0.0, "signals/advantage_abs_mean": 0.5}) == ["grad_zero"]
    assert checks.judge(1, {"train/grad_norm": 0.0, "signals/advantage_abs_mean": 0.0}) == []  # nothing to learn
    assert checks.judge(1, {"train/grad_norm": 0.3, "signals/advantage_abs_mean": 0.5}) == []


def test_pearson_and_the_check_names() -> None:
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert pearson([1, 2, 3], [5, 5, 5]) is None
    assert set(SIGNAL_CHECKS) >= {"teacher_logprobs_uniform", "reward_constant", "probe_unchanged", "grad_zero"}


def test_an_engine_that_died_since_the_push_is_not_probed_and_the_run_goes_on() -> None:
    """The probe check asks every engine for the probe's logprobs after a push. An engine that died in the
    meantime (SIGKILLed at its next ``/generate``, which may be the probe's) is failover's to handle: the check
    skips it for the step instead of ending the run with its connection error (the failover test of an engine
    killed mid-rollout failed so when the probe was the killed engine's next request)."""
    from miles.net import free_port
    from miles.rollout.http_client import HttpEngineClient

    checks = SignalChecks(SignalSettings(), vocab_size=512)

    async def probe() -> dict[str, float]:
        async with HttpEngineClient([f"http://127.0.0.1:{free_port()}"], max_retries=1, backoff=0.01) as client:
            return await checks.probe_metrics(client, [1, 2, 3])

    assert asyncio.run(probe()) == {}
