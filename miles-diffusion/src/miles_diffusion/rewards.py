"""Image rewards: cheap, honest ones that need no model.

- ``jpeg_compressibility`` / ``jpeg_incompressibility``: the size of the image as a JPEG, in kB, negated
  or not (DDPO's compressibility tasks, Black et al. 2023: quality 95);
- ``brightness``: mean luminance in [0, 1] (a smooth target that small policies learn fast);
- ``color_match``: how close the image's pixels are to the colour the sample's label names (a prompt-image
  alignment score that is exact without a vision model: prompts "a red square", labels "red").

Each reads the PNG that the ``diffusion`` rollout function put in ``Sample.metadata["image"]``. A text-image
model score (CLIP, PickScore) needs weights that no registry package this project may install ships; it
is a plugin away (``miles_register_rewards``) where such weights are at hand.
"""

from __future__ import annotations

import base64
import io
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field

from miles.components import ComponentSettings
from miles.errors import SettingsError
from miles.rewards.base import Reward, RewardOutput

if TYPE_CHECKING:
    import numpy as np

    from miles.types import Sample

__all__ = [
    "COLORS",
    "BrightnessReward",
    "ColorMatchReward",
    "JpegCompressibilityReward",
    "JpegIncompressibilityReward",
    "JpegSettings",
    "sample_image",
]

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "white": (255, 255, 255),
    "black": (0, 0, 0),
    "yellow": (255, 255, 0),
}
"""Colour names a ``color_match`` label may use (or give ``[r, g, b]``)."""


def sample_image(sample: Sample) -> np.ndarray:
    """The sample's image as ``[H, W, 3]`` uint8 (from ``metadata["image"]``, a base64 PNG)."""
    import numpy as np
    from PIL import Image

    data = sample.metadata.get("image")
    if not isinstance(data, str):
        raise SettingsError(
            f"sample {sample.group_id}/{sample.index} has no image (metadata['image']); "
            'image rewards need rollout.function = "diffusion"'
        )
    with Image.open(io.BytesIO(base64.b64decode(data))) as image:
        return np.asarray(image.convert("RGB"))


def jpeg_kilobytes(image: np.ndarray, quality: int) -> float:
    """Size of ``image`` encoded as a JPEG of ``quality``, in kB."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=quality)
    return buffer.tell() / 1000.0


class JpegSettings(ComponentSettings):
    """Settings of the JPEG rewards."""

    quality: int = Field(95, ge=1, le=100)
    """JPEG quality the image is encoded with (DDPO: 95)."""


class JpegCompressibilityReward(Reward[JpegSettings]):
    """Minus the JPEG size in kB: smaller (simpler, smoother) images score higher (DDPO)."""

    name = "jpeg_compressibility"
    sign: ClassVar[float] = -1.0

    async def score(self, sample: Sample) -> float | RewardOutput:
        return self.sign * jpeg_kilobytes(sample_image(sample), self.settings.quality)


class JpegIncompressibilityReward(JpegCompressibilityReward):
    """The JPEG size in kB: detailed, high-frequency images score higher (DDPO)."""

    name = "jpeg_incompressibility"
    sign: ClassVar[float] = 1.0


class BrightnessReward(Reward[ComponentSettings]):
    """Mean luminance (ITU-R BT.601 weights) in [0, 1]."""

    name = "brightness"

    async def score(self, sample: Sample) -> float | RewardOutput:
        pixels = sample_image(sample).astype("float64") / 255.0
        return float((pixels @ [0.299, 0.587, 0.114]).mean())


class ColorMatchReward(Reward[ComponentSettings]):
    """``1 - mean |pixel - target| / 255`` in [0, 1], the target colour from the sample's label (a name of
    :data:`COLORS` or ``[r, g, b]``)."""

    name = "color_match"

    @staticmethod
    def target(label: Any) -> tuple[int, int, int]:
        if isinstance(label, str) and label.lower() in COLORS:
            return COLORS[label.lower()]
        if (
            isinstance(label, (list, tuple))
            and len(label) == 3
            and all(isinstance(v, int) and 0 <= v <= 255 for v in label)
        ):
            return (int(label[0]), int(label[1]), int(label[2]))
        raise ValueError(f"color_match: label {label!r} is neither a colour name ({', '.join(COLORS)}) nor [r, g, b]")

    async def score(self, sample: Sample) -> float | RewardOutput:
        import numpy as np

        target = np.asarray(self.target(sample.label), dtype="float64")
        image: Any = sample_image(sample).astype("float64")
        return float(1.0 - np.abs(image - target).mean() / 255.0)


REWARDS: tuple[type[Reward[Any]], ...] = (
    JpegCompressibilityReward,
    JpegIncompressibilityReward,
    BrightnessReward,
    ColorMatchReward,
)
"""Registered by the ``diffusion`` plugin."""
