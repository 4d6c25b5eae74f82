"""End to end with the Megatron-Core trainer: ``miles train`` with ``train.backend = "megatron"`` on 2 CPU
ranks (tensor parallel 2 + sequence parallel), a real engine process, weight pushes over the broadcast
and the disk transports with verification, a Megatron distributed checkpoint and a bit-identical resume,
and the HF export reloaded with strict keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.testing.runs import children_of_run, hf_weights, read_metrics, run_miles, write_run_config

pytestmark = pytest.mark.slow


MEGATRON = """
[train.backend]
name = "megatron"
tensor_parallel = 2
sequence_parallel = true

[checkpoint]
save_interval = 2

[rollout.engine]
name = "local"
enable_deterministic_inference = true

[[reward.functions]]
name = "regex"
pattern = '\\d'
"""

TIMINGS = ("time/", "seconds", "per_second")


def megatron_config(tmp_path: Path, model: Path, data: Path, run_dir: Path, *, transport: str) -> Path:
    config = write_run_config(tmp_path, model, data, run_dir, MEGATRON, ranks=2, transport=transport, rollouts=3)
    # a reward that varies between the samples of a random tiny model (a digit in the response), so the
    # advantages are not all zero and every step really trains
    text = config.read_text().replace(
        '[[reward.functions]]\nname = "length_penalty"\nmax_length = 6\nbuffer_length = 4\nmode = "linear"\n', ""
    )
    config.write_text(text)
    return config


def test_megatron_broadcast_checkpoint_and_exact_resume_over_disk(
    tmp_path: Path, tiny_model: Path, prompts: Path
) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    full_dir = tmp_path / "full"
    out = run_miles("train", str(megatron_config(tmp_path, tiny_model, prompts, full_dir, transport="broadcast")))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = read_metrics(full_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["weight_sync/verified"] == 1.0 and row["weight_sync/verified_tensors"] > 0
        # the engine's logprobs against megatron's (pooled over the TP group, each rank's share back)
        assert 0.0 <= row["fidelity/train_rollout_logprob_abs_diff"] < 1e-4
        assert row["rollout/prefix_cache_hit_rate"] > 0.5
    assert any(row["train/grad_norm"] > 0 for row in rows[:2])  # the checkpoint holds a trained state
    trainer_ckpt = full_dir / "checkpoints" / "step_000002" / "trainer"
    assert (trainer_ckpt / "metadata.json").exists()  # megatron.core.dist_checkpointing
    # 16 samples per rollout in optimizer steps of 8: 2 steps per rollout, 4 at the checkpoint
    assert json.loads((trainer_ckpt / "trainer_state.json").read_text())["step"] == 4
    _, info = AutoModelForCausalLM.from_pretrained(full_dir / "hf", output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    initial = load_file(str(tiny_model / "model.safetensors"))
    exported = hf_weights(full_dir / "hf")
    assert exported.keys() == initial.keys()
    assert any(not torch.equal(exported[k], initial[k]) for k in initial)  # type: ignore[arg-type]
    assert children_of_run(full_dir) == []

    # resume from step 2 into a new run directory, the pushes now over the disk transport: with
    # deterministic inference every metric but the timings and the final weights are bit for bit the same
    part_dir = tmp_path / "part"
    config = megatron_config(tmp_path, tiny_model, prompts, part_dir, transport="disk")
    out = run_miles("train", str(config), "--resume", str(full_dir / "checkpoints" / "step_000002"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    resumed = read_metrics(part_dir)
    assert [r["step"] for r in resumed] == [3]
    assert resumed[0]["weight_sync/verified"] == 1.0
    compared = [key for key in rows[-1] if not any(s in key for s in TIMINGS)]
    assert "fidelity/train_rollout_logprob_abs_diff" in compared and "train/grad_norm" in compared
    for key in compared:
        assert resumed[0][key] == rows[-1][key], key
    part_w = hf_weights(part_dir / "hf")
    assert part_w.keys() == exported.keys()
    for name in exported:
        assert torch.equal(exported[name], part_w[name]), name  # type: ignore[arg-type]
    assert children_of_run(part_dir) == []
