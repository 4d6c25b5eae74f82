"""Vision-language prompts: images beside the prompt, rendered through the model's own chat template and
image processor into the exact token ids the engine and the trainer see.

A row carries its images under ``data.image_key`` (``"images"``: a list of references, see
:mod:`miles.data.images`), and a prompt that is either text (the images go first in the user message) or
chat messages whose content parts mark where each image goes (``{"type": "image"}``, taking the next image
of the list, or an inline ``{"type": "image", "image": ref}`` / OpenAI ``{"type": "image_url",
"image_url": {"url": ref}}``). The chat template writes one placeholder token per image (Qwen2-VL's
``<|vision_start|><|image_pad|><|vision_end|>``); the image processor resizes each image to its dynamic
resolution and gives its patch grid (``image_grid_thw``); each placeholder is then expanded to the number of
tokens the vision tower will put there (``t * h * w / merge_size**2``), exactly as the model's processor does
it, and as SGLang does it for pre-tokenised prompts. Every image is decoded once when the data is loaded, so
a missing, undecodable or oversized image fails the run before any engine starts, naming the row and field.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.data.base import Prompt
from miles.data.images import MAX_IMAGE_PIXELS, ImageError, load_image
from miles.data.pipeline import Messages, PromptPipeline
from miles.errors import DataError

if TYPE_CHECKING:
    import torch
    from PIL.Image import Image
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "IMAGES",
    "IMAGE_TOKEN",
    "VisionInputs",
    "VisionPromptPipeline",
    "check_row_images",
    "collapse_placeholders",
    "expand_placeholders",
    "image_token_id",
    "is_vision_model",
    "load_image_processor",
    "load_images",
    "process_images",
    "render_images",
]

log = logging.getLogger(__name__)


IMAGES = "images"
"""The metadata key of a prompt's (and its samples') image references, in placeholder order."""
IMAGE_TOKEN = "image_token_id"
"""The metadata key of the placeholder token of those images (what an engine request collapses)."""


def is_vision_model(model_path: str | os.PathLike[str]) -> bool:
    """Whether the checkpoint's config has a vision tower (a ``vision_config``)."""
    import json

    config = Path(model_path) / "config.json"
    return config.is_file() and "vision_config" in json.loads(config.read_text())


def image_token_id(model_path: str | os.PathLike[str]) -> int:
    """The checkpoint's image placeholder token (``image_token_id`` of its config)."""
    import json

    config = json.loads((Path(model_path) / "config.json").read_text())
    return int(config["image_token_id"])


def load_image_processor(model_path: str | os.PathLike[str]) -> Any:
    """The checkpoint's image processor (Pillow backend: it needs neither torchvision nor a GPU)."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(str(model_path), backend="pil")


@dataclass
class VisionInputs:
    """What the vision tower takes for a prompt's images, in the order of their placeholders."""

    pixel_values: torch.Tensor
    """``[patches, channels x temporal_patch x patch x patch]``, all images concatenated."""
    image_grid_thw: torch.Tensor
    """``[images, 3]`` int64: each image's patch grid (temporal, height, width)."""

    def token_counts(self, merge_size: int) -> list[int]:
        """Placeholder tokens each image expands to."""
        return [int(n) // merge_size**2 for n in self.image_grid_thw.prod(-1).tolist()]


def process_images(processor: Any, images: Sequence[Image]) -> VisionInputs:
    """``images`` through the image processor (dynamic resolution within its ``min/max_pixels``)."""
    import torch

    out = processor(images=list(images), return_tensors="pt")
    return VisionInputs(out["pixel_values"], torch.as_tensor(out["image_grid_thw"], dtype=torch.long))


def expand_placeholders(ids: Sequence[int], counts: Sequence[int], token_id: int, *, what: str) -> list[int]:
    """``ids`` with image ``i``'s placeholder run made ``counts[i]`` tokens long.

    A run of one token is expanded (SGLang's form: one placeholder per image); a run already ``counts[i]``
    long is kept. Anything else — more or fewer runs than images, a run of another length — is a
    :class:`ValueError` naming ``what`` and the image.
    """
    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(ids):
        if ids[i] == token_id:
            j = i
            while j < len(ids) and ids[j] == token_id:
                j += 1
            runs.append((i, j))
            i = j
        else:
            i += 1
    if len(runs) != len(counts):
        raise ValueError(f"{what}: {len(runs)} image placeholder(s) for {len(counts)} image(s)")
    out: list[int] = []
    last = 0
    for k, ((start, end), count) in enumerate(zip(runs, counts, strict=True)):
        if end - start not in (1, count):
            raise ValueError(
                f"{what}: image {k}'s placeholder run has {end - start} tokens; "
                f"expected 1 (expanded here) or {count} (its patch grid)"
            )
        out.extend(ids[last:start])
        out.extend([token_id] * count)
        last = end
    out.extend(ids[last:])
    return out


def collapse_placeholders(ids: Sequence[int], token_id: int) -> list[int]:
    """``ids`` with each run of image placeholders made one token: SGLang's form of a pre-tokenised image
    prompt, which its engines (and the local engine) expand again by the image's grid."""
    return [t for i, t in enumerate(ids) if t != token_id or i == 0 or ids[i - 1] != token_id]


def _part_ref(part: dict[str, Any]) -> Any:
    """An inline image reference of a content part (``None``: a bare ``{"type": "image"}`` marker)."""
    if part.get("type") == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    return part.get("image")


def render_images(prompt: Prompt, messages: Messages, image_key: str) -> tuple[Messages, list[Any]]:
    """``messages`` (the prompt's conversation) with one ``{"type": "image"}`` part per image, and the image
    references in placeholder order; a :class:`DataError` naming the row and field when they do not add up."""
    where, key = prompt.source, image_key
    listed = prompt.metadata.get(key, [])
    if isinstance(listed, str):
        listed = [listed]
    if not isinstance(listed, list):
        raise DataError(f"{where}: key {key!r} must be a list of images, got {type(listed).__name__}")
    queue, refs = list(listed), []
    marked = False
    rendered: Messages = []
    for index, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") in ("image", "image_url"):
                    marked = True
                    ref = _part_ref(part)
                    if ref is None:
                        if not queue:
                            raise DataError(
                                f"{where}: message {index} has more image parts than the {len(listed)} "
                                f"image(s) of key {key!r}"
                            )
                        ref = queue.pop(0)
                    refs.append(ref)
                    parts.append({"type": "image"})
                else:
                    parts.append(part)
            message = {**message, "content": parts}
        rendered.append(message)
    if not marked and queue:  # images first in the (last) user message, as a text prompt's
        users = [i for i, m in enumerate(rendered) if m.get("role") == "user"]
        if not users:
            raise DataError(f"{where}: key {key!r} holds images but the prompt has no user message")
        target = rendered[users[-1]]
        text = target.get("content")
        text_parts = text if isinstance(text, list) else [{"type": "text", "text": text or ""}]
        rendered[users[-1]] = {**target, "content": [{"type": "image"} for _ in queue] + text_parts}
        refs, queue = list(queue), []
    if queue:
        raise DataError(f"{where}: key {key!r} has {len(listed)} image(s) but the messages place {len(refs)}")
    return rendered, refs


def load_images(
    refs: list[Any], *, where: str, image_key: str, base_dir: str | None, max_pixels: int = MAX_IMAGE_PIXELS
) -> list[Image]:
    """The images ``refs`` decoded; a :class:`DataError` naming the row (``where``), field and image."""
    images = []
    for i, ref in enumerate(refs):
        try:
            images.append(load_image(ref, max_pixels=max_pixels, base_dir=base_dir))
        except ImageError as exc:
            raise DataError(f"{where}: {image_key}[{i}]: {exc}") from None
    return images


def check_row_images(prompt: Prompt, *, image_key: str, base_dir: str | None, max_pixels: int) -> None:
    """What the pipeline checks of a row's images, without a tokenizer (a run's settings check, before any
    engine starts): they add up with the prompt's image parts and each decodes within ``max_pixels``."""
    messages = [{"role": "user", "content": prompt.prompt}] if isinstance(prompt.prompt, str) else list(prompt.prompt)
    _, refs = render_images(prompt, messages, image_key)
    load_images(refs, where=prompt.source, image_key=image_key, base_dir=base_dir, max_pixels=max_pixels)


class VisionPromptPipeline(PromptPipeline):
    """:class:`PromptPipeline` for a vision-language policy: renders each prompt with its images.

    :param image_processor: the policy's (:func:`load_image_processor`).
    :param image_token_id: the placeholder token of an image (Qwen2-VL: ``<|image_pad|>``).
    :param image_key: the row key holding the images (in :attr:`Prompt.metadata`).
    :param base_dir: where relative image paths are resolved (the data file's directory).
    :param max_image_pixels: larger images are refused (before decoding).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        image_processor: Any,
        image_token_id: int,
        image_key: str = "images",
        base_dir: str | None = None,
        max_image_pixels: int = MAX_IMAGE_PIXELS,
        **kwargs: Any,
    ) -> None:
        super().__init__(tokenizer, **kwargs)
        if not self.apply_chat_template:
            raise DataError("data.apply_chat_template: a vision-language policy's prompts need the chat template")
        self.image_processor = image_processor
        self.image_token_id = image_token_id
        self.image_key = image_key
        self.base_dir = base_dir
        self.max_image_pixels = max_image_pixels
        self.merge_size = int(getattr(image_processor, "merge_size", 1))

    def __call__(self, prompts: list[Prompt]) -> list[Prompt]:
        """Render, check and tokenise every prompt; ``metadata["images"]`` (:data:`IMAGES`) becomes the image
        references in placeholder order (relative paths resolved), ``metadata["image_grid_thw"]`` their
        grids and ``metadata["image_token_id"]`` (:data:`IMAGE_TOKEN`) the placeholder token."""
        kept: list[Prompt] = []
        self.dropped = 0
        for prompt in prompts:
            messages, refs = render_images(prompt, self.messages(prompt), self.image_key)
            images = load_images(
                refs,
                where=prompt.source,
                image_key=self.image_key,
                base_dir=self.base_dir,
                max_pixels=self.max_image_pixels,
            )
            try:
                ids = self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            except Exception as exc:
                raise DataError(f"{prompt.source}: chat template failed: {exc}") from exc
            if not isinstance(ids, list):
                ids = ids["input_ids"]
            ids = [int(t) for t in ids]
            metadata = dict(prompt.metadata)
            if images:
                vision = process_images(self.image_processor, images)
                try:
                    ids = expand_placeholders(
                        ids, vision.token_counts(self.merge_size), self.image_token_id, what=prompt.source
                    )
                except ValueError as exc:
                    raise DataError(f"{exc} (does the chat template write one placeholder per image?)") from None
                metadata["image_grid_thw"] = vision.image_grid_thw.tolist()
                metadata[IMAGE_TOKEN] = self.image_token_id
            elif self.image_token_id in ids:
                raise DataError(f"{prompt.source}: the prompt holds an image placeholder but no image")
            metadata.pop(self.image_key, None)
            metadata[IMAGES] = [self._resolved(ref) for ref in refs]
            if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
                self.dropped += 1
                continue
            kept.append(replace(prompt, metadata=metadata, prompt_ids=ids))
        if self.dropped:
            log.warning(
                "dropped %d of %d prompts longer than data.max_prompt_tokens=%d (image tokens included)",
                self.dropped,
                len(prompts),
                self.max_prompt_tokens,
            )
        return kept

    def _resolved(self, ref: Any) -> Any:
        """A relative path made absolute (engines and trainers may run elsewhere than the data's directory)."""
        if (
            isinstance(ref, str)
            and self.base_dir is not None
            and not ref.startswith(("data:", "file://"))
            and not os.path.isabs(ref)
            and os.path.isfile(os.path.join(self.base_dir, ref))
        ):
            return os.path.abspath(os.path.join(self.base_dir, ref))
        return ref
