"""Sampling trajectories: the denoising loop of the image engine, with per-step records for training.

Each image has its own ``torch.Generator`` seeded with its request's seed: the initial noise and every
SDE step's noise come from it, so an image depends on its prompt, seed and weights only — not on the
other images of its batch (up to float rounding of batched kernels; the engine's deterministic mode
runs one image per forward). Steps inside ``sde_window`` are stochastic (Flow-GRPO's SDE, recorded for
training); the others are ODE steps (Flow-GRPO-Fast / MixGRPO's mixed sampling), not trained on.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles_diffusion.denoise import PromptEmbeddings, encode_prompts, velocity
from miles_diffusion.sde import ode_step, sde_step

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["SamplingOptions", "Trajectory", "decode_images", "png_bytes", "sample_trajectories", "stochastic_steps"]


@dataclass(frozen=True)
class SamplingOptions:
    """How the engine samples (its ``[rollout.engine]`` table holds the same fields)."""

    num_steps: int = 10
    height: int = 32
    width: int = 32
    guidance_scale: float = 1.0
    noise_level: float = 0.7
    sde_window: tuple[int, int] | None = None
    max_sequence_length: int = 256


def stochastic_steps(options: SamplingOptions) -> list[int]:
    """The indices of the SDE steps (all of them without a window)."""
    if options.sde_window is None:
        return list(range(options.num_steps))
    start, end = options.sde_window
    return list(range(max(start, 0), min(end, options.num_steps)))


@dataclass
class Trajectory:
    """One image's denoising record: the SDE steps (``S`` of them) and the final image."""

    steps: list[int]
    """Index of each SDE step in the schedule."""
    logprobs: list[float]
    """Per SDE step: log-probability of the sampled next latent (per-element mean)."""
    latents: torch.Tensor
    """``[S, C, h, w]`` float32: the latent each SDE step started from."""
    next_latents: torch.Tensor
    """``[S, C, h, w]`` float32: the latent it sampled."""
    timesteps: torch.Tensor
    """``[S]`` float32: the transformer's timestep input."""
    sigmas: torch.Tensor
    """``[S, 2]`` float32: noise level before and after the step."""
    noise_levels: torch.Tensor
    """``[S]`` float32: the SDE's ``eta``."""
    guidance: torch.Tensor
    """``[S]`` float32: the guidance scale."""
    text_lengths: torch.Tensor
    """``[S]`` int64: the prompt encoding's ``max_sequence_length``."""
    image: np.ndarray
    """``[H, W, 3]`` uint8."""
    aborted: bool = False

    def tensors(self) -> dict[str, torch.Tensor]:
        """The per-step tensors by name (what travels as ``Sample.response_tensors``)."""
        return {
            "latents": self.latents,
            "next_latents": self.next_latents,
            "timesteps": self.timesteps,
            "sigmas": self.sigmas,
            "noise_levels": self.noise_levels,
            "guidance": self.guidance,
            "text_lengths": self.text_lengths,
        }


def decode_images(pipe: Any, latents: torch.Tensor) -> np.ndarray:
    """``[B, H, W, 3]`` uint8 images from final latents (the pipeline's VAE decode and post-processing)."""
    import torch

    vae = pipe.vae
    with torch.no_grad():
        scaled = latents.to(vae.dtype) / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        pixels = vae.decode(scaled, return_dict=False)[0]
    pixels = (pixels.float() / 2 + 0.5).clamp(0, 1)
    return (pixels.permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype("uint8")


def png_bytes(image: np.ndarray) -> bytes:
    """A lossless PNG of an ``[H, W, 3]`` uint8 image."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def sample_trajectories(
    pipe: Any,
    texts: Sequence[str],
    seeds: Sequence[int],
    options: SamplingOptions,
    *,
    should_abort: Callable[[], bool] | None = None,
) -> list[Trajectory]:
    """Sample one image per ``(text, seed)`` in one batch, recording every SDE step.

    ``should_abort`` is polled between steps; when it answers true the batch stops and every trajectory
    comes back with ``aborted`` set.
    """
    import torch

    device = pipe.transformer.device
    transformer = pipe.transformer
    scale = pipe.vae_scale_factor
    channels = transformer.config.in_channels
    shape = (1, channels, options.height // scale, options.width // scale)
    generators = [torch.Generator(device="cpu").manual_seed(int(s)) for s in seeds]
    latents = torch.cat([torch.randn(shape, generator=g, dtype=torch.float32) for g in generators]).to(device)
    prompts: PromptEmbeddings = encode_prompts(
        pipe,
        texts,
        guidance_scale=options.guidance_scale,
        max_sequence_length=options.max_sequence_length,
        device=device,
    )
    scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
    scheduler.set_timesteps(options.num_steps, device=device)
    sigmas, timesteps = scheduler.sigmas.float(), scheduler.timesteps.float()
    sde = set(stochastic_steps(options))
    n = len(texts)
    starts: list[torch.Tensor] = []
    nexts: list[torch.Tensor] = []
    logprobs: list[torch.Tensor] = []
    aborted = False
    with torch.no_grad():
        for j in range(options.num_steps):
            if should_abort is not None and should_abort():
                aborted = True
                break
            t = timesteps[j].expand(n)
            v = velocity(transformer, latents, t, prompts, options.guidance_scale)
            s, s_next = sigmas[j].expand(n), sigmas[j + 1].expand(n)
            if j in sde:
                noise = torch.cat([torch.randn(shape, generator=g, dtype=torch.float32) for g in generators]).to(device)
                eta = torch.full((n,), options.noise_level, dtype=torch.float32)
                nxt, logp = sde_step(latents, v, s, s_next, eta, noise)
                starts.append(latents.float().cpu())
                nexts.append(nxt.cpu())
                logprobs.append(logp.cpu())
            else:
                nxt = ode_step(latents, v, s, s_next)
            latents = nxt
    images = decode_images(pipe, latents) if not aborted else None
    steps = sorted(sde) if not aborted else []
    count = len(steps)
    out = []
    for i in range(n):
        out.append(
            Trajectory(
                steps=steps,
                logprobs=[float(lp[i]) for lp in logprobs] if not aborted else [],
                latents=torch.stack([x[i] for x in starts]) if count else torch.zeros((0, *shape[1:])),
                next_latents=torch.stack([x[i] for x in nexts]) if count else torch.zeros((0, *shape[1:])),
                timesteps=timesteps[steps].cpu() if count else torch.zeros(0),
                sigmas=torch.stack([sigmas[steps], sigmas[[k + 1 for k in steps]]], dim=1).cpu()
                if count
                else torch.zeros((0, 2)),
                noise_levels=torch.full((count,), options.noise_level, dtype=torch.float32),
                guidance=torch.full((count,), options.guidance_scale, dtype=torch.float32),
                text_lengths=torch.full((count,), options.max_sequence_length, dtype=torch.int64),
                image=images[i] if images is not None else _blank(options),
                aborted=aborted,
            )
        )
    return out


def _blank(options: SamplingOptions) -> np.ndarray:
    import numpy as np

    return np.zeros((options.height, options.width, 3), dtype=np.uint8)
