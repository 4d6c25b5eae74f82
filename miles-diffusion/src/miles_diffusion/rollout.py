"""The ``diffusion`` rollout function: one image per sample, its trajectory kept for training.

The core's single-turn path already turns the engine's answer into a sample — one response "token" per
SDE step, its log-probability, the weight version, the status. This function adds what an image has
beyond tokens: the trajectory's tensors (``Sample.response_tensors``, which the trainer re-scores) and
the image itself (``Sample.metadata["image"]``, a base64 PNG the rewards read).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from miles.rollout.manager import sample_from_output
from miles.types import SampleStatus, TensorData

if TYPE_CHECKING:
    from miles.rollout.client import EngineClient
    from miles.rollout.protocol import SamplingParams
    from miles.types import Sample

__all__ = ["TRAJECTORY_TENSORS", "diffusion_rollout"]

TRAJECTORY_TENSORS = ("latents", "next_latents", "timesteps", "sigmas", "noise_levels", "guidance", "text_lengths")
"""The per-step tensors the image engine returns and the trainer needs."""


async def diffusion_rollout(client: EngineClient, sample: Sample, sampling_params: SamplingParams) -> Sample:
    """Generate ``sample``'s image; fill its steps, log-probs, trajectory tensors and image."""
    routing_key = str(sample.metadata.get("routing_key", f"group-{sample.group_id}"))
    outputs = await client.generate(sample.prompt_ids, replace(sampling_params, n=1), routing_key=routing_key)
    out = outputs[0]
    result = sample_from_output(sample, out)
    if result.status != SampleStatus.COMPLETED:
        return result
    meta = out.meta_info
    trajectory = meta.get("trajectory")
    if not isinstance(trajectory, dict) or "image" not in meta:
        missing = "trajectory" if not isinstance(trajectory, dict) else "image"
        return replace(
            result,
            status=SampleStatus.FAILED,
            status_reason=f"the engine's answer has no meta_info.{missing} (is rollout.engine an image engine?)",
        )
    tensors = {name: TensorData.from_dict(trajectory[name]) for name in TRAJECTORY_TENSORS if name in trajectory}
    result.response_tensors = tensors
    result.metadata = {**result.metadata, "image": meta["image"]}
    result.validate()
    return result
