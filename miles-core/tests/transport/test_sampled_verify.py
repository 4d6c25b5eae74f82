"""Sampled verification (for engines without a checksum route, as SGLang): SGLang's ``/get_weights_by_name``
on a real local engine, :class:`WeightSampler` on a push's buckets, and :func:`verify_sampled` catching a
tensor that was not pushed, a stale version and an unknown name."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from miles.errors import WeightVerificationError
from miles.rollout.http_client import HttpEngineClient
from miles.testing.engine import EngineProcess
from miles.transport.verify import WeightSampler, reference_rows, rows_problem, verify_sampled


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from miles.testing.models import build_tiny_model

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("models")
    return {
        "a": build_tiny_model(root / "a", "llama", seed=0, tie_word_embeddings=True),
        "b": build_tiny_model(root / "b", "llama", seed=1, tie_word_embeddings=True),
    }


@pytest.fixture(scope="module")
def engine(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    log = tmp_path_factory.mktemp("logs") / "engine.log"
    with EngineProcess(models["a"], extra_args=["--enable-debug-endpoints"], log_path=log) as process:
        yield process


def hf_state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def sampled(state: dict[str, torch.Tensor], dtype: str = "float32", bucket: int = 5) -> WeightSampler:
    """Stream ``state`` through a sampler in buckets of ``bucket`` tensors, as a push does."""
    sampler = WeightSampler(dtype, rows=3)
    items = list(state.items())
    buckets = [items[i : i + bucket] for i in range(0, len(items), bucket)]
    assert [len(b) for b in sampler.observe(iter(buckets))] == [len(b) for b in buckets]  # passes them on
    return sampler


def test_get_weights_by_name_answers_like_sglang(engine: EngineProcess, models: dict[str, Path]) -> None:
    state = hf_state(models["a"])
    name = "model.layers.0.self_attn.q_proj.weight"
    rows = httpx.post(engine.url + "/get_weights_by_name", json={"name": name, "truncate_size": 2}, timeout=30).json()
    assert torch.equal(torch.tensor(rows), state[name][:2].float())
    norm = "model.layers.1.input_layernorm.weight"
    values = httpx.post(engine.url + "/get_weights_by_name", json={"name": norm, "truncate_size": 5}, timeout=30).json()
    assert torch.equal(torch.tensor(values), state[norm][:5].float())
    # tied embeddings: lm_head.weight answers with the embedding, as SGLang does
    head = httpx.post(engine.url + "/get_weights_by_name", json={"name": "lm_head.weight", "truncate_size": 1}).json()
    assert torch.equal(torch.tensor(head), state["model.embed_tokens.weight"][:1].float())
    bad = httpx.post(engine.url + "/get_weights_by_name", json={"name": "model.nope.weight"}, timeout=30)
    assert bad.status_code == 400 and "model.nope.weight" in bad.json()["message"]


def test_rows_are_chosen_only_where_the_engines_answer_the_checkpoints_own_rows(
    engine: EngineProcess, models: dict[str, Path]
) -> None:
    """``verify_with = "auto"`` takes rows only where every engine answers ``/get_weights_by_name`` with the
    checkpoint's first rows, for a tensor of each kind (the first layer's and those outside the layers). SGLang on
    a CPU with AMX answers its repacked linear layers (seen on real SGLang: ``tests/real``); a checkpoint other
    than the one served stands in for that here, and a name the engine lacks for a model class without the
    route."""
    reference = reference_rows(str(models["a"]), "float32")
    assert {n for n in reference if ".layers." in n} == {n for n in hf_state(models["a"]) if ".layers.0." in n}
    assert "model.embed_tokens.weight" in reference and all(t.shape[0] <= 2 for t in reference.values())
    assert reference_rows(str(models["a"] / "model.safetensors"), "float32") == {}  # not a folder

    async def main() -> None:
        async with HttpEngineClient([engine.url]) as client:
            assert await rows_problem(client, reference) is None
            other = await rows_problem(client, reference_rows(str(models["b"]), "float32"))
            assert other is not None and "with other values than the checkpoint's" in other
            ghost = await rows_problem(client, {"model.ghost.weight": torch.zeros(2)})
            assert ghost is not None and "answers no /get_weights_by_name for 'model.ghost.weight'" in ghost
            assert await rows_problem(client, {}) == "no safetensors checkpoint to compare the engines' answers with"

    asyncio.run(main())


def test_sampled_verification_passes_then_catches_what_was_not_pushed(
    engine: EngineProcess, models: dict[str, Path], tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    state_b = hf_state(models["b"])
    missing = "model.layers.1.mlp.down_proj.weight"
    partial = tmp_path / "partial"
    partial.mkdir()
    save_file({k: v for k, v in state_b.items() if k != missing}, str(partial / "model.safetensors"))

    async def main() -> None:
        async with HttpEngineClient([engine.url]) as client:
            # load model b as version 7: its samples verify, model a's do not
            await client.update_weights_from_disk(str(models["b"]), "7")
            metrics = await verify_sampled(client, version="7", samples=sampled(state_b).samples)
            assert metrics == {"weight_sync/verified_tensors": float(len(state_b)), "weight_sync/verified": 1.0}
            with pytest.raises(WeightVerificationError, match="differs from what the trainer sent"):
                await verify_sampled(client, version="7", samples=sampled(hf_state(models["a"])).samples)
            with pytest.raises(WeightVerificationError, match=r"serves weight version '7', expected '8'"):
                await verify_sampled(client, version="8", samples=sampled(state_b).samples)
            # random weights, then a push of every tensor but one: that one is named
            await client.call(engine.url, "/debug/randomize_weights", {"seed": 3})
            await client.update_weights_from_disk(str(partial), "9")
            with pytest.raises(WeightVerificationError, match=f"tensor {missing!r} differs"):
                await verify_sampled(client, version="9", samples=sampled(state_b).samples)
            # bfloat16 samples of float32 weights differ in the low bits: the comparison is exact
            with pytest.raises(WeightVerificationError, match="differs"):
                await verify_sampled(client, version="9", samples=sampled(hf_state(partial), "bfloat16").samples)
            # a name the engine does not have
            ghost = {"model.ghost.weight": torch.zeros(3)}
            with pytest.raises(WeightVerificationError, match="cannot report tensor 'model.ghost.weight'"):
                await verify_sampled(client, version="9", samples=ghost)

    asyncio.run(main())


def test_sampler_casts_to_the_engine_dtype() -> None:
    t = torch.randn(6, 4)
    sampler = WeightSampler("bfloat16", rows=2)
    list(sampler.observe(iter([[("w", t), ("b", torch.randn(3)), ("s", torch.tensor(2.5))]])))
    assert torch.equal(sampler.samples["w"], t[:2].to(torch.bfloat16).float())
    assert sampler.samples["b"].shape == (2,) and sampler.samples["s"].tolist() == [2.5]
    list(sampler.observe(iter([[("x", t)]])))
    assert list(sampler.samples) == ["x"]  # a new push starts a new record
