"""Images in the local engine: SGLang's ``image_data`` parsed into what a prefill needs.

A ``/generate`` body may carry ``image_data`` (SGLang's ``GenerateReqInput.image_data``): for one prompt an
image or a list of images, for a batch a list with one entry (an image, a list of images, or ``null``) per
prompt. An image is a file path, a ``file://`` URL, a ``data:`` URL or base64 (:mod:`miles.data.images`).
The prompt's ids hold each image's placeholder (Qwen2-VL's ``<|image_pad|>``) either once (SGLang's form,
expanded here to the image's token count) or already expanded (:func:`miles.data.vision.expand_placeholders`).

Each image is run through the model's own image processor (dynamic resolution, ``image_grid_thw``) and
hashed (XXH3-128 of its pixel values and grid). The prompt gets:

- multimodal rotary positions (M-RoPE) from the model's own ``get_rope_index``, and the offset of every
  later position (``rope_delta``: decode step ``p`` is at rotary position ``p + rope_delta``);
- a cache key: the prompt's ids with each placeholder token replaced by a negative number drawn from its
  image's hash, so the prefix cache shares KV between prompts only where their images are equal too
  (token ids are never negative, so an image's key never equals a text token);
- its vision embeddings, computed by the vision tower on the prompt's first prefill that needs them and
  scattered over the placeholder positions of each prefill chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from miles.data.images import MAX_IMAGE_PIXELS, ImageError, load_image
from miles.data.vision import expand_placeholders, process_images

__all__ = ["VISION_MODEL_TYPES", "ImageInputs", "ImageParser", "image_lists", "module_name", "place_images"]

VISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
"""Vision-language models the local engine serves (transformers' classes, their own vision tower)."""


@dataclass
class ImageInputs:
    """The images of one prompt, ready for prefill."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    hashes: list[str]
    """Each image's content hash (hex)."""
    placeholders: torch.Tensor
    """Prompt positions of the placeholder tokens, in order (int64)."""
    rope: torch.Tensor
    """``[3, prompt_len]`` M-RoPE positions of the prompt."""
    rope_delta: int
    key_ids: list[int]
    """The prompt's prefix-cache key (placeholders replaced by their image's hash)."""
    embeds: torch.Tensor | None = None
    """``[placeholders, hidden]`` vision embeddings (once encoded)."""
    weights: int = -1
    """The runner's :attr:`~miles.engine.model_runner.ModelRunner.weights_generation` the embeddings were
    encoded under (new weights: encoded again on the next prefill, a retracted request's included)."""

    def rope_positions(self, start: int, end: int) -> torch.Tensor:
        """``[3, end - start]`` rotary positions of sequence positions ``start..end`` (output tokens too)."""
        length = self.rope.shape[1]
        parts = []
        if start < length:
            parts.append(self.rope[:, start : min(end, length)])
        if end > length:
            tail = torch.arange(max(start, length), end, dtype=torch.long) + self.rope_delta
            parts.append(tail[None].expand(3, -1))
        return torch.cat(parts, dim=1)

    def chunk_embeds(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The placeholder positions of ``start..end`` (relative to ``start``) and their embeddings (``None``: the
        chunk has no placeholder, e.g. the text after an image whose KV came from the cache)."""
        inside = (self.placeholders >= start) & (self.placeholders < end)
        if not bool(inside.any()):
            return None
        if self.embeds is None:
            raise RuntimeError("vision embeddings are needed before they were encoded")
        return self.placeholders[inside] - start, self.embeds[inside]

    def needs_encoding(self, start: int, weights: int) -> bool:
        """Whether a prefill from ``start`` feeds a placeholder and the embeddings of the current weights
        (generation ``weights``) are not there yet."""
        return (self.embeds is None or self.weights != weights) and bool((self.placeholders >= start).any())


def module_name(name: str) -> str:
    """A Qwen2-VL tensor's name in the loaded model, from its name in a checkpoint ``save_pretrained`` wrote
    (transformers keeps the original layout there: ``visual.*`` and ``model.layers.*`` for the model's
    ``model.visual.*`` and ``model.language_model.layers.*``); other names are returned as they are."""
    if name.startswith("visual."):
        return "model." + name
    if name.startswith("model.") and not name.startswith(("model.language_model.", "model.visual.")):
        return "model.language_model." + name.removeprefix("model.")
    return name


def place_images(
    x: torch.Tensor, positions: torch.Tensor, starts: list[int], lengths: list[int], images: list[ImageInputs | None]
) -> torch.Tensor:
    """Put the vision embeddings of prefill chunk ``b`` (``lengths[b]`` tokens from ``starts[b]``) into the
    token embeddings ``x`` ``[B, T, hidden]`` (in place); return the rotary positions ``[3, B, T]``: each
    chunk's M-RoPE positions, the plain ``positions`` ``[B, T]`` where a chunk has no images."""
    rotary = positions[None].expand(3, -1, -1).clone()
    for b, inputs in enumerate(images):
        if inputs is None:
            continue
        start, n = starts[b], lengths[b]
        rotary[:, b, :n] = inputs.rope_positions(start, start + n).to(x.device)
        found = inputs.chunk_embeds(start, start + n)
        if found is not None:
            x[b, found[0].to(x.device)] = found[1].to(x.device, x.dtype)
    return rotary


def image_lists(image_data: Any, count: int, batched: bool) -> list[list[Any]]:
    """SGLang's ``image_data`` shapes as one list of images per prompt (``ValueError`` on a bad shape)."""
    if image_data is None or image_data == []:
        return [[] for _ in range(count)]
    if not batched:
        return [list(image_data) if isinstance(image_data, list) else [image_data]]
    if not isinstance(image_data, list) or len(image_data) != count:
        raise ValueError(f"image_data: a batch of {count} prompts needs a list with one entry per prompt")
    return [[] if entry is None else list(entry) if isinstance(entry, list) else [entry] for entry in image_data]


def _key(digest: str) -> int:
    return -1 - (int(digest[:16], 16) & ((1 << 62) - 1))


class ImageParser:
    """Turns a prompt's ids and images into expanded ids and :class:`ImageInputs` (HTTP thread)."""

    def __init__(
        self, model: torch.nn.Module, image_processor: Any, *, max_image_pixels: int = MAX_IMAGE_PIXELS
    ) -> None:
        """:param model: the served model (its config and its ``model.get_rope_index`` are used, not its
        weights: this runs on the HTTP thread)."""
        config: Any = model.config
        inner: Any = model.model
        self.rope_index: Callable[..., tuple[torch.Tensor, torch.Tensor]] = inner.get_rope_index
        self.processor = image_processor
        self.image_token_id = int(config.image_token_id)
        self.video_token_id = int(getattr(config, "video_token_id", -1) or -1)
        self.merge_size = int(config.vision_config.spatial_merge_size)
        self.max_image_pixels = max_image_pixels

    def __call__(self, refs: list[Any], ids: list[int], where: str) -> tuple[list[int], ImageInputs | None]:
        """``ids`` expanded for ``refs`` and their inputs (``None`` without images); ``ValueError`` naming
        ``where`` (``image_data[i][j]`` for an image)."""
        import xxhash

        if self.video_token_id in ids:
            raise ValueError(f"{where}: video placeholders are not supported by the local engine")
        if not refs:
            if self.image_token_id in ids:
                raise ValueError(f"{where}: the prompt holds an image placeholder but image_data gives no image")
            return ids, None
        images = []
        for j, ref in enumerate(refs):
            try:
                images.append(load_image(ref, max_pixels=self.max_image_pixels))
            except ImageError as exc:
                raise ValueError(f"image_data for {where}, image {j}: {exc}") from None
        vision = process_images(self.processor, images)
        ids = expand_placeholders(ids, vision.token_counts(self.merge_size), self.image_token_id, what=where)
        hashes, key_of, offset = [], [], 0
        for t, h, w in vision.image_grid_thw.tolist():
            patches = vision.pixel_values[offset : offset + t * h * w]
            offset += t * h * w
            digest = xxhash.xxh3_128(patches.contiguous().numpy().tobytes() + bytes(f"{t},{h},{w}", "ascii"))
            hashes.append(digest.hexdigest())
            key_of.append(_key(digest.hexdigest()))
        ids_t = torch.tensor([ids], dtype=torch.long)
        is_image = ids_t == self.image_token_id
        rope, delta = self.rope_index(
            ids_t, mm_token_type_ids=is_image.to(torch.int32), image_grid_thw=vision.image_grid_thw
        )
        placeholders = is_image[0].nonzero()[:, 0]
        key_ids = list(ids)
        counts = vision.token_counts(self.merge_size)
        position = 0
        for image, count in enumerate(counts):
            for p in placeholders[position : position + count].tolist():
                key_ids[p] = key_of[image]
            position += count
        return ids, ImageInputs(
            pixel_values=vision.pixel_values,
            grid_thw=vision.image_grid_thw,
            hashes=hashes,
            placeholders=placeholders,
            rope=rope[:, 0].clone(),
            rope_delta=int(delta.reshape(-1)[0]),
            key_ids=key_ids,
        )
