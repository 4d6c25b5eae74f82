"""Weight updates while serving: version bump, new weights in effect, per-span versions of requests in
flight (retract / in_place) and aborts (abort); the API key guards every route (but ``/health``, the liveness probe; one server)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from miles.testing.engine import EngineProcess

from .conftest import hf_greedy, start_engine

KEY = "s3cret"
H = {"Authorization": f"Bearer {KEY}"}
PROMPT = [11, 22, 33, 44, 55, 66]


@pytest.fixture(scope="module")
def engine(engine_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    log = tmp_path_factory.mktemp("logs") / "weights.log"
    yield from start_engine(engine_models["qwen2"], log, "--api-key", KEY)


def post(engine: EngineProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(engine.url + path, json=body, headers=H, timeout=120)


def greedy(engine: EngineProcess, n: int = 12) -> dict:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    return post(engine, "/generate", body).json()


def test_api_key_is_checked_on_every_route(engine: EngineProcess) -> None:
    for method, path in (("GET", "/model_info"), ("POST", "/generate"), ("POST", "/flush_cache")):
        assert httpx.request(method, engine.url + path, timeout=30).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert httpx.request(method, engine.url + path, headers=wrong, timeout=30).status_code == 401
    assert httpx.get(engine.url + "/model_info", headers=H, timeout=30).status_code == 200
    # the liveness probe answers without a key, as SGLang's do (smg probes it without one), and says nothing
    health = httpx.get(engine.url + "/health", timeout=30)
    assert health.status_code == 200 and health.content == b""


def test_update_weights_from_disk_switches_models_and_versions(
    engine: EngineProcess, engine_models: dict[str, Path]
) -> None:
    a, b = engine_models["qwen2"], engine_models["qwen2_b"]
    before = greedy(engine)
    assert before["output_ids"] == hf_greedy(a, PROMPT, 12)
    resp = post(engine, "/update_weights_from_disk", {"model_path": str(b), "weight_version": "7"})
    assert resp.status_code == 200 and resp.json()["success"] is True
    assert httpx.get(engine.url + "/model_info", headers=H, timeout=30).json()["weight_version"] == "7"
    after = greedy(engine)
    assert after["output_ids"] == hf_greedy(b, PROMPT, 12) != before["output_ids"]
    assert after["meta_info"]["weight_version"] == "7"
    assert after["meta_info"]["cached_tokens"] == 0  # the cache of the old weights was flushed
    # no version given: the number is bumped
    post(engine, "/update_weights_from_disk", {"model_path": str(a)})
    assert httpx.get(engine.url + "/model_info", headers=H, timeout=30).json()["weight_version"] == "8"
    assert greedy(engine)["output_ids"] == before["output_ids"]
    resp = post(engine, "/update_weight_version", {"new_version": "42"})
    assert resp.json() == {"success": True, "message": "weight version updated", "new_version": "42"}
    assert greedy(engine)["meta_info"]["weight_version"] == "42"


def test_bad_weights_are_rejected_and_nothing_changes(
    engine: EngineProcess, engine_models: dict[str, Path], tmp_path: Path
) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({"model.not_a_layer.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    version = httpx.get(engine.url + "/model_info", headers=H, timeout=30).json()["weight_version"]
    before = greedy(engine)["output_ids"]
    resp = post(engine, "/update_weights_from_disk", {"model_path": str(tmp_path)})
    assert resp.status_code == 400 and "not_a_layer" in resp.json()["message"]
    save_file({"lm_head.weight": torch.zeros(3, 3)}, str(tmp_path / "model.safetensors"))
    resp = post(engine, "/update_weights_from_disk", {"model_path": str(tmp_path)})
    assert resp.status_code == 400 and "shape" in resp.json()["message"]
    assert httpx.get(engine.url + "/model_info", headers=H, timeout=30).json()["weight_version"] == version
    assert greedy(engine)["output_ids"] == before


def _update_during_generation(engine: EngineProcess, mode: str, model: Path, version: str) -> dict:
    async def run() -> dict:
        async with httpx.AsyncClient(base_url=engine.url, headers=H, timeout=300) as client:
            body = {
                "input_ids": PROMPT,
                "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0},
            }
            task = asyncio.create_task(client.post("/generate", json=body))
            while (await client.get("/server_info")).json()["generated_tokens"] == 0 or (
                await client.get("/server_info")
            ).json()["num_running_reqs"] == 0:
                await asyncio.sleep(0.005)
            assert (await client.post("/pause_generation", json={"mode": mode})).json()["success"]
            resp = await client.post(
                "/update_weights_from_disk", json={"model_path": str(model), "weight_version": version}
            )
            assert resp.json()["success"], resp.text
            await client.post("/continue_generation", json={})
            return (await task).json()

    return asyncio.run(run())


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_requests_in_flight_finish_on_new_weights_with_spans(
    engine: EngineProcess, engine_models: dict[str, Path], mode: str
) -> None:
    old = httpx.get(engine.url + "/model_info", headers=H, timeout=30).json()["weight_version"]
    target = engine_models["qwen2_b"] if mode == "retract" else engine_models["qwen2"]
    new = f"{mode}-v"
    out = _update_during_generation(engine, mode, target, new)
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 400}
    spans = meta["weight_version_spans"]
    assert len(spans) == 2 and spans[0][0] == 0 and spans[0][2] == old
    assert spans[0][1] == spans[1][0] and spans[1] == [spans[1][0], 400, new]
    assert meta["weight_version"] == new
    if mode == "retract":
        # retracted requests are recomputed under the new weights: the tail is the new model's greedy
        # continuation of everything generated before the switch
        cut = spans[0][1]
        prefix = PROMPT + out["output_ids"][:cut]
        assert out["output_ids"][cut : cut + 8] == hf_greedy(target, prefix, 8)


def test_abort_mode_aborts_requests_in_flight(engine: EngineProcess, engine_models: dict[str, Path]) -> None:
    out = _update_during_generation(engine, "abort", engine_models["qwen2"], "abort-v")
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert "pause" in out["meta_info"]["finish_reason"]["message"]


def test_update_without_pause_retracts_and_resumes(engine: EngineProcess, engine_models: dict[str, Path]) -> None:
    async def run() -> dict:
        async with httpx.AsyncClient(base_url=engine.url, headers=H, timeout=300) as client:
            body = {
                "input_ids": PROMPT,
                "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0},
            }
            task = asyncio.create_task(client.post("/generate", json=body))
            while (await client.get("/server_info")).json()["num_running_reqs"] == 0:
                await asyncio.sleep(0.005)
            resp = await client.post(
                "/update_weights_from_disk",
                json={"model_path": str(engine_models["qwen2"]), "weight_version": "auto-v"},
            )
            assert resp.json()["success"]
            assert (await client.get("/server_info")).json()["paused"] is None  # resumed by itself
            return (await task).json()

    meta = asyncio.run(run())["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["weight_version"] == "auto-v"
    versions = [span[2] for span in meta["weight_version_spans"]]
    assert versions[-1] == "auto-v" and sum(e - s for s, e, _ in meta["weight_version_spans"]) == 400


def test_weights_load_only_from_allowed_directories(engine: EngineProcess, engine_models: dict[str, Path]) -> None:
    """A real checkpoint outside the allowed directories is refused, however the path reaches it (directly, by
    ``..``, through a symbolic link inside an allowed directory), on both weight-loading routes."""
    import os
    import shutil
    import tempfile

    allowed = Path(os.environ["MILES_ALLOWED_WEIGHT_DIRS"])
    outside = Path(tempfile.mkdtemp(prefix="miles-outside-"))
    try:
        assert not outside.resolve().is_relative_to(allowed.resolve())
        shutil.copytree(engine_models["qwen2_b"], outside / "qwen2_b")
        link = allowed / "link-to-outside"
        link.symlink_to(outside / "qwen2_b")
        version = httpx.get(engine.url + "/model_info", headers=H, timeout=30).json()["weight_version"]
        before = greedy(engine)["output_ids"]
        dotted = str(allowed / ".." / ".." / outside.relative_to("/") / "qwen2_b")
        for path in (str(outside / "qwen2_b"), dotted, str(link)):
            resp = post(engine, "/update_weights_from_disk", {"model_path": path})
            assert resp.status_code == 400, resp.text
            message = resp.json()["message"]
            assert "model_path" in message and "--allowed-weight-dirs" in message and str(allowed) in message
            resp = post(engine, "/update_weights_from_delta", {"path": path})
            assert resp.status_code == 400 and resp.json()["message"].startswith("path: ")
        assert httpx.get(engine.url + "/model_info", headers=H, timeout=30).json()["weight_version"] == version
        assert greedy(engine)["output_ids"] == before
        # the same checkpoint inside an allowed directory loads
        inside = allowed / "qwen2_b_copy"
        shutil.copytree(engine_models["qwen2_b"], inside)
        assert post(engine, "/update_weights_from_disk", {"model_path": str(inside)}).status_code == 200
        assert greedy(engine)["output_ids"] == hf_greedy(engine_models["qwen2_b"], PROMPT, 12)
        assert post(engine, "/update_weights_from_disk", {"model_path": str(engine_models["qwen2"])}).status_code == 200
    finally:
        shutil.rmtree(outside)
