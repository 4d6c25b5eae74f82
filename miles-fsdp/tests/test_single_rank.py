"""World size 1: the plain module (no FSDP wrapping) and the fused logprobs against the wrapped, full-logits
trainer, on one in-process gloo rank and a tiny Llama with tied embeddings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import fsdp_job as job
import pytest
import torch


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from miles.testing.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("single") / "llama", "llama", seed=5, tie_word_embeddings=True)


def _trainer(model: Path, world: Any, **options: Any) -> Any:
    from miles.precision.builtin import FP32
    from miles.settings.model import TrainSettings
    from miles_fsdp.settings import FSDPSettings
    from miles_fsdp.trainer import FSDPTrainer

    train = TrainSettings(model_path=str(model), **job.TRAIN)  # type: ignore[arg-type]
    options = {"wrap_single_rank": False, "fused_logprobs": True, **options}  # what these tests are about
    trainer = FSDPTrainer(train, FSDPSettings(**options), FP32(None), world)
    trainer.setup()
    return trainer


def _weights(trainer: Any) -> dict[str, torch.Tensor]:
    return {name: t.clone() for bucket in trainer.iter_weights(1 << 30) for name, t in bucket}


def _run(trainer: Any, vocab: int, steps: range) -> tuple[list[dict[str, float]], Any]:
    metrics = [
        trainer.train_step(batch, job.PolicyGradient(job.AGGREGATIONS[s]), temperature=job.TEMPERATURE)
        for s, batch in zip(steps, job.step_batches(vocab)[steps.start : steps.stop], strict=True)
    ]
    return metrics, trainer.compute_logprobs(job.eval_batch(vocab, 1), temperature=0.7, with_entropy=True)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _norm_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return float(sum(float(((a[k] - b[k]) ** 2).sum()) for k in a) ** 0.5)


def test_plain_and_fused_train_the_wrapped_full_logits_weights(model: Path, world: Any, tmp_path: Path) -> None:
    from torch.distributed.fsdp import FSDPModule

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    wrapped = _trainer(model, world, wrap_single_rank=True, fused_logprobs=False)
    assert isinstance(wrapped.actor, FSDPModule)
    initial = _weights(wrapped)
    ref_metrics, ref_lp = _run(wrapped, vocab, range(job.STEPS))
    ref_weights = _weights(wrapped)
    wrapped.close()

    plain = _trainer(model, world, fused_logprobs=False)
    assert not isinstance(plain.actor, FSDPModule)
    plain_metrics, plain_lp = _run(plain, vocab, range(job.STEPS))
    plain_weights = _weights(plain)
    plain.close()

    fused = _trainer(model, world)  # plain module, fused logprobs
    assert not isinstance(fused.actor, FSDPModule)
    assert id(fused.actor) in fused._heads and not plain._heads and not wrapped._heads  # the fused head is in use
    metrics, _ = _run(fused, vocab, range(job.SAVE_AFTER))
    fused.save_checkpoint(str(tmp_path / "ckpt"))
    rest, fused_lp = _run(fused, vocab, range(job.SAVE_AFTER, job.STEPS))
    fused_weights = _weights(fused)
    fused.close()

    assert _max_diff(ref_weights, initial) > 1e-4  # the steps moved the weights
    assert _max_diff(plain_weights, ref_weights) < 1e-6  # AdamW foreach vs per-DTensor: fp32 rounding
    assert _max_diff(fused_weights, ref_weights) < 1e-5
    for mine, theirs in ((plain_metrics, ref_metrics), (metrics + rest, ref_metrics)):
        for m, r in zip(mine, theirs, strict=True):
            assert m["loss"] == pytest.approx(r["loss"], rel=1e-5, abs=1e-7)
            assert m["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
            assert m["entropy"] == pytest.approx(r["entropy"], rel=1e-5)
    for out in (plain_lp, fused_lp):  # every token's, packed as the batch's per-token fields
        torch.testing.assert_close(out.logprobs, ref_lp.logprobs, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.entropy, ref_lp.entropy, rtol=1e-5, atol=1e-5)

    # the plain trainer's DCP checkpoint resumes in an FSDP-wrapped trainer, and continues as the plain one did
    resumed = _trainer(model, world, wrap_single_rank=True)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.step == job.SAVE_AFTER
    resumed_metrics, _ = _run(resumed, vocab, range(job.SAVE_AFTER, job.STEPS))
    assert _max_diff(_weights(resumed), fused_weights) < 1e-6
    for m, r in zip(resumed_metrics, rest, strict=True):
        assert m["loss"] == pytest.approx(r["loss"], rel=1e-5, abs=1e-7)
    resumed.close()


def test_fused_logprobs_refuses_a_head_it_cannot_fuse(model: Path, world: Any) -> None:
    from miles_fsdp.fused_head import FusedHead, unsupported_reason

    trainer = _trainer(model, world, fused_logprobs=False)
    trainer.actor.config.final_logit_softcapping = 30.0
    assert "final_logit_softcapping" in str(unsupported_reason(trainer.actor))
    with pytest.raises(TypeError, match="fused_logprobs = false"):
        FusedHead(trainer.actor, chunk_tokens=8)
    trainer.close()


def test_bf16_on_one_rank_autocasts_with_fp32_master_weights(model: Path, world: Any) -> None:
    """bf16 at world size 1: the plain module under autocast (bf16 GEMMs, fp32 master weights and AdamW
    state) scores and trains as the FSDP ``MixedPrecisionPolicy`` trainer does, to bf16 rounding."""
    from torch.distributed.fsdp import FSDPModule

    from miles.precision.builtin import BF16
    from miles.settings.model import TrainSettings
    from miles_fsdp.settings import FSDPSettings
    from miles_fsdp.trainer import FSDPTrainer

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    train = TrainSettings(model_path=str(model), **job.TRAIN)  # type: ignore[arg-type]
    out = {}
    fp32 = _trainer(model, world)
    initial = _weights(fp32)
    _, fp32_lp = _run(fp32, vocab, range(2))
    fp32_weights = _weights(fp32)
    fp32.close()
    for wrap in (True, False):
        trainer = FSDPTrainer(train, FSDPSettings(wrap_single_rank=wrap), BF16(None), world)  # type: ignore[arg-type]
        trainer.setup()
        assert isinstance(trainer.actor, FSDPModule) is wrap
        seen: list[torch.dtype] = []
        proj = trainer.actor.model.layers[0].self_attn.q_proj
        hook = proj.register_forward_hook(lambda _m, _i, o, seen=seen: seen.append(o.dtype))
        metrics, lp = _run(trainer, vocab, range(2))
        hook.remove()
        assert set(seen) == {torch.bfloat16}  # the GEMMs ran in bf16
        optimizer = trainer._parts["actor"][1]
        states = {v.dtype for s in optimizer.state.values() for v in s.values() if v.dim() > 0}
        assert {p.dtype for p in trainer.actor.parameters()} == {torch.float32} and states == {torch.float32}
        out[wrap] = (metrics, lp, _weights(trainer))
        trainer.close()
    for a, b, c in zip(out[False][1].logprobs, out[True][1].logprobs, fp32_lp.logprobs, strict=True):
        assert float((a - c).abs().max()) < 0.1 and float((b - c).abs().max()) < 0.1  # bf16 vs fp32 rounding
    for m, r in zip(out[False][0], out[True][0], strict=True):
        assert m["loss"] == pytest.approx(r["loss"], rel=0.05, abs=0.02)
    # the two bf16 trainers take nearly the same steps: their difference is small against the steps themselves
    moved = _norm_diff(out[True][2], initial)
    assert moved > 1e-3
    assert _norm_diff(out[False][2], fp32_weights) < 0.1 * moved  # measured 0.04
    assert _norm_diff(out[False][2], out[True][2]) < 0.1 * moved, (_norm_diff(out[False][2], out[True][2]), moved)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_onednn_linears_train_what_f_linear_trains(model: Path, world: Any, precision: str) -> None:
    """``onednn_linear`` (every linear's GEMMs on oneDNN; in bf16 the weights cast once per step) against
    ``F.linear`` over 3 steps: float32 to rounding; bf16 the same GEMMs, so the same losses — which also
    proves each step's bf16 copies follow the fused AdamW updates (stale copies froze the loss before)."""
    from miles.precision.builtin import BF16, FP32
    from miles.settings.model import TrainSettings
    from miles_fsdp.settings import FSDPSettings
    from miles_fsdp.trainer import FSDPTrainer

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    train = TrainSettings(model_path=str(model), **job.TRAIN)  # type: ignore[arg-type]
    recipe = FP32(None) if precision == "fp32" else BF16(None)
    out = {}
    for onednn in (False, True):
        options = FSDPSettings(wrap_single_rank=False, onednn_linear=onednn)
        trainer = FSDPTrainer(train, options, recipe, world)  # type: ignore[arg-type]
        trainer.setup()
        proj = trainer.actor.model.layers[0].self_attn.q_proj
        assert ("forward" in vars(proj)) is onednn
        metrics, lp = _run(trainer, vocab, range(3))
        if onednn and precision == "bf16":
            cached = proj._miles_cast_cache._value
            assert torch.equal(cached, proj.weight.detach().bfloat16())  # not a stale copy
        out[onednn] = (metrics, lp, _weights(trainer))
        trainer.close()
    (ref_metrics, ref_lp, ref_weights), (metrics, lp, weights) = out[False], out[True]
    tol = 1e-5 if precision == "fp32" else 2e-3
    for m, r in zip(metrics, ref_metrics, strict=True):
        assert m["loss"] == pytest.approx(r["loss"], rel=tol, abs=tol * 1e-2)
    for a, b in zip(lp.logprobs, ref_lp.logprobs, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * 10)
    assert _max_diff(weights, ref_weights) < (1e-5 if precision == "fp32" else 1e-3)


def _group_batch(seed: int, vocab: int) -> Any:
    """Two GRPO-like groups of three samples, each group sharing its prompt, responses of varied lengths."""
    import random

    from miles.training.batch import TrainBatch

    rng = random.Random(seed)
    tokens, prompts, masks, adv, old = [], [], [], [], []
    for _ in range(2):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(6, 10))]
        for _ in range(3):
            r = rng.randint(3, 7)
            tokens.append(prompt + [rng.randrange(3, vocab) for _ in range(r)])
            prompts.append(len(prompt))
            masks.append([1] * r)
            adv.append([rng.gauss(0.0, 1.0)] * r)
            old.append([-6.0] * r)
    return TrainBatch.from_lists(
        tokens=tokens, prompt_lengths=prompts, loss_mask=masks, advantages=adv, old_logprobs=old
    )


def test_shared_prompts_train_what_whole_sequences_train(model: Path, world: Any) -> None:
    """``packed_sdpa`` with ``share_prefixes`` holds each group's prompt once per micro-batch (fewer tokens in
    the forward), and scores and trains as ``sdpa`` over whole sequences, to float32 rounding."""
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    batches = [_group_batch(s, vocab) for s in range(3)]
    out = {}
    for attn in ("sdpa", "packed_sdpa"):
        trainer = _trainer(model, world, attn_implementation=attn, fused_logprobs=False)
        rows = [mb.input_ids.numel() for mb in trainer._micro_batches(batches[0])]
        lp0 = trainer.compute_logprobs(batches[0], temperature=0.7, with_entropy=True)
        metrics = [trainer.train_step(b, job.PolicyGradient(), temperature=job.TEMPERATURE) for b in batches]
        out[attn] = (rows, lp0, metrics, _weights(trainer))
        trainer.close()
    (whole_rows, whole_lp, whole_metrics, whole_w), (rows, lp, metrics, w) = out["sdpa"], out["packed_sdpa"]
    assert sum(rows) < sum(whole_rows)  # the prompts were held once per micro-batch
    torch.testing.assert_close(lp.logprobs, whole_lp.logprobs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lp.entropy, whole_lp.entropy, rtol=1e-5, atol=1e-5)
    for m, r in zip(metrics, whole_metrics, strict=True):
        assert m["loss"] == pytest.approx(r["loss"], rel=1e-5, abs=1e-7)
        assert m["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4)
    assert _max_diff(w, whole_w) < 1e-5


def test_offload_and_onload_leave_training_exactly_as_it_was(model: Path, world: Any) -> None:
    """A colocated run's trainer between two steps: its optimizer state, gradients and then its FSDP2-sharded
    weights leave the device (nothing of them stays resident) and come back; the next step trains exactly
    as if they had never left."""
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    twin = _trainer(model, world, wrap_single_rank=True, fused_logprobs=False)
    twin_metrics, _ = _run(twin, vocab, range(2))
    twin_weights = _weights(twin)
    twin.close()

    trainer = _trainer(model, world, wrap_single_rank=True, fused_logprobs=False)
    first, _ = _run(trainer, vocab, range(1))
    resident = trainer.resident_bytes()
    state = trainer.offload("state")
    assert state > 0 and trainer.offloaded("state")  # Adam's two moments at least
    weights = trainer.offload("weights")
    assert weights > 0 and state + weights == resident and trainer.resident_bytes() == 0
    assert trainer.onload() == resident and trainer.resident_bytes() == resident
    second, _ = _run(trainer, vocab, range(1, 2))
    assert [first[0], second[0]] == twin_metrics
    assert _max_diff(_weights(trainer), twin_weights) == 0.0
    trainer.close()
