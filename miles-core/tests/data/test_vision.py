"""Rows with images for a vision-language policy (a tiny Qwen2-VL built from a config): rendered through the
model's chat template and image processor into expanded placeholder tokens, whatever form the image takes
(relative path, ``file://`` URL, base64 data URL inline in the messages); bad images refused naming the row and
field — by the settings check, before any engine starts, and by the pipeline."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from miles.components import ComponentSettings
from miles.data.sources import JsonlDataSource
from miles.errors import DataError, SettingsError
from miles.settings.model import MilesSettings
from miles.testing.vlm import vlm_jsonl_source

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from miles.testing.vlm import build_tiny_vlm, squares_image

    root = tmp_path_factory.mktemp("vlm-data")
    model = build_tiny_vlm(root / "model")
    data = root / "data"
    data.mkdir()
    squares_image({"red": 2}).save(data / "red.png")
    squares_image({"blue": 1}, size=84).save(data / "blue.png")
    (data / "broken.png").write_bytes(b"GIF89a truncated")
    return {"model": model, "data": data}


def _write(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _source(vlm: dict[str, Any], path: str, **data: Any) -> JsonlDataSource:
    return vlm_jsonl_source(vlm["model"], path, **data)


def test_images_are_rendered_with_the_models_template_and_processor(vlm: dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    data = vlm["data"]
    inline = "data:image/png;base64," + base64.b64encode((data / "red.png").read_bytes()).decode()
    rows = [
        {"prompt": "how many red squares?", "images": ["red.png"], "label": 2},
        {
            "prompt": [{"role": "user", "content": [{"type": "text", "text": "and here?"}, {"type": "image"}]}],
            "images": [(data / "blue.png").as_uri()],
        },
        {"prompt": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": inline}}]}]},
        {"prompt": "no image"},
    ]
    red, blue, inline_red, text = _source(vlm, _write(data / "rows.jsonl", rows)).prompts
    tokenizer = AutoTokenizer.from_pretrained(vlm["model"])
    pads = "<|image_pad|>"
    # a 56x56 image is a 4x4 patch grid, 2x2-merged into 4 tokens; 84x84 is 6x6 -> 9
    assert tokenizer.decode(red.prompt_ids) == (
        f"<|im_start|>user\n<|vision_start|>{pads * 4}<|vision_end|>how many red squares?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tokenizer.decode(blue.prompt_ids).startswith(f"<|im_start|>user\nand here?<|vision_start|>{pads * 9}<")
    assert tokenizer.decode(inline_red.prompt_ids) == (
        f"<|im_start|>user\n<|vision_start|>{pads * 4}<|vision_end|><|im_end|>\n<|im_start|>assistant\n"
    )
    assert red.metadata["images"] == [str(data / "red.png")]  # resolved: engines may run elsewhere
    # what a rollout sends an engine: one placeholder per image (SGLang's form), which the engine expands again
    from miles.data.vision import collapse_placeholders

    one = collapse_placeholders(red.prompt_ids, red.metadata["image_token_id"])
    assert tokenizer.decode(one).startswith(f"<|im_start|>user\n<|vision_start|>{pads}<|vision_end|>how many")
    assert red.metadata["image_grid_thw"] == [[1, 4, 4]] and blue.metadata["image_grid_thw"] == [[1, 6, 6]]
    assert red.label == 2 and "image_grid_thw" not in text.metadata and pads not in tokenizer.decode(text.prompt_ids)


def test_each_image_takes_the_token_count_of_the_processors_own_rule(vlm: dict[str, Any]) -> None:
    """What ``Qwen2VLProcessor`` puts per image (it cannot be built here: its video half needs torchvision),
    by the image processor's own count, in placeholder order."""
    from PIL import Image
    from transformers import AutoTokenizer

    from miles.data.vision import load_image_processor

    tokenizer = AutoTokenizer.from_pretrained(vlm["model"])
    processor = load_image_processor(vlm["model"])
    data = vlm["data"]
    rows = [{"prompt": "count", "images": ["blue.png", "red.png"]}]
    (prompt,) = _source(vlm, _write(data / "one.jsonl", rows)).prompts
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    runs, count = [], 0
    for token in [*prompt.prompt_ids, -1]:
        if token == pad:
            count += 1
        elif count:
            runs.append(count)
            count = 0
    expected = []
    for name in ("blue.png", "red.png"):
        with Image.open(data / name) as image:
            width, height = image.size
        expected.append(processor.get_number_of_image_patches(height, width, {}) // processor.merge_size**2)
    assert runs == expected == [9, 4]


@pytest.mark.parametrize(
    ("row", "settings", "message"),
    [
        ({"prompt": "x", "images": ["gone.png"]}, {}, "bad.jsonl:2: images[0]: gone.png: no such image file"),
        (
            {"prompt": "x", "images": ["red.png", "broken.png"]},
            {},
            "bad.jsonl:2: images[1]: broken.png: not a decodable",
        ),
        ({"prompt": "x", "images": ["red.png"]}, {"max_image_pixels": 1000}, "56x56 = 3136 pixels, more than the 1000"),
        (
            {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}], "images": ["red.png"]},
            {},
            "bad.jsonl:2: message 0 has more image parts than the 1 image(s) of key 'images'",
        ),
        (
            {"prompt": "x", "pictures": 7},
            {"image_key": "pictures"},
            "bad.jsonl:2: key 'pictures' must be a list of images",
        ),
    ],
)
def test_bad_images_are_refused_naming_row_and_field(
    vlm: dict[str, Any], row: dict[str, Any], settings: dict[str, Any], message: str
) -> None:
    path = _write(vlm["data"] / "bad.jsonl", [{"prompt": "fine", "images": ["red.png"]}, row])
    with pytest.raises(DataError) as pipeline_error:
        _source(vlm, path, **settings)
    assert message in str(pipeline_error.value)
    # the settings check of a run finds it too, before anything starts
    run = MilesSettings.model_validate({"train": {"model_path": str(vlm["model"])}, "data": {"path": path, **settings}})
    with pytest.raises(SettingsError) as settings_error:
        JsonlDataSource.check_settings(ComponentSettings(), run)
    assert message in str(settings_error.value) and "data.path" in str(settings_error.value)
