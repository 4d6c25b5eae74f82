"""LoRA on the fsdp trainer, 2 gloo ranks: adapter-only optimizer state, the base as the KL reference,
adapter-only weights out, resume, and both exports — against plain transformers / PEFT references."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lora_job as job
import pytest
import torch

from miles.net import free_port

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def reference_logprobs(model: Any, tokens: list[list[int]], prompts: list[int]) -> list[torch.Tensor]:
    """Each response token's logprob, one sequence per plain HF forward."""
    out = []
    with torch.no_grad():
        for seq, p in zip(tokens, prompts, strict=True):
            logits = model(input_ids=torch.tensor([seq])).logits[0].float()
            logp = torch.log_softmax(logits[p - 1 : len(seq) - 1], dim=-1)
            out.append(logp.gather(1, torch.tensor(seq[p:])[:, None])[:, 0])
    return out


def load(path: Path) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    values = load_file(str(path))
    return [values[str(i)] for i in range(len(values))]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from miles.testing.models import build_tiny_model

    root = tmp_path_factory.mktemp("lora_fsdp")
    model = build_tiny_model(root / "model", "qwen2", seed=5)
    out = root / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, job.__file__, "--world-size", "2", "--model", str(model), "--out", str(out)]
    subprocess.run([*cmd, "--port", str(free_port())], check=True, env=env, timeout=400)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    tokens, prompts = job.make_sequences(7, 4, vocab)
    results = [json.loads((out / f"results_rank{r}.json").read_text()) for r in range(2)]
    return {"model": model, "out": out, "tokens": tokens, "prompts": prompts, "results": results}


def test_only_adapter_parameters_train_and_the_reference_is_the_base(run: dict[str, Any]) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    res, out = run["results"][0], run["out"]
    assert res["has_ref_copy"] is False  # no second model: the reference is the actor with adapters off
    assert res["trainable_names"] and all(".lora_A." in n or ".lora_B." in n for n in res["trainable_names"])
    pushed = load_file(str(out / "pushed.safetensors"))
    adapter_numel = sum(t.numel() for t in pushed.values())
    for r in run["results"]:  # (DTensor) parameters and AdamW moments of the adapter alone
        assert r["optimizer_params"] == adapter_numel
        assert r["optimizer_state_numel"] == 2 * adapter_numel
    base = AutoModelForCausalLM.from_pretrained(run["model"], dtype=torch.float32)
    want = reference_logprobs(base, run["tokens"], run["prompts"])
    assert max_diff(load(out / "ref0.safetensors"), want) <= 1e-5
    assert max_diff(load(out / "ref.safetensors"), want) <= 1e-5  # training left the base untouched
    assert max_diff(load(out / "lp0.safetensors"), want) > 1e-3  # the random adapter changes the model
    assert max_diff(load(out / "lp.safetensors"), load(out / "lp0.safetensors")) > 1e-3  # and it trained


def test_weights_out_are_the_adapter_in_peft_naming(run: dict[str, Any]) -> None:
    from safetensors.torch import load_file

    pushed = load_file(str(run["out"] / "pushed.safetensors"))
    saved = load_file(str(run["out"] / "export" / "adapter" / "adapter_model.safetensors"))
    assert sorted(pushed) == sorted(saved)
    assert all(n.startswith("base_model.model.model.layers.") for n in pushed)
    assert {n.rsplit(".", 2)[-2] for n in pushed} == {"lora_A", "lora_B"}
    assert len(pushed) == 2 * 7 * 2  # 7 target modules x 2 layers x (A, B)
    for name, tensor in pushed.items():
        torch.testing.assert_close(saved[name], tensor, rtol=0, atol=0)


def test_adapter_export_reloads_in_peft_with_the_trainers_logprobs(run: dict[str, Any]) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(run["model"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(run["out"] / "export" / "adapter"))
    got = reference_logprobs(model, run["tokens"], run["prompts"])
    assert max_diff(got, load(run["out"] / "lp.safetensors")) <= 1e-5


def test_merged_export_reloads_strict_with_the_trainers_logprobs(run: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM

    merged, info = AutoModelForCausalLM.from_pretrained(
        run["out"] / "export", dtype=torch.float32, output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    got = reference_logprobs(merged, run["tokens"], run["prompts"])
    assert max_diff(got, load(run["out"] / "lp.safetensors")) <= 1e-5


def test_resume_restores_adapter_and_optimizer_step(run: dict[str, Any]) -> None:
    for res in run["results"]:
        assert res["resumed_step"] == 1
        assert res["resume_max_diff"] <= 1e-6
