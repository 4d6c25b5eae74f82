"""The local engine serving a vision-language model (a tiny Qwen2-VL built from a config), over real HTTP:
``image_data`` as SGLang takes it, logprobs equal to a transformers forward with the same images (prompt and
output tokens, several images of different sizes in one batch, M-RoPE past the prompt), a prefix cache that
never shares KV between prompts whose images differ, and bad images refused naming the field."""

from __future__ import annotations

import base64
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory, tiny_vlm_engine: tuple[Path, str]) -> dict[str, Any]:
    from miles.testing.vlm import squares_image

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("vlm")
    model = tiny_vlm_engine[0]
    images = {
        "red": squares_image({"red": 3}, seed=1),
        "blue": squares_image({"blue": 3}, seed=1),  # same size: same placeholder count as red
        "wide": squares_image({"green": 2, "red": 1}, size=84, seed=2),
    }
    paths = {}
    for name, image in images.items():
        paths[name] = root / f"{name}.png"
        image.save(paths[name])
    (root / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    return {"model": model, "paths": paths, "root": root, "url": tiny_vlm_engine[1]}


@pytest.fixture(scope="module")
def engine(vlm: dict[str, Any]) -> Any:
    """The shared engine (``conftest.tiny_vlm_engine``): what the tests use of it is its ``url``."""
    return SimpleNamespace(url=vlm["url"])


def _prompt(model: Path, images: int, text: str = "how many red squares?") -> list[int]:
    """The chat prompt with one placeholder per image (SGLang's form)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    content = [{"type": "image"} for _ in range(images)] + [{"type": "text", "text": text}]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return [int(t) for t in (ids if isinstance(ids, list) else ids["input_ids"])]


def _generate(engine: Any, body: dict[str, Any]) -> Any:
    body = {"return_logprob": True, "logprob_start_len": 0, **body}
    body.setdefault("sampling_params", {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True})
    response = httpx.post(engine.url + "/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _hf_logprobs(model_dir: Path, tokens: list[int], image_paths: list[Path]) -> torch.Tensor:
    """``logp[i]`` of ``tokens[i]`` given ``tokens[:i]`` and the images: one transformers forward (fp32)."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from miles.data.vision import load_image_processor, process_images

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([tokens])
    kwargs: dict[str, Any] = {}
    if image_paths:
        images = []
        for path in image_paths:
            with Image.open(path) as image:
                images.append(image.convert("RGB"))
        vision = process_images(load_image_processor(model_dir), images)
        mm_types = (ids == model.config.image_token_id).to(torch.int32)
        kwargs = {
            "pixel_values": vision.pixel_values,
            "image_grid_thw": vision.image_grid_thw,
            "mm_token_type_ids": mm_types,
        }
    with torch.no_grad():
        logits = model(input_ids=ids, **kwargs).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    out = torch.full((len(tokens),), float("nan"))
    out[1:] = logp[:-1].gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return out


def _engine_logprobs(entry: dict[str, Any]) -> tuple[list[int], torch.Tensor]:
    """The full sequence (prompt + output) and the engine's logprob of each token (NaN for the first)."""
    meta = entry["meta_info"]
    prompt = [t for _, t, _ in meta["input_token_logprobs"]]
    values = [float("nan") if lp is None else lp for lp, _, _ in meta["input_token_logprobs"]]
    values += [lp for lp, _, _ in meta["output_token_logprobs"]]
    return prompt + entry["output_ids"], torch.tensor(values)


def test_logprobs_equal_a_transformers_forward_with_the_same_images(vlm: dict[str, Any], engine: Any) -> None:
    model, paths = vlm["model"], vlm["paths"]
    one, two = _prompt(model, 1), _prompt(model, 2, "compare")
    wide_b64 = base64.b64encode(paths["wide"].read_bytes()).decode()
    answers = _generate(
        engine,
        {
            "input_ids": [one, two, _prompt(model, 0, "no image here")],
            # a path; a file:// URL and bare base64 (two images of different sizes); none
            "image_data": [str(paths["red"]), [paths["blue"].as_uri(), wide_b64], None],
        },
    )
    for entry, images in zip(answers, [[paths["red"]], [paths["blue"], paths["wide"]], []], strict=True):
        tokens, got = _engine_logprobs(entry)
        want = _hf_logprobs(model, tokens, images)
        assert torch.allclose(got[1:], want[1:], atol=1e-5, rtol=0), (got - want).abs().nanmax()
    image_token = _config(model)["image_token_id"]
    # placeholders expanded by the image's grid: 56x56 is 4x4 patches = 4 tokens; 84x84 is 6x6 = 9 tokens
    red_tokens, _ = _engine_logprobs(answers[0])
    assert red_tokens.count(image_token) == 4 and answers[0]["meta_info"]["prompt_tokens"] == len(one) + 3
    two_tokens, _ = _engine_logprobs(answers[1])
    assert two_tokens.count(image_token) == 4 + 9
    # the expanded prompt sent back (what a trainer sees) gives the same answer as SGLang's one-placeholder form
    again = _generate(engine, {"input_ids": red_tokens[: len(red_tokens) - 4], "image_data": [str(paths["red"])]})
    assert again["output_ids"] == answers[0]["output_ids"]


def test_prompts_that_differ_only_in_the_image_never_share_kv(vlm: dict[str, Any], engine: Any) -> None:
    model, paths = vlm["model"], vlm["paths"]
    prompt = _prompt(model, 1, "what colour are the squares?")
    first_image = prompt.index(_config(model)["image_token_id"])
    assert httpx.post(engine.url + "/flush_cache", timeout=30).status_code == 200
    outputs = {"logprob_start_len": -1}  # output logprobs only: the whole prompt may come from the cache
    red = _generate(engine, {"input_ids": prompt, "image_data": str(paths["red"]), **outputs})
    blue = _generate(engine, {"input_ids": prompt, "image_data": str(paths["blue"]), **outputs})
    red_again = _generate(engine, {"input_ids": prompt, "image_data": str(paths["red"]), **outputs})
    # the text before the image is shared; nothing from the image on
    assert blue["meta_info"]["cached_tokens"] == first_image
    red_lp, blue_lp, again_lp = (
        torch.tensor([lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]]) for a in (red, blue, red_again)
    )
    assert red["output_ids"] != blue["output_ids"] or (red_lp - blue_lp).abs().max() > 1e-3
    # the same image is a hit up to the last prompt token, with the same numbers
    assert red_again["meta_info"]["cached_tokens"] == red["meta_info"]["prompt_tokens"] - 1
    assert red_again["output_ids"] == red["output_ids"]
    assert torch.allclose(again_lp, red_lp, atol=1e-5, rtol=0)
    # a cache hit that ends inside the image (input logprobs asked from two tokens into it): the prefill resumes
    # mid-image with the rest of its embeddings and M-RoPE positions, and still equals transformers
    inside = _generate(
        engine, {"input_ids": prompt, "image_data": str(paths["red"]), "logprob_start_len": first_image + 2}
    )
    assert inside["meta_info"]["cached_tokens"] == first_image + 1
    tokens = [t for _, t, _ in inside["meta_info"]["input_token_logprobs"]]
    got = torch.tensor([lp for lp, _, _ in inside["meta_info"]["input_token_logprobs"]])
    full = red["meta_info"]["prompt_tokens"]
    want = _hf_logprobs(model, _expanded(model, prompt, full) + inside["output_ids"], [paths["red"]])
    assert tokens == _expanded(model, prompt, full)[first_image + 2 :]
    assert torch.allclose(got, want[first_image + 2 : full], atol=1e-5, rtol=0)
    assert inside["output_ids"] == red["output_ids"]


def test_a_cache_hit_past_every_image_prefills_the_text_after_it(vlm: dict[str, Any], engine: Any) -> None:
    """The next turn of a conversation (or another question on the same image) finds the image's KV in the
    cache and prefills only text: no vision embeddings are needed, nor encoded (this failed: the prefill asked
    for embeddings that were never encoded)."""
    model, paths = vlm["model"], vlm["paths"]
    image_token = _config(model)["image_token_id"]
    first = _prompt(model, 1, "how many blue squares are there?")
    assert httpx.post(engine.url + "/flush_cache", timeout=30).status_code == 200
    start = _generate(engine, {"input_ids": first, "image_data": str(paths["blue"]), "logprob_start_len": -1})
    longer = first + start["output_ids"] + _prompt(model, 0, "and red ones?")  # a second turn, text only
    after = len(first) + 3 + len(start["output_ids"])  # the image expanded to 4 tokens
    answer = _generate(engine, {"input_ids": longer, "image_data": str(paths["blue"]), "logprob_start_len": after})
    assert answer["meta_info"]["finish_reason"]["type"] != "abort", answer["meta_info"]["finish_reason"]
    assert answer["meta_info"]["cached_tokens"] >= first.index(image_token) + 4  # past the image
    got = torch.tensor([lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]])
    full = _expanded(model, longer, answer["meta_info"]["prompt_tokens"]) + answer["output_ids"]
    want = _hf_logprobs(model, full, [paths["blue"]])
    assert torch.allclose(got, want[-len(got) :], atol=1e-5, rtol=0), (got - want[-len(got) :]).abs().max()


@pytest.mark.parametrize(
    ("image_data", "images", "message"),
    [
        ("missing.png", 1, "image_data for input_ids, image 0: missing.png: no such image file"),
        ("BROKEN", 1, "not a decodable image"),
        (None, 1, "image placeholder but image_data gives no image"),
        (["RED", "RED"], 1, "1 image placeholder(s) for 2 image(s)"),
    ],
)
def test_bad_images_are_refused_naming_the_field(
    vlm: dict[str, Any], engine: Any, image_data: Any, images: int, message: str
) -> None:
    named = {"RED": str(vlm["paths"]["red"]), "BROKEN": str(vlm["root"] / "broken.png")}
    if isinstance(image_data, list):
        image_data = [named.get(i, i) for i in image_data]
    elif image_data is not None:
        image_data = named.get(image_data, image_data)
    body = {"input_ids": _prompt(vlm["model"], images), "image_data": image_data}
    response = httpx.post(engine.url + "/generate", json=body, timeout=60)
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]


def _expanded(model: Path, prompt: list[int], length: int) -> list[int]:
    """``prompt`` with its one image placeholder repeated to make it ``length`` tokens long."""
    token = _config(model)["image_token_id"]
    i = prompt.index(token)
    return prompt[:i] + [token] * (length - len(prompt) + 1) + prompt[i + 1 :]


def _config(model: Path) -> dict[str, Any]:
    import json

    return dict(json.loads((model / "config.json").read_text()))


def _greedy_request(ids: list[int], images: Any, max_new_tokens: int, **extra: Any) -> tuple[Any, Any]:
    """An in-process greedy request of ``ids`` with ``images`` and the event its sink sets when it finishes."""
    import threading

    from miles.engine.request import Request
    from miles.rollout.protocol import SamplingParams

    finished = threading.Event()
    request = Request(
        rid="r",
        parent_rid="r",
        index=0,
        prompt_ids=ids,
        config=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True),
        sink=lambda req, done: finished.set() if done else None,
        images=images,
        **extra,
    )
    return request, finished


def test_a_weight_update_mid_generation_encodes_the_images_again(vlm: dict[str, Any], tmp_path: Path) -> None:
    """A request retracted by a weight update is prefilled again with the new weights, its image through the new
    vision tower too: every token after the update has the new model's logprob (transformers, same image)."""
    from miles.engine.launch import build_engine
    from miles.testing.vlm import build_tiny_vlm

    model, paths = vlm["model"], vlm["paths"]
    other = build_tiny_vlm(tmp_path / "other", seed=1)
    state = build_engine(model, max_cache_tokens=0)
    sched = state.scheduler
    try:
        ids, images = state.images([str(paths["red"])], _prompt(model, 1), "input_ids")
        request, finished = _greedy_request(ids, images, 48)
        sched.add([request])
        while len(request.output_ids) < 2 and not finished.wait(0.001):
            pass
        sched.submit(sched.update_weights, str(other), "1", True, False).result(timeout=60)  # retracts it
        assert finished.wait(120)
    finally:
        sched.stop()
    updated = [(start, end) for start, end, version in request.spans if version == "1"]
    assert updated and updated[0][0] > 0, request.spans  # it really was mid-generation
    start = updated[0][0]
    want = _hf_logprobs(other, ids + request.output_ids, [paths["red"]])[len(ids) :]
    got = torch.tensor(request.output_logprobs)
    assert torch.allclose(got[start:], want[start:], atol=1e-5, rtol=0), (got - want)[start:].abs().max()


def test_qwen2_5_vl_is_served_as_transformers_computes_it(vlm: dict[str, Any], tmp_path: Path) -> None:
    """Qwen2.5-VL (windowed vision attention, its own M-RoPE index), in-process: the logprobs of the prompt and
    of greedy output tokens equal a transformers forward with the same image."""
    from miles.engine.launch import build_engine
    from miles.testing.vlm import build_tiny_vlm

    model = build_tiny_vlm(tmp_path / "qwen2_5_vl", arch="qwen2_5_vl")
    state = build_engine(model)
    try:
        ids, images = state.images([str(vlm["paths"]["wide"])], _prompt(model, 1), "input_ids")
        request, finished = _greedy_request(ids, images, 4, return_logprob=True, logprob_start_len=0)
        state.scheduler.add([request])
        assert finished.wait(120)
    finally:
        state.scheduler.stop()
    assert ids.count(_config(model)["image_token_id"]) == 9  # 84x84: a 6x6 grid, 2x2-merged
    got = torch.tensor([float("nan"), *request.input_logprobs[1:], *request.output_logprobs])
    want = _hf_logprobs(model, ids + request.output_ids, [vlm["paths"]["wide"]])
    assert torch.allclose(got[1:], want[1:], atol=1e-5, rtol=0), (got - want)[1:].abs().max()
