"""A tiny vision-language model without a hub: transformers' Qwen2-VL with a small text and vision config,
random weights, the in-process BPE tokenizer of :mod:`miles.testing.models` with Qwen2-VL's vision tokens
and a chat template that places images, and Qwen2-VL's image processor (Pillow backend), all saved as one
HF directory that ``AutoModelForImageTextToText``, ``AutoTokenizer`` and ``AutoImageProcessor`` load.

Also images for tests and examples: :func:`squares_image` draws coloured squares on a canvas (the
"how many red squares?" task).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from PIL.Image import Image
    from transformers import PreTrainedTokenizerFast

    from miles.data.sources import JsonlDataSource

__all__ = [
    "VISION_TOKENS",
    "VL_CHAT_TEMPLATE",
    "build_tiny_vlm",
    "build_vl_tokenizer",
    "squares_image",
    "vlm_jsonl_source",
    "write_squares_task",
]

VLArch = Literal["qwen2_vl", "qwen2_5_vl"]
"""The vision-language families :func:`build_tiny_vlm` builds."""

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""Qwen2-VL's vision special tokens (appended to the tokenizer's vocabulary in this order)."""

VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML whose content parts may be images: one ``<|vision_start|><|image_pad|><|vision_end|>`` each (Qwen2-VL's)."""


def build_vl_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """:func:`miles.testing.models.build_tokenizer` with :data:`VISION_TOKENS` and :data:`VL_CHAT_TEMPLATE`."""
    from miles.testing.models import build_tokenizer

    tokenizer = build_tokenizer(vocab_size)
    tokenizer.add_tokens(list(VISION_TOKENS), special_tokens=True)
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    return tokenizer


def _mrope_section(head_dim: int) -> list[int]:
    """M-RoPE's temporal / height / width split of a head's rotary pairs (Qwen2-VL's 16/24/24 of 64, scaled)."""
    pairs = head_dim // 2
    third = pairs * 3 // 8
    return [pairs - 2 * third, third, third]


def tiny_vl_config(
    tokenizer: PreTrainedTokenizerFast, *, arch: VLArch = "qwen2_vl", hidden_size: int = 64, num_layers: int = 2
) -> Any:
    """A Qwen2-VL (or Qwen2.5-VL) config: a 2-layer text model (4 heads of ``hidden_size / 4``, 2 KV heads,
    M-RoPE sections 2/3/3 for heads of 16) and a 2-block vision tower (14-pixel patches, 2x2 merge) whose merger outputs the text width
    (Qwen2.5-VL: windowed attention in the first block, full in the second)."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in VISION_TOKENS}
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=2 * hidden_size,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": _mrope_section(hidden_size // 4),
        },
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    vision: dict[str, Any] = dict(
        depth=2, embed_dim=32, hidden_size=hidden_size, num_heads=2, mlp_ratio=2, patch_size=14
    )
    if arch == "qwen2_5_vl":
        vision = dict(
            depth=2,
            hidden_size=32,
            out_hidden_size=hidden_size,
            intermediate_size=64,
            num_heads=2,
            patch_size=14,
            window_size=56,
            fullatt_block_indexes=[1],
        )
    config_class = Qwen2_5_VLConfig if arch == "qwen2_5_vl" else Qwen2VLConfig
    return config_class(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )


def build_tiny_vlm(
    path: str | os.PathLike[str],
    *,
    arch: VLArch = "qwen2_vl",
    seed: int = 0,
    dtype: str = "float32",
    min_pixels: int = 28 * 28,
    max_pixels: int = 112 * 112,
    hidden_size: int = 64,
) -> Path:
    """Build a random tiny Qwen2-VL (``arch``: or Qwen2.5-VL) with its tokenizer and image processor; save them
    under ``path``.

    Deterministic given ``seed``. Images are resized to between ``min_pixels`` and ``max_pixels`` (a 56x56
    image is a 4x4 patch grid: 4 placeholder tokens). ``hidden_size`` 128 gives heads of 32 (what SGLang's CPU
    attention kernels need). Returns the directory.
    """
    import torch
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_vl_tokenizer()
    config = tiny_vl_config(tokenizer, arch=arch, hidden_size=hidden_size)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config).to(getattr(torch, dtype))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels).save_pretrained(out)
    return out


_COLOURS = {"red": (220, 30, 30), "blue": (30, 60, 220), "green": (30, 180, 60)}


def squares_image(
    counts: dict[str, int],
    *,
    size: int = 56,
    square: int = 8,
    seed: int = 0,
    background: tuple[int, int, int] = (255,) * 3,
) -> Image:
    """A ``size`` x ``size`` RGB image with ``counts[colour]`` non-overlapping squares of each colour
    (``red``, ``blue``, ``green``), placed on a grid in an order drawn from ``seed``."""
    import random

    from PIL import Image as PILImage
    from PIL import ImageDraw

    cells = [(x, y) for y in range(0, size - square + 1, square + 2) for x in range(0, size - square + 1, square + 2)]
    wanted = [colour for colour, n in counts.items() for _ in range(n)]
    if len(wanted) > len(cells):
        raise ValueError(f"{len(wanted)} squares do not fit a {size}x{size} image with {square}-pixel squares")
    random.Random(seed).shuffle(cells)
    image = PILImage.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(image)
    for (x, y), colour in zip(cells, wanted, strict=False):
        draw.rectangle((x, y, x + square - 1, y + square - 1), fill=_COLOURS[colour])
    return image


def write_squares_task(out: str | os.PathLike[str], rows: int, *, seed: int = 0, size: int = 56) -> Path:
    """The "how many red squares?" task: ``rows`` PNG images with 0-3 red and 0-2 blue squares under
    ``out/images/`` and ``out/train.jsonl``, one row each (``prompt``, ``images`` relative to the file,
    ``label`` the red count). Deterministic given ``seed``; returns the JSONL file."""
    import json
    import random

    root = Path(out)
    (root / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines = []
    for i in range(rows):
        red, blue = rng.randint(0, 3), rng.randint(0, 2)
        name = f"images/{i:05d}.png"
        squares_image({"red": red, "blue": blue}, size=size, seed=seed * 100_003 + i).save(root / name)
        question = "How many red squares are in the image? Answer with a number."
        lines.append(json.dumps({"prompt": question, "images": [name], "label": str(red)}))
    path = root / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def vlm_jsonl_source(model: str | os.PathLike[str], path: str | os.PathLike[str], **data: Any) -> JsonlDataSource:
    """The ``jsonl`` data source of the rows at ``path`` for the VLM in ``model``, in file order (``data``: more
    ``DataSettings`` fields), as a run builds it: images rendered and expanded through the model's template."""
    import functools

    from transformers import AutoTokenizer

    from miles.components import ComponentSettings
    from miles.data.factory import create_data_source
    from miles.data.sources import JsonlDataSource
    from miles.settings.model import DataSettings

    settings = DataSettings(path=str(path), shuffle=False, **data)
    source = create_data_source(
        functools.partial(JsonlDataSource, ComponentSettings()),
        settings,
        tokenizer=AutoTokenizer.from_pretrained(model),
        model_path=str(model),
    )
    assert isinstance(source, JsonlDataSource)
    return source
