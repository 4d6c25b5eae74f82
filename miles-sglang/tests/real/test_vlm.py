"""Real SGLang 0.5.23 serving a vision-language model on this CPU: a tiny Qwen2-VL built from a config (heads of
32, what the CPU attention kernels take) and saved with its tokenizer and image processor. Miles' own rollout
request (:func:`miles.rollout.manager.single_turn`: one placeholder per image, each image a ``data:`` URL in
``image_data``) is expanded by SGLang to the token count Miles' data pipeline gives the trainer, and its
logprobs equal transformers' on the same images within 1e-2 (bfloat16, greedy; 4e-3 measured); a multi-turn session with images in two
user turns runs through the session server on SGLang, each turn's prompt extending the last exactly.

Starting the server costs 20-30 s on idle cores (minutes on busy ones): ``MILES_SGLANG_ALL_RUNS=1`` runs it.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

SERVED_DTYPE = "bfloat16"
"""What the servers of these tests serve (``conftest.SERVED_DTYPE``: the CPU kernels have no float32 path)."""

pytestmark = pytest.mark.skipif(
    os.environ.get("MILES_SGLANG_ALL_RUNS") != "1",
    reason="starts its own SGLang server (20-30 s idle, minutes under load): MILES_SGLANG_ALL_RUNS=1 runs it",
)


def as_released(model: Path) -> None:
    """Write the two config keys released Qwen2-VL checkpoints carry and SGLang 0.5.23 reads, which
    transformers 5 no longer writes: ``vision_config.in_chans`` (``qwen2_vl.py:302``; transformers 5 names it
    ``in_channels``) and a top-level ``rope_scaling`` with the M-RoPE sections (``qwen2_vl.py:492``)."""
    config = json.loads((model / "config.json").read_text())
    config["vision_config"]["in_chans"] = config["vision_config"]["in_channels"]
    config["rope_scaling"] = {
        "type": "mrope",
        "mrope_section": config["text_config"]["rope_parameters"]["mrope_section"],
    }
    (model / "config.json").write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from miles.testing.vlm import build_tiny_vlm, squares_image

    root = tmp_path_factory.mktemp("sglang-vlm")
    model = build_tiny_vlm(root / "model", seed=2, hidden_size=128)
    as_released(model)
    for name, counts, size in (("red", {"red": 3}, 56), ("mixed", {"red": 1, "blue": 2}, 84)):
        squares_image(counts, size=size, seed=4).save(root / f"{name}.png")
    rows = [
        {"prompt": "how many red squares?", "images": ["red.png"]},
        {"prompt": "compare them", "images": ["red.png", "mixed.png"]},
        {"prompt": "no picture"},
    ]
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"model": model, "root": root}


@pytest.fixture(scope="module")
def vlm_server(vlm: dict[str, Any], serve_model: Any) -> Iterator[Any]:
    with serve_model(vlm["model"]) as running:
        yield running


def hf_logprobs(model_dir: Path, tokens: list[int], images: list[str]) -> list[float]:
    """``logp[i]`` of ``tokens[i]`` given ``tokens[:i]`` and the images (transformers, bfloat16, one forward)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from miles.data.vision import load_image_processor, load_images, process_images

    torch.set_num_threads(1)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=getattr(torch, SERVED_DTYPE)).eval()
    ids = torch.tensor([tokens])
    kwargs: dict[str, Any] = {}
    if images:
        vision = process_images(
            load_image_processor(model_dir), load_images(images, where="", image_key="images", base_dir=None)
        )
        kwargs = {
            "pixel_values": vision.pixel_values.to(model.dtype),
            "image_grid_thw": vision.image_grid_thw,
            "mm_token_type_ids": (ids == model.config.image_token_id).to(torch.int32),
        }
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids, **kwargs).logits[0].double(), dim=-1)
    return [float("nan"), *logp[:-1].gather(1, ids[0, 1:, None])[:, 0].tolist()]


def test_miles_rollout_requests_with_images_equal_transformers(vlm: dict[str, Any], vlm_server: Any) -> None:
    from miles.rollout.http_client import HttpEngineClient
    from miles.rollout.manager import single_turn
    from miles.rollout.protocol import SamplingParams
    from miles.testing.vlm import vlm_jsonl_source
    from miles.types import Sample

    model = vlm["model"]
    prompts = vlm_jsonl_source(model, vlm["root"] / "rows.jsonl").prompts
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)

    async def rollout() -> list[Sample]:
        async with HttpEngineClient([vlm_server.url]) as client:
            samples = [
                Sample(prompt_ids=list(p.prompt_ids or []), group_id=i, metadata=dict(p.metadata))
                for i, p in enumerate(prompts)
            ]
            return [await single_turn(client, s, params) for s in samples]

    samples = asyncio.run(rollout())
    worst = 0.0
    for sample in samples:
        # SGLang expanded each placeholder to the tokens Miles' pipeline counts (4 for 56x56, 9 for 84x84)
        assert sample.metadata["prompt_tokens"] == len(sample.prompt_ids), sample.metadata
        want = hf_logprobs(model, sample.tokens, sample.metadata["images"])[len(sample.prompt_ids) :]
        for got, ref in zip(sample.rollout_logprobs, want, strict=True):
            worst = max(worst, abs(got - ref))
    assert [s.response_length for s in samples] == [8, 8, 8]
    assert worst < 1e-2, f"SGLang's logprobs differ from transformers' (bfloat16, same images) by {worst:.4f}"


def test_a_session_with_images_in_two_turns_on_sglang_is_exact(vlm: dict[str, Any], vlm_server: Any) -> None:
    from miles.data.images import to_data_url
    from miles.rollout.http_client import HttpEngineClient
    from miles.sessions.service import SessionService
    from miles.sessions.session import SessionSampling
    from miles.settings.sessions import SessionSettings

    root = vlm["root"]

    def look(text: str, image: Path) -> dict[str, Any]:
        return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(image)}},
                                            {"type": "text", "text": text}]}  # fmt: skip

    async def episode() -> tuple[list[Any], list[Any]]:
        async with HttpEngineClient([vlm_server.url]) as client:
            service = await SessionService.for_engines(client, SessionSettings(max_tokens=4))
            assert service.vision is not None
            session = service.create_session(sampling=SessionSampling(temperature=0.0, override=True))
            messages: list[Any] = [look("how many red squares?", root / "red.png")]
            follow = [look("and here?", root / "mixed.png"), {"role": "user", "content": "sure?"}]
            answers = []
            for k in range(3):
                answer = await service.chat(session.id, {"messages": messages, "return_token_ids": True})
                answers.append(answer)
                messages.append(answer["choices"][0]["message"])
                if k < 2:
                    messages.append(follow[k])
            return answers, session.samples()

    answers, (sample,) = asyncio.run(episode())
    for k in range(1, 3):
        before = answers[k - 1]["prompt_token_ids"] + answers[k - 1]["choices"][0]["token_ids"]
        assert answers[k]["prompt_token_ids"][: len(before)] == before
        assert answers[k]["usage"]["prompt_tokens"] == len(answers[k]["prompt_token_ids"])
    assert sample.metadata["images"] == [to_data_url((root / n).read_bytes()) for n in ("red.png", "mixed.png")]
    want = hf_logprobs(vlm["model"], sample.tokens, sample.metadata["images"])[len(sample.prompt_ids) :]
    diffs = [abs(g - w) for g, w, m in zip(sample.rollout_logprobs, want, sample.loss_mask, strict=True) if m]
    assert len(diffs) == 12 and max(diffs) < 1e-2, diffs
