"""LoRA on the megatron trainer, 2 gloo ranks at data parallel 2, tensor parallel 2 (+ sequence parallel)
and pipeline parallel 2: adapter-only optimizer state, the base as the KL reference, one adapter whatever
the layout, HF/PEFT-named adapter tensors out (fused q/k/v and gate/up split), logprobs equal to the fsdp
LoRA trainer's and to PEFT's on the same adapter, both exports, resume.

One launch of ``megatron_lora_job.py`` runs the three layouts; one launch runs the fsdp reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import megatron_lora_job as job
import pytest
import torch
from lora_job import make_sequences
from test_trainer import free_port, max_diff, reference_logprobs

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

TOL = 1e-5
N_TENSORS = 2 * 7 * 2  # layers x HF projections x (A, B)


class Run:
    def __init__(self, root: Path, model: Path) -> None:
        self.root, self.model, self.out = root, model, root / "megatron"
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        self.tokens, self.prompts = make_sequences(7, 4, vocab)

    def results(self, layout: str) -> list[dict[str, Any]]:
        return [json.loads((self.out / layout / f"results_rank{r}.json").read_text()) for r in range(2)]

    def logprobs(self, layout: str, name: str) -> list[torch.Tensor]:
        from safetensors.torch import load_file

        out: list[torch.Tensor] = []
        for rank in range(2):  # each rank's sequences, in rank order
            values = load_file(str(self.out / layout / f"{name}_rank{rank}.safetensors"))
            out += [values[str(i)] for i in range(len(values))]
        return out

    def adapter(self, layout: str, name: str = "adapter") -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(str(self.out / layout / f"{name}.safetensors"))


def _run(args: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, job.__file__, *args, "--port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    from miles.testing.models import build_tiny_model

    root = tmp_path_factory.mktemp("lora_megatron")
    model = build_tiny_model(root / "model", "qwen2", seed=5)
    _run(["--model", str(model), "--out", str(root / "megatron")])
    trained = root / "megatron" / job.EXPORTED / "adapter.safetensors"
    _run(["--model", str(model), "--out", str(root / "fsdp"), "--fsdp", str(trained)])
    return Run(root, model)


def _base_logprobs(run: Run) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(run.model, dtype=torch.float32)
    return reference_logprobs(base, run.tokens, run.prompts)


@pytest.mark.parametrize("layout", list(job.LAYOUTS))
def test_only_the_adapter_trains_and_the_reference_is_the_base(run: Run, layout: str) -> None:
    results = run.results(layout)
    pushed = sum(t.numel() for t in run.adapter(layout).values())
    for res in results:
        assert res["has_ref_copy"] is False  # the reference is the actor with its adapters off
        assert res["trainable_names"] and all(n.endswith((".lora_A", ".lora_B")) for n in res["trainable_names"])
        assert res["optimizer_state_numel"] == 2 * res["optimizer_params"]  # AdamW moments of those alone
    if layout == "dp2":  # the distributed optimizer: each replica holds half of the adapter's state
        assert sum(r["optimizer_params"] for r in results) == results[0]["lora_numel"]
        # one A for q/k/v and one for gate/up in Megatron; the adapter out has it once per HF projection
        a = run.adapter(layout)["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].numel()
        assert pushed == results[0]["lora_numel"] + 2 * (2 + 1) * a
    else:
        assert all(r["optimizer_params"] == r["lora_numel"] for r in results)
    want = _base_logprobs(run)
    assert max_diff(run.logprobs(layout, "ref0"), want) <= TOL
    assert max_diff(run.logprobs(layout, "ref"), want) <= TOL  # training left the base untouched
    assert max_diff(run.logprobs(layout, "lp0"), want) > 1e-3  # the random adapter changes the model
    assert max_diff(run.logprobs(layout, "lp"), run.logprobs(layout, "lp0")) > 1e-3  # and it trained


def test_every_layout_starts_from_and_trains_to_the_same_adapter(run: Run) -> None:
    start, end = run.adapter("dp2", "adapter0"), run.adapter("dp2")
    for layout in ("tp2", "pp2"):
        assert set(run.adapter(layout, "adapter0")) == set(start)
        for name, tensor in run.adapter(layout, "adapter0").items():
            assert torch.equal(tensor, start[name]), name  # drawn whole, cut into shards
        trained = run.adapter(layout)
        assert max(float((trained[n] - end[n]).abs().max()) for n in end) <= TOL
        assert max_diff(run.logprobs(layout, "lp"), run.logprobs("dp2", "lp")) <= TOL
        for got, want in zip(run.results(layout)[0]["metrics"], run.results("dp2")[0]["metrics"], strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=TOL, abs=1e-7)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=TOL)
    assert max(float((end[n] - start[n]).abs().max()) for n in end) > 1e-3


def test_the_adapter_out_is_hf_peft_named_with_fused_projections_split(run: Run) -> None:
    adapter = run.adapter("tp2")
    assert len(adapter) == N_TENSORS
    assert all(
        n.startswith("base_model.model.model.layers.") and n.endswith((".lora_A.weight", ".lora_B.weight"))
        for n in adapter
    )
    config = json.loads((run.model / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    for layer in range(2):
        prefix = f"base_model.model.model.layers.{layer}"
        a = {
            p: adapter[f"{prefix}.{'mlp' if p in ('gate_proj', 'up_proj') else 'self_attn'}.{p}.lora_A.weight"]
            for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
        }
        assert torch.equal(a["q_proj"], a["k_proj"]) and torch.equal(a["q_proj"], a["v_proj"])
        assert torch.equal(a["gate_proj"], a["up_proj"])
        assert adapter[f"{prefix}.self_attn.q_proj.lora_B.weight"].shape == (
            config["num_attention_heads"] * head_dim,
            4,
        )
        assert adapter[f"{prefix}.self_attn.k_proj.lora_B.weight"].shape == (
            config["num_key_value_heads"] * head_dim,
            4,
        )


def test_logprobs_equal_the_fsdp_lora_trainers_and_peft_on_the_same_adapter(run: Run) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    got = run.logprobs(job.EXPORTED, "lp")
    fsdp = load_file(str(run.root / "fsdp" / "lp.safetensors"))
    assert max_diff(got, [fsdp[str(i)] for i in range(len(fsdp))]) <= TOL
    base = AutoModelForCausalLM.from_pretrained(run.model, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(run.out / job.EXPORTED / "export" / "adapter"))
    assert max_diff(reference_logprobs(peft, run.tokens, run.prompts), got) <= TOL


def test_exports_hold_the_merged_model_and_the_adapter(run: Run) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    export = run.out / job.EXPORTED / "export"
    saved = load_file(str(export / "adapter" / "adapter_model.safetensors"))
    assert saved.keys() == run.adapter(job.EXPORTED).keys()
    assert all(torch.equal(saved[n], t) for n, t in run.adapter(job.EXPORTED).items())
    config = json.loads((export / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["base_model_name_or_path"] == str(run.model)
    merged, info = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    got = reference_logprobs(merged, run.tokens, run.prompts)
    assert max_diff(got, run.logprobs(job.EXPORTED, "lp")) <= TOL


def test_resume_restores_the_adapter_and_the_step(run: Run) -> None:
    for res in run.results(job.EXPORTED):
        assert res["resumed_step"] == job.SAVE_AFTER
    resumed, saved = run.logprobs(job.EXPORTED, "resumed"), run.logprobs(job.EXPORTED, "saved")
    assert all(torch.equal(a, b) for a, b in zip(resumed, saved, strict=True))
