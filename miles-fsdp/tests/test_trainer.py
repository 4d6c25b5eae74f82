"""The fsdp trainer on real gloo worlds of 1 and 2 CPU ranks, against references computed here.

One spawned job per world size (``fsdp_job.py``) runs every check and writes its results; each test below
asserts on those files. The references are written independently of miles_fsdp: plain Hugging Face
forwards, one sequence at a time, and a plain torch AdamW loop without FSDP.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import fsdp_job as job
import pytest
import torch

from miles.net import free_port

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


class JobResult:
    def __init__(self, world_size: int, model: Path, out: Path) -> None:
        self.world_size, self.model, self.out = world_size, model, out
        self.results: list[dict[str, Any]] = [
            json.loads((out / f"results_rank{r}.json").read_text()) for r in range(world_size)
        ]
        self.vocab = json.loads((model / "config.json").read_text())["vocab_size"]

    def tensors(self, prefix: str) -> dict[int, torch.Tensor]:
        """Per-sequence tensors written by every rank, keyed by the sequence's index in the batch."""
        from safetensors.torch import load_file

        merged: dict[int, torch.Tensor] = {}
        for r in range(self.world_size):
            merged.update({int(k): v for k, v in load_file(str(self.out / f"{prefix}_rank{r}.safetensors")).items()})
        return merged


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    """World 1: a Llama with tied embeddings. World 2: a Qwen2, activation checkpointing on."""
    from miles.testing.models import build_tiny_model

    world_size: int = request.param
    root = tmp_path_factory.mktemp(f"fsdp_world{world_size}")
    if world_size == 1:
        model = build_tiny_model(root / "model", "llama", seed=3, tie_word_embeddings=True)
    else:
        model = build_tiny_model(root / "model", "qwen2", seed=4)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    script = Path(job.__file__)
    cmd = [
        sys.executable,
        str(script),
        "--world-size",
        str(world_size),
        "--model",
        str(model),
        "--out",
        str(root / "out"),
        "--port",
        str(free_port()),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"job failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    return JobResult(world_size, model, root / "out")


# -- independent references ------------------------------------------------------------------------
def _hf_model(path: Path, attn: str = "eager") -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)


def _hf_logprobs(model: Any, tokens: list[int], prompt: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, no packing: logprobs and entropy of its response tokens."""
    logits = model(torch.tensor([tokens])).logits[0, prompt - 1 : -1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    target = torch.tensor(tokens[prompt:])
    return logp.gather(-1, target[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def _row(batch: Any, name: str, i: int) -> torch.Tensor:
    """Sequence ``i``'s values of a per-token field of a packed batch."""
    rows = batch.rows(name)
    assert rows is not None, name
    return rows[i]


def _reference_lr(step: int) -> float:
    t = job.TRAIN
    warmup, total = t["warmup_steps"], t["num_rollouts"]
    if step < warmup:
        return t["lr"] * (step + 1) / warmup
    progress = (step - warmup) / (total - warmup)
    floor = t["min_lr"] / t["lr"]
    return t["lr"] * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def _reference_training(model_path: Path, vocab: int) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    """Plain torch: whole batch in one process, one sequence per forward, AdamW, clip_grad_norm_.

    Uses the trainer's attention kernel (sdpa): AdamW's first steps normalise each gradient element, so
    kernel-level rounding differences (eager vs sdpa, ~1e-7 on logits) would show up at lr scale.
    """
    model = _hf_model(model_path, attn="sdpa")
    t = job.TRAIN
    opt = torch.optim.AdamW(
        model.parameters(), lr=t["lr"], betas=t["adam_betas"], eps=t["adam_eps"], weight_decay=t["weight_decay"]
    )
    metrics = []
    for step, batch in enumerate(job.step_batches(vocab)):
        for group in opt.param_groups:
            group["lr"] = _reference_lr(step)
        mode = job.AGGREGATIONS[step]
        n_tokens = float(batch.loss_mask.sum())
        loss = torch.zeros(())
        for i in range(len(batch)):
            lp, _ = _hf_logprobs(model, batch.sequence(i).tolist(), int(batch.prompt_lengths[i]), job.TEMPERATURE)
            mask = _row(batch, "loss_mask", i)
            per_token = -_row(batch, "advantages", i) * torch.exp(lp - _row(batch, "old_logprobs", i))
            total = (per_token * mask).sum()
            if mode == "token_mean":
                loss = loss + total / n_tokens
            elif mode == "seq_mean_token_mean":
                loss = loss + total / mask.sum() / len(batch)
            else:
                loss = loss + total / job.SEQ_LEN_NORM / len(batch)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t["grad_clip"])
        metrics.append(
            {
                "loss": float(loss.detach()),
                "grad_norm": float(norm),
                "lr": _reference_lr(step),
                "trained_tokens": n_tokens,
            }
        )
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, metrics


def _load_dir(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    return weights


# -- tests -----------------------------------------------------------------------------------------
def test_sharded_training_equals_unsharded_reference(run: JobResult) -> None:
    reference, ref_metrics = _reference_training(run.model, run.vocab)
    trained = _load_dir(run.out / "hf_full")
    assert set(trained) <= set(reference)
    worst = max(float((trained[k] - reference[k]).abs().max()) for k in trained)
    assert worst <= 1e-6, f"max |sharded - reference| = {worst}"
    moved = max(float((trained[k] - _load_dir(run.model)[k]).abs().max()) for k in trained)
    assert moved > 1e-4  # the weights did train
    for got, want in zip(run.results[0]["metrics"], ref_metrics, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
        assert got["lr"] == pytest.approx(want["lr"], rel=1e-12)
        assert got["trained_tokens"] == want["trained_tokens"]
    # metrics are reduced over ranks: every rank reports the same numbers
    for other in run.results[1:]:
        assert other["metrics"] == run.results[0]["metrics"]


def test_step_metrics_include_logprob_mismatch(run: JobResult) -> None:
    batch = job.step_batches(run.vocab)[0]
    model = _hf_model(run.model)
    diff, count = 0.0, 0
    for i in range(len(batch)):
        lp, _ = _hf_logprobs(model, batch.sequence(i).tolist(), int(batch.prompt_lengths[i]), job.TEMPERATURE)
        mask = _row(batch, "loss_mask", i)
        diff += float(((lp.detach() - _row(batch, "rollout_logprobs", i)).abs() * mask).sum())
        count += int(mask.sum())
    first = run.results[0]["metrics"][0]
    assert first["train_rollout_logprob_abs_diff"] == pytest.approx(diff / count, rel=1e-5)
    assert first["tokens"] == batch.num_tokens
    assert first["ratio"] > 0


def test_resume_from_checkpoint_is_bitwise_identical(run: JobResult) -> None:
    full, resumed = _load_dir(run.out / "hf_full"), _load_dir(run.out / "hf_resumed")
    assert set(full) == set(resumed)
    for name in full:
        assert torch.equal(full[name], resumed[name]), name
    assert run.results[0]["step_after_resume"] == job.SAVE_AFTER
    assert run.results[0]["resumed_metrics"] == run.results[0]["metrics"][job.SAVE_AFTER :]


def test_compute_logprobs_equals_hf_forward(run: JobResult) -> None:
    model = _hf_model(run.model)
    batch = job.eval_batch(run.vocab, run.world_size)
    logprobs, entropy, ref = run.tensors("lp0"), run.tensors("ent0"), run.tensors("ref")
    assert sorted(logprobs) == list(range(len(batch)))
    for i in range(len(batch)):
        want_lp, want_ent = _hf_logprobs(
            model, batch.sequence(i).tolist(), int(batch.prompt_lengths[i]), job.EVAL_TEMPERATURE
        )
        assert logprobs[i].dtype == torch.float32 and logprobs[i].shape == want_lp.shape
        torch.testing.assert_close(logprobs[i], want_lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy[i], want_ent, atol=1e-5, rtol=0)
        # the frozen reference model still scores like the initial weights after training
        torch.testing.assert_close(ref[i], logprobs[i], atol=1e-6, rtol=0)


def test_hf_export_reloads_with_strict_keys_and_resumes(run: JobResult) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = run.out / "hf_full"
    model, info = AutoModelForCausalLM.from_pretrained(
        export, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert AutoTokenizer.from_pretrained(export).chat_template
    batch = job.eval_batch(run.vocab, run.world_size)
    resumed = run.tensors("lp_hf")
    for i in range(len(batch)):
        want, _ = _hf_logprobs(model, batch.sequence(i).tolist(), int(batch.prompt_lengths[i]), job.EVAL_TEMPERATURE)
        torch.testing.assert_close(resumed[i], want, atol=1e-5, rtol=0)


def test_iter_weights_yields_every_parameter_once_with_hf_names(run: JobResult) -> None:
    model = _hf_model(run.model)
    expected = {name: list(p.shape) for name, p in model.named_parameters()}
    buckets = run.results[0]["weight_buckets"]
    names = [name for bucket in buckets for name, _ in bucket]
    assert len(names) == len(set(names))
    assert {name: shape for bucket in buckets for name, shape in bucket} == expected
    assert len(buckets) > 1  # 20 kB buckets split the model
    for other in run.results[1:]:  # other ranks join every gather but receive empty buckets
        assert len(other["weight_buckets"]) == len(buckets)
        assert all(bucket == [] for bucket in other["weight_buckets"])


def test_weight_shards_tile_the_full_weights_without_a_gather(run: JobResult) -> None:
    """Each rank's ``iter_weight_shards`` (after training): disjoint row blocks that, put together by
    their offsets, are exactly the weights ``export_hf`` gathered at the same point."""
    import json

    from safetensors.torch import load_file

    full = _load_dir(run.out / "hf_full")
    rebuilt = {name: torch.full_like(t, float("nan")) for name, t in full.items()}
    covered = {name: 0 for name in full}
    for rank in range(len(run.results)):
        folder = run.out / f"shards_rank{rank}"
        tensors = load_file(str(folder / "shards.safetensors"))
        places = json.loads((folder / "places.json").read_text())
        assert set(places) == set(full) - {"lm_head.weight"} or set(places) == set(full)
        for name, shard in tensors.items():
            place = places[name]
            assert place["global_shape"] == list(full[name].shape)
            box = tuple(slice(o, o + n) for o, n in zip(place["offsets"], shard.shape, strict=True))
            assert bool(torch.isnan(rebuilt[name][box]).all())  # no element is held by two ranks
            rebuilt[name][box] = shard
            covered[name] += shard.numel()
        if run.world_size > 1:  # a real share, not the whole model
            assert 0 < sum(t.numel() for t in tensors.values()) < sum(t.numel() for t in full.values())
    for name in places:
        assert covered[name] == full[name].numel()
        assert torch.equal(rebuilt[name], full[name]), name


def test_bf16_params_train_with_fp32_master_weights(run: JobResult) -> None:
    result = run.results[0]
    assert result["bf16_master_dtypes"] == ["torch.float32"]
    fp32, bf16 = run.tensors("lp0"), run.tensors("lp_bf16")
    worst = max(float((fp32[i] - bf16[i]).abs().max()) for i in fp32)
    assert 0 < worst < 0.1  # bf16 compute differs a little, not a lot
    assert math.isfinite(result["bf16_metrics"]["loss"])
    assert result["bf16_metrics"]["loss"] == pytest.approx(result["metrics"][0]["loss"], abs=5e-3)


def test_critic_values_regress_towards_returns(run: JobResult) -> None:
    result = run.results[0]
    assert result["value_shapes_ok"]
    mse = result["critic_mse"]
    assert mse[-1] < 0.75 * mse[0], mse
    assert all(m["critic_grad_norm"] > 0 for m in result["critic_metrics"])
