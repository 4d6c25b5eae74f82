"""Images in a session: OpenAI's ``image_url`` content parts of user messages, for a vision-language policy.

A user message's content may hold ``{"type": "image_url", "image_url": {"url": ref}}`` parts, ``ref`` a
``data:image/...;base64,`` URL, a file path or a ``file://`` URL (:func:`miles.data.images.image_bytes`;
remote URLs are not fetched). Each part is read to its bytes when the request arrives and becomes, in the
session's template form, ``{"type": "image", "sha256": digest}``: the chat template writes the image's
placeholder there (Qwen2-VL's ``<|vision_start|><|image_pad|><|vision_end|>``) and the digest makes a
request that repeats the history with another image a different message (a branch, never the stored KV).

The images of a request's *new* messages are decoded and run through the policy's image processor (a
missing file, undecodable bytes or too many pixels is a 400 naming ``messages[i].content[j].image_url.url``),
and each placeholder the template wrote is expanded to the image's token count: the session's record holds
the tokens the engine consumes, as a data prompt's ids do (:mod:`miles.data.vision`). Each engine request
sends SGLang's form: one placeholder per image (:func:`~miles.data.vision.collapse_placeholders`) and every
image of the conversation so far as ``image_data``, in placeholder order.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from miles.data.images import MAX_IMAGE_PIXELS, ImageError, image_bytes, load_image, to_data_url
from miles.data.vision import collapse_placeholders, expand_placeholders, process_images
from miles.errors import SettingsError
from miles.sessions.messages import Message, images_of
from miles.sessions.schema import RequestError
from miles.sessions.templates import ChatRenderer, TemplateRenderError

__all__ = ["PartImage", "SessionVision", "read_image_parts"]


@dataclass(frozen=True)
class PartImage:
    """One image content part of a request."""

    message: int
    """Index of its message in the request."""
    part: int
    """Index of the part in the message's content."""
    data: bytes
    """The encoded image."""
    digest: str
    """SHA-256 of :attr:`data` (hex): the image's identity in the session."""

    @property
    def where(self) -> str:
        return f"messages[{self.message}].content[{self.part}].image_url.url"


def read_image_parts(messages: Sequence[Message]) -> tuple[list[Message], list[PartImage]]:
    """``messages`` (OpenAI's shape, validated) with each image part as ``{"type": "image", "sha256": ...}``,
    and the images in order; a :class:`RequestError` naming the part when one cannot be read."""
    out: list[Message] = []
    images: list[PartImage] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list) or not any(p.get("type") == "image_url" for p in content):
            out.append(message)
            continue
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            if part.get("type") != "image_url":
                parts.append(part)
                continue
            where = f"messages[{i}].content[{j}].image_url.url"
            try:
                data = image_bytes(part["image_url"]["url"])
            except ImageError as exc:
                raise RequestError(f"{where}: {exc}", param=where) from None
            image = PartImage(i, j, data, hashlib.sha256(data).hexdigest())
            images.append(image)
            parts.append({"type": "image", "sha256": image.digest})
        out.append({**message, "content": parts})
    return out, images


class SessionVision:
    """What a session needs of a vision-language policy: its image processor and placeholder token.

    :param image_processor: the policy's (:func:`miles.data.vision.load_image_processor`).
    :param image_token_id: the placeholder token of an image (Qwen2-VL: ``<|image_pad|>``).
    :param max_image_pixels: larger images are refused (before decoding).
    """

    def __init__(self, image_processor: Any, image_token_id: int, *, max_image_pixels: int = MAX_IMAGE_PIXELS) -> None:
        self.processor = image_processor
        self.image_token_id = image_token_id
        self.merge_size = int(getattr(image_processor, "merge_size", 1))
        self.max_image_pixels = max_image_pixels
        self._counts: OrderedDict[str, int] = OrderedDict()
        """Token counts of recent images, by digest."""

    @classmethod
    def for_model(
        cls, model_path: str | os.PathLike[str], *, max_image_pixels: int = MAX_IMAGE_PIXELS
    ) -> SessionVision:
        from miles.data.vision import image_token_id, load_image_processor

        return cls(load_image_processor(model_path), image_token_id(model_path), max_image_pixels=max_image_pixels)

    def token_counts(self, images: Sequence[PartImage]) -> list[int]:
        """Placeholder tokens of each image; a :class:`RequestError` naming the part of one that cannot be used."""
        counts = []
        for image in images:
            count = self._counts.get(image.digest)
            if count is None:
                try:
                    decoded = load_image(image.data, max_pixels=self.max_image_pixels)
                except ImageError as exc:
                    raise RequestError(f"{image.where}: {exc}", param=image.where) from None
                count = process_images(self.processor, [decoded]).token_counts(self.merge_size)[0]
                self._counts[image.digest] = count
                if len(self._counts) > 4096:
                    self._counts.popitem(last=False)
            else:
                self._counts.move_to_end(image.digest)
            counts.append(count)
        return counts

    def expand(self, ids: list[int], images: Sequence[PartImage], *, first_new: int) -> list[int]:
        """``ids`` (the template's tokens of the new messages) with each image's placeholder expanded; a
        :class:`RequestError` when the template did not write one placeholder per image."""
        counts = self.token_counts(images)  # (its own RequestError names the image)
        try:
            return expand_placeholders(ids, counts, self.image_token_id, what="messages")
        except ValueError as exc:
            where = f"messages[{first_new}:]"
            raise RequestError(
                f"{where}: the chat template's rendering of the new messages does not place their images: {exc} "
                "(a template that writes one image placeholder per image part is needed; a user message's text "
                "must not hold the placeholder token itself)",
                param=where,
            ) from None

    def engine_prompt(self, prompt: list[int], images: int) -> list[int]:
        """``prompt`` in SGLang's form (one placeholder per image); a 409 when it then holds other than
        ``images`` placeholders (the policy sampled the placeholder token into an earlier reply, which no
        engine can be sent back as text)."""
        collapsed = collapse_placeholders(prompt, self.image_token_id)
        found = sum(1 for t in collapsed if t == self.image_token_id)
        if found != images:
            raise RequestError(
                f"the conversation holds {found} image placeholder(s) for {images} image(s): an earlier reply of "
                "the model contains the image placeholder token, which cannot be sent to the engine again; "
                "end the episode",
                status=409,
                param="messages",
                kind="image_placeholder_in_reply",
            )
        return collapsed

    def check_template(self, renderer: ChatRenderer) -> None:
        """Refuse, naming ``rollout.sessions.chat_template``, a template that does not write one placeholder per
        image part (a text template would drop the images silently)."""
        from miles.sessions.append_only import IMAGE_PROBES

        for probe in IMAGE_PROBES:
            messages = [m for turn in probe.turns for m in turn]
            parts = sum(len(images_of(m)) for m in messages)
            try:
                ids = renderer.ids(messages)
            except TemplateRenderError as exc:
                raise SettingsError(f"rollout.sessions.chat_template: {exc}") from None
            found = sum(1 for t in collapse_placeholders(ids, self.image_token_id) if t == self.image_token_id)
            if found != parts:
                raise SettingsError(
                    f"rollout.sessions.chat_template: {renderer.name} writes {found} image placeholder(s) for the "
                    f"{parts} image parts of the probe {probe.name!r}; a vision-language policy needs a template "
                    "that writes one per image ({'type': 'image'} content parts)"
                )

    @staticmethod
    def data_url(image: PartImage) -> str:
        return to_data_url(image.data)
