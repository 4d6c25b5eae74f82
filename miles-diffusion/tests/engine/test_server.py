"""The image engine as a real process over loopback HTTP: generation, the rollout function, weight
updates through the disk transport with checksum verification, pause / abort, bad requests."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from miles.errors import WeightVerificationError
from miles.rollout.http_client import HttpEngineClient
from miles.rollout.protocol import SamplingParams
from miles.training.trainer import DistContext
from miles.transport.disk import DiskTransport, DiskTransportSettings
from miles.transport.verify import verify_engines
from miles.types import Sample, SampleStatus
from miles_diffusion.policy import load_transformer
from miles_diffusion.rollout import TRAJECTORY_TENSORS, diffusion_rollout
from miles_diffusion.testing import ImageEngineProcess

FLAGS = [
    "--num-steps",
    "4",
    "--max-sequence-length",
    "16",
    "--enable-deterministic-inference",
    "--enable-debug-endpoints",
]


@pytest.fixture(scope="module")
def engine(policy_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ImageEngineProcess]:
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    with ImageEngineProcess(policy_dir, extra_args=FLAGS, log_path=log) as proc:
        yield proc


def _ids(pipe: Any, text: str) -> list[int]:
    return list(pipe.tokenizer(text)["input_ids"])


def test_generate_returns_steps_logprobs_image_and_trajectory(engine: ImageEngineProcess, pipe: Any) -> None:
    body = {"input_ids": _ids(pipe, "a red square"), "sampling_params": {"sampling_seed": 5, "max_new_tokens": 9}}
    first = httpx.post(engine.url + "/generate", json=body, timeout=120).json()
    again = httpx.post(engine.url + "/generate", json=body, timeout=120).json()
    meta = first["meta_info"]
    assert first["output_ids"] == [0, 1, 2, 3] and meta["finish_reason"]["type"] == "stop"
    assert [t[1] for t in meta["output_token_logprobs"]] == [0, 1, 2, 3] and meta["weight_version"] == "0"
    assert meta["trajectory"]["latents"]["shape"] == [4, 4, 8, 8] and meta["image"]
    assert again["meta_info"]["output_token_logprobs"] == meta["output_token_logprobs"]  # seeded: reproducible
    assert again["meta_info"]["trajectory"] == meta["trajectory"]
    batch = httpx.post(
        engine.url + "/generate", json={**body, "sampling_params": {"sampling_seed": 5, "n": 2}}, timeout=120
    )
    assert len(batch.json()) == 2 and batch.json()[0]["meta_info"]["trajectory"] == meta["trajectory"]


def test_bad_requests_are_400_naming_the_field(engine: ImageEngineProcess) -> None:
    bad_key = httpx.post(engine.url + "/generate", json={"input_ids": [1], "sampling_params": {"guidance": 2}})
    assert bad_key.status_code == 400 and "unknown sampling_params key(s): guidance" in bad_key.text
    bad_ids = httpx.post(engine.url + "/generate", json={"input_ids": [10**9]})
    assert bad_ids.status_code == 400 and "outside the vocabulary" in bad_ids.text
    assert httpx.post(engine.url + "/pause_generation", json={"mode": "later"}).status_code == 400


def test_the_rollout_function_keeps_the_trajectory(engine: ImageEngineProcess, pipe: Any) -> None:
    async def go() -> Sample:
        async with HttpEngineClient([engine.url]) as client:
            return await diffusion_rollout(client, Sample(_ids(pipe, "a blue cat")), SamplingParams(sampling_seed=3))

    sample = asyncio.run(go())
    sample.validate()
    assert sample.status == SampleStatus.COMPLETED and sample.response_ids == [0, 1, 2, 3]
    assert sample.loss_mask == [1, 1, 1, 1] and len(sample.rollout_logprobs) == 4
    assert set(sample.response_tensors) == set(TRAJECTORY_TENSORS) and isinstance(sample.metadata["image"], str)
    assert Sample.from_json(sample.to_json()) == sample


def test_weights_pushed_through_the_disk_transport_verify(
    engine: ImageEngineProcess, policy_dir: Path, tmp_path: Path
) -> None:
    model = load_transformer(policy_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    buckets = [[(n, p.detach()) for n, p in model.named_parameters()]]

    async def go() -> None:
        async with HttpEngineClient([engine.url]) as client:
            transport = DiskTransport(
                DiskTransportSettings(), run_dir=str(tmp_path), model_path=None, engine_dtype="float32"
            )
            await transport.connect(client, DistContext())
            await client.call(engine.url, "/debug/randomize_weights", {"seed": 1})  # verification must see every tensor
            report = await transport.push(buckets, version="1", dist=DistContext())
            metrics = await verify_engines(client, version="1", checksums_by_dtype={"float32": report.checksums})
            assert metrics["weight_sync/verified_tensors"] == float(len(buckets[0]))
            await client.call(engine.url, "/debug/randomize_weights", {"seed": 2})
            with pytest.raises(WeightVerificationError, match="differs from what the trainer sent"):
                await verify_engines(client, version="1", checksums_by_dtype={"float32": report.checksums})
            # a push that misses a tensor is refused before anything changes
            partial = tmp_path / "partial"
            partial.mkdir()
            from safetensors.torch import save_file

            save_file({n: t.contiguous() for n, t in buckets[0][1:]}, str(partial / "model.safetensors"))
            with pytest.raises(Exception, match="missing"):
                await client.update_weights_from_disk(str(partial), "2")
            report = await transport.push(buckets, version="3", dist=DistContext())  # the engine serves the push again
            await verify_engines(client, version="3", checksums_by_dtype={"float32": report.checksums})

    asyncio.run(go())


def test_pause_holds_requests_and_abort_aborts_them(engine: ImageEngineProcess, pipe: Any) -> None:
    body = {"input_ids": _ids(pipe, "a green tree"), "sampling_params": {"sampling_seed": 1}}

    async def go() -> None:
        async with httpx.AsyncClient(base_url=engine.url, timeout=120) as http:
            assert (await http.post("/pause_generation", json={"mode": "in_place"})).json()["success"]
            held = asyncio.create_task(http.post("/generate", json=body))
            await asyncio.sleep(1.0)
            assert not held.done()  # waits while paused
            await http.post("/continue_generation", json={})
            assert (await held).json()["meta_info"]["finish_reason"]["type"] == "stop"
            await http.post("/pause_generation", json={"mode": "in_place"})
            queued = asyncio.create_task(http.post("/generate", json=body))
            await asyncio.sleep(0.5)
            await http.post("/abort_request", json={"abort_all": True})
            assert (await queued).json()["meta_info"]["finish_reason"]["type"] == "abort"
            await http.post("/continue_generation", json={})

    asyncio.run(go())


def test_the_keys_guard_the_image_engine(policy_dir: Path, pipe: Any) -> None:
    """The run's keys on the image engine (issue 46): the local engine's two levels, ``/health`` open, and
    beyond loopback no start without a key."""
    from starlette.testclient import TestClient

    from miles.auth import ServiceKeys
    from miles_diffusion.engine.launch import create_engine_app
    from miles_diffusion.engine.options import ImageServeOptions, to_argv

    keys = ServiceKeys("img-api-key-1f2e", "img-admin-key-8c9d")
    opts = ImageServeOptions(model=policy_dir, num_steps=2, max_sequence_length=16, api_key=keys.api_key,
                             admin_api_key=keys.admin_api_key)  # fmt: skip
    assert keys.api_key not in to_argv(opts) and keys.api_key not in str(opts.server_info())
    app, scheduler = create_engine_app(opts)
    try:
        with TestClient(app) as client:
            body = {"input_ids": _ids(pipe, "a red square"), "sampling_params": {"sampling_seed": 1}}
            assert client.get("/health").status_code == 200
            for headers in ({}, keys.headers(control=True)):
                assert client.post("/generate", json=body, headers=headers).status_code == 401
            assert client.post("/generate", json=body, headers=keys.headers()).status_code == 200
            assert client.post("/flush_cache", json={}, headers=keys.headers()).status_code == 401
            assert client.post("/flush_cache", json={}, headers=keys.headers(control=True)).status_code == 200
            assert keys.api_key not in client.get("/server_info", headers=keys.headers()).text
    finally:
        scheduler.stop()
