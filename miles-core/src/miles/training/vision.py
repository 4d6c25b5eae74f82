"""Images in the training batch of a vision-language policy (Qwen2-VL family), and what a trainer's forward
needs of them.

A sample's images travel as references in its metadata (``metadata["images"]``, put there by the data
pipeline, :mod:`miles.data.vision`). On the driver, :func:`attach_images` decodes them once more through the
policy's image processor into the batch's :attr:`~miles.training.batch.TrainBatch.pixel_values`,
:attr:`~miles.training.batch.TrainBatch.image_grid_thw` and
:attr:`~miles.training.batch.TrainBatch.image_counts` (tensors: what crosses ranks). A sample whose prompt
holds image placeholders but that carries no images is refused, naming its row: a vision-language model
trained on placeholders without their images would look healthy and learn nothing about the images.

Only the prompt's placeholders take image features: the response is what the policy sampled (a placeholder
token it sampled is an ordinary token there, as in the engine), and loss masks cover response tokens only,
so image placeholders never enter the loss. :func:`mrope_positions` gives a packed row the positions the
engine used: M-RoPE over each prompt (the model's own ``get_rope_index``), then ``position + rope_delta``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from miles.errors import DataError

if TYPE_CHECKING:
    import torch

    from miles.training.batch import TrainBatch
    from miles.types import Sample

__all__ = ["attach_images", "image_rows", "mrope_positions", "prompt_image_mask"]


@functools.cache
def _vision_of(model_path: str) -> tuple[Any, int, int]:
    """The policy's image processor, image token id and spatial merge size."""
    import json
    from pathlib import Path

    from miles.data.vision import load_image_processor

    config = json.loads((Path(model_path) / "config.json").read_text())
    merge = int(config.get("vision_config", {}).get("spatial_merge_size", 2))
    return load_image_processor(model_path), int(config["image_token_id"]), merge


def attach_images(batch: TrainBatch, samples: Sequence[Sample], model_path: str, *, image_key: str = "images") -> None:
    """Set ``batch``'s pixel values, grids and per-sequence image counts from ``samples``' image references.

    :class:`~miles.errors.DataError` names the sample's row when its prompt's placeholders and its images do
    not match (a text-only sample of an image prompt included).
    """
    import torch

    from miles.data.vision import VisionInputs, load_images, process_images

    processor, token_id, merge = _vision_of(model_path)
    pixels: list[torch.Tensor] = []
    grids: list[torch.Tensor] = []
    counts: list[int] = []
    seen: dict[tuple[str, ...], VisionInputs] = {}
    for i, sample in enumerate(samples):
        where = str(sample.metadata.get("source") or f"sample {i} (group {sample.group_id})")
        refs = sample.metadata.get(image_key) or []
        placeholders = sum(1 for t in sample.prompt_ids if t == token_id)
        if not refs:
            if placeholders:
                raise DataError(
                    f"{where}: the prompt holds {placeholders} image placeholder tokens but the sample carries no "
                    f"images (metadata {image_key!r}); a vision-language policy cannot be trained on it as text"
                )
            counts.append(0)
            continue
        key = tuple(map(str, refs))
        vision = seen.get(key)
        if vision is None:  # once per prompt: its n samples share it
            images = load_images(list(refs), where=where, image_key=image_key, base_dir=None)
            vision = seen[key] = process_images(processor, images)
        if sum(vision.token_counts(merge)) != placeholders:
            raise DataError(
                f"{where}: the prompt holds {placeholders} image placeholder tokens, its {len(refs)} image(s) "
                f"need {sum(vision.token_counts(merge))}"
            )
        pixels.append(vision.pixel_values.float())
        grids.append(vision.image_grid_thw)
        counts.append(len(images))
    if not any(counts):
        return
    batch.pixel_values = torch.cat(pixels)
    batch.image_grid_thw = torch.cat(grids).to(torch.int64)
    batch.image_counts = torch.tensor(counts, dtype=torch.int64)
    batch.__post_init__()


def image_rows(batch: TrainBatch, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The pixel values and grids of sequences ``indices``' images, in that order (``None``: no images)."""
    if batch.image_counts is None or batch.pixel_values is None or batch.image_grid_thw is None:
        return None
    images, patches = batch.image_index(indices)
    if not images.numel():
        return None
    return batch.pixel_values[patches], batch.image_grid_thw[images]


def mrope_positions(
    rope_index: Any,
    sequences: Sequence[torch.Tensor],
    prompt_lengths: Sequence[int],
    grids: Sequence[torch.Tensor | None],
    image_token_id: int,
) -> torch.Tensor:
    """``[4, 1, L]`` positions of a packed row of ``sequences``: row 0 each sequence's own positions (the
    attention's packing layout), rows 1-3 its M-RoPE positions (``rope_index``: the model's
    ``get_rope_index``; the prompt's images ``grids[i]``, ``None`` without)."""
    import torch

    rows = []
    for tokens, prompt, grid in zip(sequences, prompt_lengths, grids, strict=True):
        n = tokens.numel()
        plain = torch.arange(n, dtype=torch.long)
        if grid is None:
            rows.append(torch.stack([plain] * 4))
            continue
        ids = tokens[:prompt].reshape(1, -1).long()
        types = (ids == image_token_id).to(torch.int32)
        rope, delta = rope_index(ids, mm_token_type_ids=types, image_grid_thw=grid)
        tail = (torch.arange(prompt, n, dtype=torch.long) + int(delta.reshape(-1)[0]))[None].expand(3, -1)
        rows.append(torch.cat([plain[None], torch.cat([rope[:, 0].cpu(), tail], dim=1)]))
    return torch.cat(rows, dim=1)[:, None]


def prompt_image_mask(
    sequences: Sequence[torch.Tensor], prompt_lengths: Sequence[int], image_token_id: int
) -> torch.Tensor:
    """``[1, L]`` bool: the prompts' image placeholders of a packed row (what takes image features; a
    placeholder token in a response is an ordinary token)."""
    import torch

    parts = []
    for tokens, prompt in zip(sequences, prompt_lengths, strict=True):
        mask = tokens == image_token_id
        mask[prompt:] = False
        parts.append(mask)
    return torch.cat(parts)[None]
