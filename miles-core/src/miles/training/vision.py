"""Images in the training batch of a vision-language policy (Qwen2-VL family), and what a trainer's forward
needs of them.

A sample's images travel as references in its metadata (``metadata["images"]``, put there by the data
pipeline, :mod:`miles.data.vision`). On the driver, :func:`attach_images` decodes them once more through the
policy's image processor into the batch's :attr:`~miles.training.batch.TrainBatch.pixel_values`,
:attr:`~miles.training.batch.TrainBatch.image_grid_thw` and
:attr:`~miles.training.batch.TrainBatch.image_counts` (tensors: what crosses ranks). A sample whose prompt
holds image placeholders but that carries no images is refused, naming its row: a vision-language model
trained on placeholders without their images would look healthy and learn nothing about the images.

The placeholders that take image features are the prompt's and, in a multi-turn session's sample, those of
the response tokens no engine request sampled (a later user turn's images: outside
:attr:`~miles.types.Sample.request_spans`, loss mask 0). A placeholder token the policy sampled is an ordinary
token, as it was in the engine, and loss masks cover sampled tokens only, so image placeholders never enter
the loss. :func:`mrope_positions` gives a packed row the positions the engine used: M-RoPE through the last
image (the model's own ``get_rope_index``), then ``position + rope_delta``.
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

__all__ = ["attach_images", "image_placeholders", "image_rows", "mrope_positions", "placeholder_count"]


@functools.cache
def _vision_of(model_path: str) -> tuple[Any, int, int]:
    """The policy's image processor, image token id and spatial merge size."""
    import json
    from pathlib import Path

    from miles.data.vision import load_image_processor

    config = json.loads((Path(model_path) / "config.json").read_text())
    merge = int(config.get("vision_config", {}).get("spatial_merge_size", 2))
    return load_image_processor(model_path), int(config["image_token_id"]), merge


def placeholder_count(sample: Sample, token_id: int) -> int:
    """Image placeholders of ``sample``: its prompt's, and its response's outside the policy's request spans
    (a multi-turn session's later user turns)."""
    count = sum(1 for t in sample.prompt_ids if t == token_id)
    end = 0
    for start, stop in [*sample.request_spans, (sample.response_length, sample.response_length)]:
        if sample.request_spans:
            count += sum(1 for t in sample.response_ids[end:start] if t == token_id)
        end = stop
    return count


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
        placeholders = placeholder_count(sample, token_id)
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


def image_placeholders(
    tokens: torch.Tensor, prompt_length: int, requests: torch.Tensor | None, image_token_id: int
) -> torch.Tensor:
    """``[L]`` bool: the placeholders of one sequence that take image features: the prompt's, and the
    response's that no request sampled (``requests``: its :data:`~miles.training.request_spans.REQUEST_INDEX`
    row, ``-1`` where no request sampled; ``None``: one request sampled the whole response)."""
    mask = tokens == image_token_id
    if requests is None:
        mask[prompt_length:] = False
    else:
        mask[prompt_length:] &= requests.to(mask.device) < 0
    return mask


def mrope_positions(
    rope_index: Any,
    sequences: Sequence[torch.Tensor],
    prompt_lengths: Sequence[int],
    grids: Sequence[torch.Tensor | None],
    placeholders: Sequence[torch.Tensor],
) -> torch.Tensor:
    """``[4, 1, L]`` positions of a packed row of ``sequences``: row 0 each sequence's own positions (the
    attention's packing layout), rows 1-3 its M-RoPE positions (``rope_index``: the model's
    ``get_rope_index``, over the prompt or through the last image placeholder if later; the images
    ``grids[i]``, ``None`` without; ``placeholders[i]``: :func:`image_placeholders`)."""
    import torch

    rows = []
    for tokens, prompt, grid, mask in zip(sequences, prompt_lengths, grids, placeholders, strict=True):
        n = tokens.numel()
        plain = torch.arange(n, dtype=torch.long)
        if grid is None:
            rows.append(torch.stack([plain] * 4))
            continue
        found = mask.nonzero()
        upto = max(prompt, int(found[-1]) + 1 if found.numel() else 0)
        ids = tokens[:upto].reshape(1, -1).long()
        types = mask[:upto].reshape(1, -1).to(torch.int32)
        rope, delta = rope_index(ids, mm_token_type_ids=types, image_grid_thw=grid)
        tail = (torch.arange(upto, n, dtype=torch.long) + int(delta.reshape(-1)[0]))[None].expand(3, -1)
        rows.append(torch.cat([plain[None], torch.cat([rope[:, 0].cpu(), tail], dim=1)]))
    return torch.cat(rows, dim=1)[:, None]
