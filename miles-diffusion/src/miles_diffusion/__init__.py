"""miles-diffusion: RL post-training of diffusion models (Flow-GRPO) on diffusers, as Miles plugins.

A diffusion trajectory is a :class:`miles.types.Sample` whose response tokens are its stochastic
denoising steps: ``rollout_logprobs`` holds each step's Gaussian log-probability and
``response_tensors`` the latents before and after it. The image engine, the trainer, the Flow-GRPO
algorithm and the image rewards plug into the core's seams unchanged (see ``docs/explanation/diffusion.md``).

Importing this package is cheap: torch and diffusers are imported where they are used.
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
