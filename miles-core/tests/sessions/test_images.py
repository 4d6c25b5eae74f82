"""Image content parts through the session server for a vision-language policy (a tiny Qwen2-VL built from a
config, served by a real local engine, driven by OpenAI's client): images in the first and a later user turn,
each turn's prompt extending the last exactly, placeholders expanded to each image's tokens and never in the
loss, the sample carrying its images in placeholder order; another image in the history is a branch; bad
image parts are a 400 naming the message and part; a template that drops images is refused at start."""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from miles.rollout.http_client import HttpEngineClient
from miles.sessions.server import SessionServer
from miles.settings.sessions import SessionSettings
from miles.types import Sample

from .conftest import serving

pytest.importorskip("PIL")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory, tiny_vlm_engine: tuple[Path, str]) -> dict[str, Any]:
    from miles.testing.vlm import squares_image

    root = tmp_path_factory.mktemp("session-vlm")
    model = tiny_vlm_engine[0]
    for name, counts, size in (("a", {"red": 2}, 56), ("b", {"red": 1, "blue": 2}, 84), ("c", {"blue": 3}, 56)):
        squares_image(counts, size=size, seed=9).save(root / f"{name}.png")
    return {"model": model, "root": root, "url": tiny_vlm_engine[1]}


@pytest.fixture(scope="module")
def engine(vlm: dict[str, Any]) -> Any:
    """The shared engine (``conftest.tiny_vlm_engine``): what the tests use of it is its ``url``."""
    return SimpleNamespace(url=vlm["url"])


def data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def look(text: str, *urls: str) -> dict[str, Any]:
    return {"role": "user", "content": [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
                                        {"type": "text", "text": text}]}  # fmt: skip


def test_images_in_two_user_turns_are_exact_and_never_in_the_loss(vlm: dict[str, Any], engine: Any) -> None:
    openai = pytest.importorskip("openai")
    from miles.data.images import to_data_url

    root = vlm["root"]
    token = int(__import__("json").loads((vlm["model"] / "config.json").read_text())["image_token_id"])

    async def run() -> None:
        async with serving(engine.url, max_tokens=5) as (server, http):
            assert server.live is not None and server.live.ok, server.live  # the VL template passes both checks
            assert server.vision is not None and server.report.ok and server.info()["images"] is True
            sid = (await http.post("/sessions", json={"sampling": {"seed": 3, "override": True}})).json()["id"]
            client = openai.AsyncOpenAI(base_url=f"{server.url}/sessions/{sid}/v1", api_key="unused", max_retries=0)
            messages: list[Any] = [
                {"role": "system", "content": "Count carefully."},
                look("How many red squares?", data_url(root / "a.png")),  # a data URL
            ]
            follow = [look("And here?", str(root / "b.png")), {"role": "user", "content": "Thanks."}]  # a path
            turns = []
            for k in range(3):
                reply = await client.chat.completions.create(
                    model="policy", messages=messages, logprobs=True, extra_body={"return_token_ids": True}
                )
                choice = reply.choices[0]
                turns.append(((reply.model_extra or {})["prompt_token_ids"], choice.model_extra["token_ids"]))
                assert token not in turns[-1][1], "the tiny policy sampled the placeholder: pick another seed"
                messages.append(choice.message.model_dump(exclude_none=True))
                if k < 2:
                    messages.append(follow[k])
            for k in range(1, 3):
                previous = turns[k - 1][0] + turns[k - 1][1]
                assert turns[k][0][: len(previous)] == previous  # exact across turns, images included
            # a 56x56 image is a 4x4 patch grid (4 tokens after the 2x2 merge), an 84x84 one 6x6 (9)
            assert turns[0][0].count(token) == 4 and turns[1][0].count(token) == 4 + 9
            (sample,) = [Sample.from_dict(d) for d in (await http.get(f"/sessions/{sid}/samples")).json()]
            sample.validate()
            assert sample.prompt_ids == turns[0][0] and sample.tokens == turns[2][0] + turns[2][1]
            assert sample.metadata["images"] == [to_data_url((root / n).read_bytes()) for n in ("a.png", "b.png")]
            assert sample.metadata["image_token_id"] == token
            placeholders = [i for i, t in enumerate(sample.response_ids) if t == token]
            assert len(placeholders) == 9 and all(sample.loss_mask[i] == 0 for i in placeholders)
            assert sum(sample.loss_mask) == sum(len(out) for _, out in turns)
            assert sample.metadata["session"]["cached_tokens"] > 0  # the image turns' KV reused, keyed by image

            # the same history with another first image is another conversation: a branch, not the stored KV
            edited = [messages[0], look("How many red squares?", data_url(root / "c.png"))]
            body = (await http.post(f"/sessions/{sid}/v1/chat/completions",
                                    json={"messages": edited, "return_token_ids": True})).json()  # fmt: skip
            assert body["miles"]["branch"] is True and body["prompt_token_ids"].count(token) == 4
            assert body["prompt_token_ids"] == turns[0][0]  # the same tokens: only the image differs
            samples = [Sample.from_dict(d) for d in (await http.get(f"/sessions/{sid}/samples")).json()]
            assert [s.metadata["images"] for s in samples][-1] == [to_data_url((root / "c.png").read_bytes())]
            await client.close()

    asyncio.run(run())


def png(size: tuple[int, int]) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, (200, 10, 10)).save(out, format="PNG")
    return out.getvalue()


def test_bad_image_parts_are_400_naming_the_message_and_part(vlm: dict[str, Any], engine: Any) -> None:
    good = "data:image/png;base64," + base64.b64encode(png((28, 28))).decode()
    big = "data:image/png;base64," + base64.b64encode(png((80, 80))).decode()
    not_image = "data:image/png;base64," + base64.b64encode(b"these bytes are no picture" * 4).decode()
    where = "messages[1].content[1].image_url.url"
    cases = [
        (str(vlm["root"] / "missing.png"), where, "no such image file"),
        (not_image, where, "not a decodable image"),
        (big, where, "6400 pixels, more than the 4000 allowed"),
        ("https://example.com/cat.png", where, "remote URLs are not fetched"),
        ("data:image/png,rawbytes", where, "must be base64 encoded"),
    ]

    async def run() -> None:
        async with serving(engine.url, live_check=False, max_tokens=2, max_image_pixels=4000) as (_, http):
            sid = (await http.post("/sessions", json={})).json()["id"]
            url = f"/sessions/{sid}/v1/chat/completions"
            for ref, param, text in cases:
                messages = [{"role": "system", "content": "hi"}, look("count", good, ref)]
                resp = await http.post(url, json={"messages": messages})
                assert resp.status_code == 400, (ref, resp.text)
                error = resp.json()["error"]
                assert error["param"] == param and error["message"].startswith(param) and text in error["message"], (
                    error
                )
            image_in_system = [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": good}}]}]
            resp = await http.post(url, json={"messages": image_in_system})
            assert resp.status_code == 400 and "images go in user messages" in resp.json()["error"]["message"]
            typed = [{"role": "user", "content": [{"type": "text", "text": "a <|image_pad|> b"}]}]
            resp = await http.post(url, json={"messages": typed})  # the placeholder typed as text, no image
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages[0:]", resp.text
            assert "1 image placeholder(s) for 0 image(s)" in resp.json()["error"]["message"]
            ok = await http.post(url, json={"messages": [look("count", good)]})
            assert ok.status_code == 200, ok.text  # none of the refusals left a turn behind
            assert (await http.get(f"/sessions/{sid}")).json()["turns"] == 1

    asyncio.run(run())


def test_a_template_that_drops_images_is_refused_at_start(vlm: dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    from miles.errors import SettingsError
    from miles.sessions.images import SessionVision

    tok = AutoTokenizer.from_pretrained(vlm["model"])
    vision = SessionVision.for_model(vlm["model"])
    client = HttpEngineClient(["http://127.0.0.1:9"])  # never called: the checks run before any generation
    try:
        with pytest.raises(SettingsError, match=r"rollout.sessions.chat_template: .* writes 0 image placeholder\(s\) "
                                                r"for the 3 image parts of the probe 'images'"):  # fmt: skip
            SessionServer(client, tok, SessionSettings(chat_template="qwen3"), vision=vision)
        assert SessionServer(client, tok, SessionSettings(), vision=vision).report.ok
    finally:
        asyncio.run(client.close())


def test_a_placeholder_the_policy_sampled_cannot_be_sent_back_409(vlm: dict[str, Any]) -> None:
    from miles.sessions.images import SessionVision
    from miles.sessions.schema import RequestError

    vision = SessionVision.for_model(vlm["model"])
    t = vision.image_token_id
    assert vision.engine_prompt([1, t, t, t, t, 2, 3], 1) == [1, t, 2, 3]
    with pytest.raises(RequestError, match=r"holds 2 image placeholder\(s\) for 1 image\(s\)") as exc:
        vision.engine_prompt([1, t, t, t, t, 2, t, 3], 1)  # a reply that sampled the placeholder token
    assert exc.value.status == 409
