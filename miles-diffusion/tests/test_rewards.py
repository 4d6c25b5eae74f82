from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest

from miles.components import ComponentSettings
from miles.errors import SettingsError
from miles.types import Sample
from miles_diffusion.rewards import (
    BrightnessReward,
    ColorMatchReward,
    JpegCompressibilityReward,
    JpegIncompressibilityReward,
    JpegSettings,
)
from miles_diffusion.sampling import png_bytes


def _sample(image: np.ndarray, label: object = None) -> Sample:
    return Sample([1], [0], [0.0], [1], label=label, metadata={"image": base64.b64encode(png_bytes(image)).decode()})


def _score(reward: object, sample: Sample) -> float:
    return float(asyncio.run(reward.score(sample)))  # type: ignore[attr-defined]


def test_jpeg_rewards_prefer_flat_or_detailed_images() -> None:
    flat = np.full((32, 32, 3), 128, dtype=np.uint8)
    noisy = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    small = JpegCompressibilityReward(JpegSettings())
    assert _score(small, _sample(flat)) > _score(small, _sample(noisy))
    assert _score(JpegIncompressibilityReward(JpegSettings()), _sample(noisy)) == pytest.approx(
        -_score(small, _sample(noisy))
    )


def test_brightness_and_colour_match() -> None:
    white = np.full((8, 8, 3), 255, dtype=np.uint8)
    red = np.zeros((8, 8, 3), dtype=np.uint8)
    red[..., 0] = 255
    bright = BrightnessReward(ComponentSettings())
    assert _score(bright, _sample(white)) == pytest.approx(1.0)
    assert _score(bright, _sample(red)) == pytest.approx(0.299)
    match = ColorMatchReward(ComponentSettings())
    assert _score(match, _sample(red, "red")) == pytest.approx(1.0)
    assert _score(match, _sample(red, [0, 0, 255])) == pytest.approx(1.0 / 3.0)
    with pytest.raises(ValueError, match="label 'mauve' is neither a colour name"):
        _score(match, _sample(red, "mauve"))
    with pytest.raises(SettingsError, match="has no image"):
        _score(bright, Sample([1]))
