"""A vision-language actor (a tiny Qwen2-VL built from a config) against a real local engine serving it: the
trainer's logprobs of sampled responses equal the engine's with the same images (one packed micro-batch of
image, two-image and text-only sequences, fp32 within 1e-5); a step trains the vision tower (or not, by
setting), and the pushed weights, vision tower included, are what the engine then serves (its checksums
and, again, its logprobs); a text-only batch for image prompts is refused naming the row."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsdp_job as job
import httpx
import pytest
import torch

from miles.testing.engine import EngineProcess

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from miles.testing.vlm import build_tiny_vlm, squares_image

    root = tmp_path_factory.mktemp("fsdp-vlm")
    model = build_tiny_vlm(root / "model", seed=3)
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
def engine(vlm: dict[str, Any]) -> Iterator[EngineProcess]:
    with EngineProcess(vlm["model"], log_path=vlm["root"] / "engine.log") as proc:
        yield proc


def _prompts(vlm: dict[str, Any]) -> list[Any]:
    from miles.testing.vlm import vlm_jsonl_source

    return vlm_jsonl_source(vlm["model"], vlm["root"] / "rows.jsonl").prompts


def _rollout(url: str, prompts: list[Any]) -> list[Any]:
    """One sampled response of each prompt from the engine at ``url``, as the rollout manager's samples."""
    from miles.types import Sample

    body = {
        "input_ids": [p.prompt_ids for p in prompts],
        "image_data": [p.metadata["images"] or None for p in prompts],
        "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7},
        "return_logprob": True,
    }
    answers = httpx.post(url + "/generate", json=body, timeout=120).json()
    samples = []
    for i, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
        logprobs = [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]
        samples.append(
            Sample(
                prompt_ids=list(prompt.prompt_ids),
                response_ids=answer["output_ids"],
                rollout_logprobs=logprobs,
                loss_mask=[1] * len(logprobs),
                group_id=i,
                metadata=dict(prompt.metadata, source=prompt.source),
            )
        )
    return samples


def _batch(samples: list[Any], model: Path) -> Any:
    from miles.training.batch import TrainBatch
    from miles.training.vision import attach_images

    batch = TrainBatch.from_samples(samples)
    attach_images(batch, samples, str(model))
    return TrainBatch.from_tensors(batch.to_tensors())  # as it crosses ranks


def _trainer(model: Path, world: Any, **options: Any) -> Any:
    from miles.precision.builtin import FP32
    from miles.settings.model import TrainSettings
    from miles_fsdp.settings import FSDPSettings
    from miles_fsdp.trainer import FSDPTrainer

    train = TrainSettings(model_path=str(model), **{**job.TRAIN, "max_tokens_per_micro_batch": 4096})  # type: ignore[arg-type]
    trainer = FSDPTrainer(train, FSDPSettings(wrap_single_rank=False, **options), FP32(None), world)
    trainer.setup()
    return trainer


def _visual(trainer: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.actor.named_parameters() if ".visual." in f".{n}"}


def test_trainer_logprobs_equal_the_engines_and_pushes_cover_the_vision_tower(
    vlm: dict[str, Any], engine: EngineProcess, world: Any, tmp_path: Path
) -> None:
    from miles.training.hf_export import write_hf_checkpoint
    from miles.transport.verify import tensor_checksum

    model = vlm["model"]
    samples = _rollout(engine.url, _prompts(vlm))
    batch = _batch(samples, model)
    assert batch.image_counts.tolist() == [1, 2, 0] and batch.image_grid_thw.tolist() == [[1, 4, 4]] * 2 + [[1, 6, 6]]
    trainer = _trainer(model, world)
    try:
        got = trainer.compute_logprobs(batch).logprobs
        want = torch.tensor([lp for s in samples for lp in s.rollout_logprobs])
        assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()

        before = _visual(trainer)
        batch.set_token_field("advantages", torch.linspace(-1.0, 1.0, batch.num_response_tokens))
        batch.set_token_field("old_logprobs", got)
        trainer.train_step(batch, job.PolicyGradient())
        after = _visual(trainer)
        assert before and all(not torch.equal(before[n], after[n]) for n in ("model.visual.merger.mlp.0.weight",))

        out = tmp_path / "pushed"
        config = trainer.actor.config
        write_hf_checkpoint(trainer.iter_weights(1 << 30), out, rank=0, config=config, source_dir=str(model))
        pushed = httpx.post(engine.url + "/update_weights_from_disk", json={"model_path": str(out)}, timeout=120)
        assert pushed.status_code == 200, pushed.text
        served = httpx.post(engine.url + "/weights_checksum", timeout=60).json()["checksums"]
        assert {n: served[n] for n in after} == {n: tensor_checksum(t) for n, t in after.items()}
        again = _rollout(engine.url, _prompts(vlm))  # the new weights, the same images
        got = trainer.compute_logprobs(_batch(again, model)).logprobs
        want = torch.tensor([lp for s in again for lp in s.rollout_logprobs])
        assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    finally:
        trainer.close()


def test_a_frozen_vision_tower_stays_and_a_text_only_batch_is_refused(
    vlm: dict[str, Any], engine: EngineProcess, world: Any
) -> None:
    from miles.errors import DataError
    from miles.training.batch import TrainBatch
    from miles.training.vision import attach_images

    model = vlm["model"]
    samples = _rollout(engine.url, _prompts(vlm))
    trainer = _trainer(model, world, train_vision_tower=False)
    try:
        batch = _batch(samples, model)
        batch.set_token_field("advantages", torch.ones(batch.num_response_tokens))
        batch.set_token_field("old_logprobs", batch.rollout_logprobs)
        before = _visual(trainer)
        language = trainer.actor.lm_head.weight.detach().clone()
        trainer.train_step(batch, job.PolicyGradient())
        assert all(torch.equal(before[n], t) for n, t in _visual(trainer).items())
        assert not torch.equal(language, trainer.actor.lm_head.weight)

        text_only = TrainBatch.from_samples(samples)  # the images never attached
        with pytest.raises(ValueError, match="TrainBatch sequence 0: its prompt holds image placeholders"):
            trainer.compute_logprobs(text_only)
        samples[1].metadata.pop("images")
        with pytest.raises(DataError, match=r"rows.jsonl:2: the prompt holds 13 image placeholder tokens"):
            attach_images(TrainBatch.from_samples(samples), samples, str(model))
    finally:
        trainer.close()


def test_a_multi_turn_session_with_images_in_two_turns_trains(
    vlm: dict[str, Any], engine: EngineProcess, world: Any
) -> None:
    """An episode through the session service (images in the first and in a later user turn): the later
    turn's placeholders lie in the sample's response, outside the policy's spans; they take their image's
    features (the trainer's logprobs of every sampled token equal the engine's within 1e-5), never the loss."""
    import asyncio

    from miles.rollout.http_client import HttpEngineClient
    from miles.sessions.service import SessionService
    from miles.sessions.session import SessionSampling
    from miles.settings.sessions import SessionSettings

    root, model = vlm["root"], vlm["model"]

    def look(text: str, image: str) -> dict[str, Any]:
        return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                            {"type": "text", "text": text}]}  # fmt: skip

    async def episode() -> list[Any]:
        async with HttpEngineClient([engine.url]) as client:
            service = await SessionService.for_engines(client, SessionSettings(max_tokens=5))
            session = service.create_session(sampling=SessionSampling(seed=11, override=True))
            messages: list[Any] = [look("how many red squares?", str(root / "red.png"))]
            follow = [look("and in this one?", str(root / "mixed.png")), {"role": "user", "content": "sure?"}]
            for k in range(3):
                answer = await service.chat(session.id, {"messages": messages})
                messages.append(answer["choices"][0]["message"])
                if k < 2:
                    messages.append(follow[k])
            return session.samples()

    # the policy's own weights (an earlier test pushed trained ones)
    restored = httpx.post(engine.url + "/update_weights_from_disk", json={"model_path": str(model)}, timeout=120)
    assert restored.status_code == 200, restored.text
    (sample,) = asyncio.run(episode())
    token = int(json.loads((model / "config.json").read_text())["image_token_id"])
    later = [i for i, t in enumerate(sample.response_ids) if t == token]
    assert sample.prompt_ids.count(token) == 4 and len(later) == 9 and not any(sample.loss_mask[i] for i in later)
    batch = _batch([sample], model)
    assert batch.image_grid_thw.tolist() == [[1, 4, 4], [1, 6, 6]]
    trainer = _trainer(model, world)
    try:
        got = trainer.compute_logprobs(batch).logprobs
        sampled = torch.tensor(sample.loss_mask, dtype=torch.bool)
        want = torch.tensor(sample.rollout_logprobs)
        assert int(sampled.sum()) >= 3 and torch.allclose(got[sampled], want[sampled], atol=1e-5, rtol=0), (
            (got - want)[sampled].abs().max()
        )
        before = _visual(trainer)
        batch.set_token_field("advantages", torch.ones(batch.num_response_tokens))
        batch.set_token_field("old_logprobs", got)
        trainer.train_step(batch, job.PolicyGradient())
        assert not torch.equal(
            before["model.visual.merger.mlp.0.weight"], _visual(trainer)["model.visual.merger.mlp.0.weight"]
        )
    finally:
        trainer.close()


def test_qwen2_5_vl_logprobs_equal_the_engines_and_a_step_trains(
    vlm: dict[str, Any], world: Any, tmp_path: Path
) -> None:
    """Qwen2.5-VL (windowed attention in the vision tower: an 84x84 image is 3x3 merged patches in 2x2 windows;
    its RMSNorm vision blocks and gated MLP merger; its own M-RoPE index): sampled with the local engine
    (in-process, over HTTP: ``image_data`` as Miles' rollout sends it), its trainer logprobs equal the engine's
    within 1e-5 with the same images, and a step trains the vision tower."""
    from miles.engine.plugin import LocalEngine, LocalEngineSettings
    from miles.testing.vlm import build_tiny_vlm, vlm_jsonl_source

    model = build_tiny_vlm(tmp_path / "qwen2_5_vl", arch="qwen2_5_vl", seed=3)
    assert json.loads((model / "config.json").read_text())["model_type"] == "qwen2_5_vl"
    prompts = vlm_jsonl_source(model, vlm["root"] / "rows.jsonl").prompts
    engine = LocalEngine(LocalEngineSettings())
    with engine.start_in_process(model_path=str(model), host="127.0.0.1", device="cpu", dtype="float32") as url:
        samples = _rollout(url, prompts)
    batch = _batch(samples, model)
    assert batch.image_grid_thw.tolist() == [[1, 4, 4], [1, 4, 4], [1, 6, 6]]
    trainer = _trainer(model, world)
    try:
        got = trainer.compute_logprobs(batch).logprobs
        want = torch.tensor([lp for s in samples for lp in s.rollout_logprobs])
        assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
        before = _visual(trainer)
        batch.set_token_field("advantages", torch.linspace(-1.0, 1.0, batch.num_response_tokens))
        batch.set_token_field("old_logprobs", got)
        trainer.train_step(batch, job.PolicyGradient())
        after = _visual(trainer)
        changed = [n for n in before if not torch.equal(before[n], after[n])]
        assert "model.visual.blocks.0.attn.qkv.weight" in changed and "model.visual.merger.mlp.0.weight" in changed
    finally:
        trainer.close()
