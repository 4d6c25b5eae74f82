from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from miles_diffusion.denoise import encode_prompts, prompt_texts, velocity
from miles_diffusion.sampling import SamplingOptions, sample_trajectories, stochastic_steps
from miles_diffusion.sde import gaussian_logprob, sde_mean_std

PROMPTS = ["a red square", "a blue cat"]


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_ode_sampling_is_the_pipelines_own(pipe: Any, guidance: float) -> None:
    """Without SDE steps the engine's loop gives exactly StableDiffusion3Pipeline's images (same seeds)."""
    options = SamplingOptions(num_steps=5, guidance_scale=guidance, sde_window=(0, 0), max_sequence_length=16)
    ours = sample_trajectories(pipe, PROMPTS, [1, 2], options)
    generators = [torch.Generator().manual_seed(s) for s in (1, 2)]
    theirs = pipe(
        PROMPTS, num_inference_steps=5, guidance_scale=guidance, height=32, width=32, generator=generators,
        max_sequence_length=16, output_type="pil",
    ).images  # fmt: skip
    for mine, image in zip(ours, theirs, strict=True):
        assert mine.steps == [] and np.array_equal(mine.image, np.asarray(image))


def test_sde_trajectories_record_what_the_trainer_rescores(pipe: Any) -> None:
    options = SamplingOptions(num_steps=6, guidance_scale=2.0, sde_window=(1, 4), max_sequence_length=16)
    assert stochastic_steps(options) == [1, 2, 3]
    (traj,) = sample_trajectories(pipe, PROMPTS[:1], [7], options)
    assert traj.steps == [1, 2, 3] and traj.latents.shape == (3, 4, 8, 8) and traj.image.shape == (32, 32, 3)
    assert torch.equal(traj.latents[1], traj.next_latents[0])  # consecutive SDE steps chain
    prompts = encode_prompts(pipe, PROMPTS[:1] * 3, guidance_scale=2.0, max_sequence_length=16, device="cpu")
    with torch.no_grad():
        v = velocity(pipe.transformer, traj.latents, traj.timesteps, prompts, 2.0)
        mean, std = sde_mean_std(traj.latents, v, traj.sigmas[:, 0], traj.sigmas[:, 1], traj.noise_levels)
    assert torch.allclose(gaussian_logprob(traj.next_latents, mean, std), torch.tensor(traj.logprobs), atol=1e-5)
    (again,) = sample_trajectories(pipe, PROMPTS[:1], [7], options)
    assert torch.equal(again.next_latents, traj.next_latents) and again.logprobs == traj.logprobs
    (other,) = sample_trajectories(pipe, PROMPTS[:1], [8], options)
    assert not torch.equal(other.next_latents, traj.next_latents)


def test_an_image_depends_on_its_own_seed_not_its_batch(pipe: Any) -> None:
    options = SamplingOptions(num_steps=4, max_sequence_length=16)
    alone = sample_trajectories(pipe, PROMPTS[:1], [11], options)[0]
    batched = sample_trajectories(pipe, PROMPTS, [11, 12], options)[0]
    assert torch.allclose(alone.next_latents, batched.next_latents, atol=1e-5)


def test_abort_between_steps(pipe: Any) -> None:
    calls = []

    def abort() -> bool:
        calls.append(1)
        return len(calls) > 2

    out = sample_trajectories(
        pipe, PROMPTS, [1, 2], SamplingOptions(num_steps=6, max_sequence_length=16), should_abort=abort
    )
    assert all(t.aborted and t.steps == [] for t in out) and len(calls) == 3


def test_prompt_ids_round_trip_through_the_pipelines_tokenizer(pipe: Any) -> None:
    ids = pipe.tokenizer(PROMPTS)["input_ids"]
    assert prompt_texts(pipe.tokenizer, ids) == PROMPTS


def test_a_bfloat16_pipeline_is_bfloat16_throughout_and_samples(policy_dir: Any) -> None:
    """``load_pipeline(dtype="bfloat16")`` (the engine under ``precision = "bf16"``, which ``auto`` picks on CPUs
    with bfloat16 units): diffusers left the transformer in float32, and every sample failed at its first
    convolution ("Input type (c10::BFloat16) and bias type (float) should be the same")."""
    from miles_diffusion.policy import load_pipeline

    pipe = load_pipeline(policy_dir, dtype="bfloat16")
    modules = {name: m for name, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    assert "transformer" in modules
    assert {name: next(m.parameters()).dtype for name, m in modules.items()} == dict.fromkeys(modules, torch.bfloat16)
    options = SamplingOptions(num_steps=4, sde_window=(1, 3), max_sequence_length=16)
    (traj,) = sample_trajectories(pipe, PROMPTS[:1], [7], options)
    assert traj.steps == [1, 2] and torch.isfinite(traj.latents).all() and all(np.isfinite(traj.logprobs))
