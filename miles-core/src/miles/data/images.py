"""Images of vision-language prompts: where they come from, how they are read, and what is refused.

An image reference is what a data row or a ``/generate`` body holds: a file path, a ``file://`` URL, a
``data:image/...;base64,`` URL or bare base64 (SGLang's ``image_data`` forms, less remote URLs: nothing is
fetched from the network). :func:`load_image` reads one into an RGB ``PIL.Image`` and refuses, with a
:class:`ImageError` that says why, a missing file, bytes that do not decode as an image, and an image with
more pixels than allowed (checked from the header, before the pixels are decoded). Pillow is an optional
dependency (``pip install 'miles-core[vision]'``), imported only here.
"""

from __future__ import annotations

import base64
import binascii
import os
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from miles.components import Requirement

if TYPE_CHECKING:
    from PIL.Image import Image

__all__ = ["MAX_IMAGE_PIXELS", "PILLOW", "ImageError", "image_bytes", "load_image", "to_data_url"]

PILLOW = Requirement("PIL", extra="vision")
"""What images are read with."""

MAX_IMAGE_PIXELS = 4096 * 4096
"""Default bound on an image's width x height before it is decoded (a decompression bomb is refused)."""


class ImageError(ValueError):
    """An image that cannot be used; the message says why (the caller adds the row and field)."""


def _pil() -> Any:
    try:
        import PIL.Image
    except ImportError:
        raise ImageError(f"reading images needs the {PILLOW.module!r} package (Pillow): {PILLOW.install}") from None
    return PIL.Image


def _short(ref: str) -> str:
    return ref if len(ref) <= 60 else ref[:40] + "..." + f" ({len(ref)} characters)"


def image_bytes(ref: Any, *, base_dir: str | None = None) -> bytes:
    """The encoded bytes an image reference points at (a path or ``file://`` URL is read; base64 decoded).

    :param base_dir: where a relative path is resolved (a data file's directory); default: the working
        directory.
    """
    if isinstance(ref, bytes):
        return ref
    if not isinstance(ref, str) or not ref:
        raise ImageError(f"expected a path, a file:// URL or base64 image data, got {type(ref).__name__}")
    if ref.startswith("data:"):
        head, _, data = ref.partition(",")
        if ";base64" not in head:
            raise ImageError(f"{_short(ref)}: a data URL must be base64 encoded (data:image/png;base64,...)")
        return _b64(data, ref)
    if ref.startswith(("http://", "https://")):
        raise ImageError(f"{_short(ref)}: remote URLs are not fetched; give a local path or base64 data")
    path = unquote(urlparse(ref).path) if ref.startswith("file://") else ref
    if base_dir is not None and not os.path.isabs(path):
        path = os.path.join(base_dir, path)
    if os.path.isfile(path):
        with open(path, "rb") as fh:
            return fh.read()
    if not ref.startswith("file://") and len(ref) > 64:  # not a file: bare base64, if it decodes
        return _b64(ref, ref)
    raise ImageError(f"{_short(ref)}: no such image file")


def _b64(data: str, ref: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{_short(ref)}: neither an existing file nor valid base64") from None


def load_image(ref: Any, *, max_pixels: int = MAX_IMAGE_PIXELS, base_dir: str | None = None) -> Image:
    """An image reference read and decoded as RGB; :class:`ImageError` when it cannot be used.

    :param max_pixels: the most pixels (width x height) an image may have, checked before decoding.
    """
    pil = _pil()
    if isinstance(ref, pil.Image):
        image = ref
    else:
        import io

        data = image_bytes(ref, base_dir=base_dir)
        try:
            image = pil.open(io.BytesIO(data))
        except Exception as exc:  # Pillow raises UnidentifiedImageError, OSError, DecompressionBombError ...
            raise ImageError(f"{_short(str(ref))}: not a decodable image ({type(exc).__name__})") from None
    width, height = image.size
    if width * height > max_pixels:
        raise ImageError(
            f"{_short(str(ref))}: {width}x{height} = {width * height} pixels, more than the {max_pixels} allowed"
        )
    if width < 1 or height < 1:
        raise ImageError(f"{_short(str(ref))}: empty image ({width}x{height})")
    try:
        return image.convert("RGB")
    except Exception as exc:  # truncated data fails here, when the pixels are decoded
        raise ImageError(f"{_short(str(ref))}: not a decodable image ({exc})") from None


def to_data_url(data: bytes) -> str:
    """Encoded image bytes as a ``data:`` URL (what travels to an engine on another host)."""
    return "data:image;base64," + base64.b64encode(data).decode("ascii")
