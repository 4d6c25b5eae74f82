"""``miles train`` with LoRA: GRPO on a tiny model, 2 gloo trainer ranks and one local engine; every push
carries only the adapter and is verified; a resumed run continues from the checkpoint; the final
exports hold the merged model and the adapter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


LENGTH = """
[[reward.functions]]
name = "length_penalty"
max_length = 6
buffer_length = 4
mode = "linear"
"""
DIGIT = """
[[reward.functions]]
name = "regex"
pattern = '\\d'
"""
"""A reward that varies between a random tiny model's samples (a digit in the response)."""


def _train(config: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "miles", "train", str(config), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def _config(
    tmp_path: Path, *, rollouts: int, backend: str = "", init: str = "default", reward: str = LENGTH
) -> tuple[Path, Path, Path]:
    """A LoRA GRPO run on a tiny model (2 trainer ranks, one local engine); ``backend`` adds TOML for
    ``[train.backend]``, ``init`` is the adapter's, ``reward`` the reward table. Returns the config file,
    the model and the run directory."""
    from miles.testing.models import build_tiny_model

    model = build_tiny_model(tmp_path / "model", "qwen2", seed=0)
    data = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "label": str(a + b)}
        for a in range(4)
        for b in range(4)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text(
        textwrap.dedent(
            f"""
            [cluster]
            trainer_ranks = 2
            num_engines = 1

            [data]
            path = "{data}"

            [rollout]
            rollout_batch_size = 2
            n_samples_per_prompt = 4
            max_new_tokens = 6

            [rollout.engine]
            name = "local"
            attention_backend = "sdpa"

            [train]
            model_path = "{model}"
            num_rollouts = {rollouts}
            global_batch_size = 8
            lr = 1e-2

            [train.adapter]
            name = "lora"
            r = 4
            alpha = 8
            init = "{init}"

            [algorithm]
            name = "grpo"

            [transport]
            name = "lora"

            [precision]
            name = "fp32"

            [log]
            run_dir = "{run_dir}"

            [checkpoint]
            save_interval = 1
            """
        )
        + reward
        + backend
    )
    return config, model, run_dir


def test_lora_grpo_pushes_adapters_verifies_resumes_and_exports(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    config, model, run_dir = _config(tmp_path, rollouts=2)
    out = _train(config)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["weight_sync/verified"] for m in metrics] == [1.0, 1.0]
    n_lora = 2 * 7 * 2  # layers x target modules x (A, B)
    base_bytes = sum(t.numel() * 4 for t in load_file(str(model / "model.safetensors")).values())
    for m in metrics:
        assert m["weight_sync/verified_tensors"] == n_lora and m["weight_sync/tensors"] == n_lora
        assert 0 < m["weight_sync/bytes"] < base_bytes / 10  # adapter only
    # the second step's rollouts ran the adapter pushed after the first: rollout logprobs match the trainer's
    assert metrics[1]["fidelity/train_rollout_logprob_abs_diff"] < 1e-4
    pushed = sorted((run_dir / "lora").iterdir())
    assert [p.name for p in pushed] == ["policy-v1", "policy-v2"]
    export = next(p for p in run_dir.rglob("adapter_model.safetensors") if p.parent.name == "adapter")
    assert set(load_file(str(export))) == set(load_file(str(pushed[-1] / "adapter_model.safetensors")))
    merged_dir = export.parent.parent
    from transformers import AutoModelForCausalLM

    merged, info = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    base = load_file(str(model / "model.safetensors"))
    changed = [n for n, p in merged.state_dict().items() if n in base and not torch.equal(p, base[n])]
    assert changed and all(n.endswith("_proj.weight") for n in changed)  # only the adapted projections moved

    # resume from the run directory for one more rollout: it starts after step 2 and pushes version 3
    out = _train(config, "--resume", str(run_dir), "--set", "train.num_rollouts=3")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [int(m["step"]) for m in metrics][-1] == 3 and metrics[-1]["weight_sync/verified"] == 1.0
    # the resumed run pushed the checkpoint's adapter before generating: its rollouts ran that adapter
    assert metrics[-1]["fidelity/train_rollout_logprob_abs_diff"] < 1e-4
    assert [p.name for p in sorted((run_dir / "lora").iterdir())] == ["policy-v2", "policy-v3"]


def test_lora_grpo_on_the_megatron_trainer_pushes_the_adapter_the_engine_serves(tmp_path: Path) -> None:
    """The megatron trainer at tensor parallel 2 with sequence parallelism, from a random adapter: each push
    carries the adapter in HF/PEFT naming (the fused projections split) and is verified, and the engine's
    logprobs with the pushed adapter are the trainer's, token for token."""
    from safetensors.torch import load_file

    backend = '\n[train.backend]\nname = "megatron"\ntensor_parallel = 2\nsequence_parallel = true\n'
    config, model, run_dir = _config(tmp_path, rollouts=2, backend=backend, init="random", reward=DIGIT)
    out = _train(config, "--set", 'log.trainer_logprobs="always"')  # the mismatch's maximum too
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["weight_sync/verified"] for m in metrics] == [1.0, 1.0]
    n_lora = 2 * 7 * 2  # layers x HF projections x (A, B)
    for m in metrics:
        assert m["weight_sync/verified_tensors"] == n_lora and m["weight_sync/tensors"] == n_lora
    assert all(m["train/grad_norm"] > 0 for m in metrics)  # seeded sampling: the digit reward varies
    assert metrics[0]["fidelity/train_rollout_logprob_abs_diff"] > 1e-2  # the first rollouts ran the base
    # the second step's rollouts ran the adapter pushed after the first: the engine's logprobs are the trainer's
    assert metrics[1]["fidelity/train_rollout_logprob_abs_diff_max"] <= 1e-5
    pushed = sorted((run_dir / "lora").iterdir())
    assert [p.name for p in pushed] == ["policy-v1", "policy-v2"]
    adapter = load_file(str(pushed[-1] / "adapter_model.safetensors"))
    a = "base_model.model.model.layers.0.self_attn.{}_proj.lora_A.weight"
    assert torch.equal(adapter[a.format("q")], adapter[a.format("k")])  # one A for Megatron's fused QKV
    base = load_file(str(model / "model.safetensors"))
    assert adapter[a.format("q")].shape == (4, base["model.layers.0.self_attn.q_proj.weight"].shape[1])
