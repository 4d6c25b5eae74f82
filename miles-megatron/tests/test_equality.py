"""The proof that the backend is right: megatron at TP=2 (+ sequence parallel), PP=2 and DP=2 (distributed
optimizer, full recompute, its steps on another thread than its set-up), each on 2 gloo ranks, trains
exactly as miles-fsdp does on the same tiny model, batches and algorithms (4 fp32 optimizer steps,
micro-batches of 30 tokens, four aggregations, a PPO critic trained on two of the steps); its logprobs
equal a plain HF forward; the critic's values and a top-k distillation step equal miles-fsdp's, the
student's top-k logprobs an HF gather; a tiny Qwen2-MoE at EP=2 equals HF's forward.

One launch of ``megatron_job.py`` runs the three layouts and the MoE case one after the other; one
launch runs the miles-fsdp reference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import megatron_job as job
import pytest
import torch
from helpers import load_dir, run_script

from miles.net import free_port

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

LAYOUTS = list(job.LAYOUTS)
TOL = 1e-5


class Run:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.model = root / "qwen2"
        self.moe = root / "qwen2_moe"
        self.fsdp = json.loads((root / "fsdp" / "results.json").read_text())
        self.vocab = job._vocab(str(self.model))

    def ranks(self, layout: str) -> list[dict[str, Any]]:
        return [json.loads((self.root / "megatron" / layout / f"results_rank{r}.json").read_text()) for r in range(2)]

    def logprobs(self, layout: str, key: str = "logprobs") -> list[list[float]]:
        return [row for rank in self.ranks(layout) for row in rank[key]]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    from miles.testing.models import build_tiny_model

    root = tmp_path_factory.mktemp("equality")
    build_tiny_model(root / "qwen2", "qwen2", seed=4)
    build_tiny_model(root / "qwen2_moe", "qwen2_moe", seed=5)
    script = str(Path(job.__file__))
    proc = run_script(
        [script, "--fsdp", "--model", str(root / "qwen2"), "--out", str(root / "fsdp"), "--port", str(free_port())]
    )
    assert proc.returncode == 0, f"fsdp reference failed:\n{proc.stderr[-6000:]}"
    args = ["--model", str(root / "qwen2"), "--moe-model", str(root / "qwen2_moe"), "--out", str(root / "megatron")]
    proc = run_script([script, *args, "--port", str(free_port())])
    assert proc.returncode == 0, f"megatron job failed:\n{proc.stderr[-8000:]}"
    return Run(root)


def _hf_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


def _hf_logprobs(
    model: Any, batch: Any, temperature: float, *, kept: list[list[int]] | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One sequence at a time, no packing: logprobs and entropy of the response tokens (with ``kept``, one
    set per response token, renormalised over it)."""
    lps, ents = [], []
    sets = iter(kept or [])
    with torch.no_grad():
        for tokens, prompt in zip(batch.sequences(), batch.prompt_lengths.tolist(), strict=True):
            logits = model(torch.tensor([tokens])).logits[0, prompt - 1 : -1].float() / temperature
            if kept is not None:
                outside = torch.ones_like(logits, dtype=torch.bool)
                for row in range(logits.shape[0]):
                    outside[row, next(sets)] = False
                logits = logits.masked_fill(outside, float("-inf"))
            logp = torch.log_softmax(logits, dim=-1)
            lps.append(logp.gather(-1, torch.tensor(tokens[prompt:])[:, None])[:, 0])
            ents.append(-(logp.exp() * logp).sum(-1))
    return lps, ents


def _max_diff(a: list[list[float]], b: list[torch.Tensor] | list[list[float]]) -> float:
    return max(float((torch.tensor(x) - torch.as_tensor(y)).abs().max()) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_training_equals_miles_fsdp(run: Run, layout: str) -> None:
    ranks = run.ranks(layout)
    for step, (got, want) in enumerate(zip(ranks[0]["metrics"], run.fsdp["metrics"], strict=True)):
        assert got["loss"] == pytest.approx(want["loss"], rel=TOL, abs=1e-7)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=TOL)
        assert got["lr"] == pytest.approx(want["lr"], rel=1e-12)
        assert got["trained_tokens"] == want["trained_tokens"] and got["sequences"] == want["sequences"]
        critic = step in job.CRITIC_STEPS  # the value head trained through the same loss
        names = ("value_loss", "critic_grad_norm", "critic_lr") if critic else ("ratio",)
        assert ("critic_grad_norm" in got) == critic and ("critic_grad_norm" in want) == critic
        for name in (*names, "entropy", "train_rollout_logprob_abs_diff"):
            assert got[name] == pytest.approx(want[name], rel=TOL), name
    assert ranks[1]["metrics"] == ranks[0]["metrics"]  # reduced over ranks
    fsdp, megatron = load_dir(run.root / "fsdp" / "hf_full"), load_dir(run.root / "megatron" / layout / "hf_full")
    assert set(megatron) == set(fsdp)
    worst = max(float((megatron[k] - fsdp[k]).abs().max()) for k in fsdp)
    assert worst <= TOL, f"max |megatron - fsdp| = {worst}"
    initial = load_dir(run.model)
    assert max(float((megatron[k] - initial[k]).abs().max()) for k in initial) > 1e-4  # it did train


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logprobs_and_entropy_equal_a_hf_forward(run: Run, layout: str) -> None:
    lps, ents = _hf_logprobs(_hf_model(run.model), job.eval_batch(run.vocab), job.EVAL_TEMPERATURE)
    assert _max_diff(run.logprobs(layout), lps) <= TOL
    assert _max_diff(run.logprobs(layout, "entropy"), ents) <= TOL
    assert _max_diff(run.logprobs(layout), run.fsdp["logprobs"]) <= TOL


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sampling_mask_replay_scores_the_kept_sets(run: Run, layout: str) -> None:
    """Sampling-mask replay (issue 40) on megatron: with each token's kept set (top-k's, spread over both
    tensor-parallel halves of the vocabulary) the logprobs are HF's renormalised over the set, on every
    layout."""
    batch = job.eval_batch(run.vocab)
    lps, _ = _hf_logprobs(_hf_model(run.model), batch, job.EVAL_TEMPERATURE, kept=job.kept_sets(batch, run.vocab))
    assert _max_diff(run.logprobs(layout, "kept_logprobs"), lps) <= TOL
    assert _max_diff(run.logprobs(layout), lps) > 0.1  # the whole vocabulary's logprobs are far from them


def test_reference_model_keeps_the_initial_weights(run: Run) -> None:
    assert _max_diff(run.logprobs("tp2", "ref_logprobs"), run.logprobs("tp2")) <= 1e-6


@pytest.mark.parametrize("layout", LAYOUTS)
def test_resume_from_checkpoint_is_bitwise_identical(run: Run, layout: str) -> None:
    full = load_dir(run.root / "megatron" / layout / "hf_full")
    resumed = load_dir(run.root / "megatron" / layout / "hf_resumed")
    assert set(full) == set(resumed)
    for name in full:
        assert torch.equal(full[name], resumed[name]), name
    rank0 = run.ranks(layout)[0]
    assert rank0["step_after_resume"] == job.SAVE_AFTER
    assert rank0["resumed_metrics"] == rank0["metrics"][job.SAVE_AFTER :]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_iter_weights_gives_the_hf_model_its_names_and_shapes(run: Run, layout: str) -> None:
    ranks = run.ranks(layout)
    names = {n: tuple(s) for bucket in ranks[0]["buckets"] for n, s in bucket}
    hf = {n: tuple(p.shape) for n, p in _hf_model(run.model).named_parameters()}
    assert names == hf
    assert len(ranks[0]["buckets"]) > 1  # 20 kB buckets
    assert len(ranks[1]["buckets"]) == len(ranks[0]["buckets"]) and not any(ranks[1]["buckets"])


def test_export_reloads_strict(run: Run) -> None:
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(run.root / "megatron" / "pp2" / "hf_full", output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert (run.root / "megatron" / "pp2" / "hf_full" / "tokenizer.json").exists()


def test_moe_at_expert_parallel_2_equals_hf(run: Run) -> None:
    from transformers import AutoModelForCausalLM

    model = _hf_model(run.moe)
    lps, _ = _hf_logprobs(model, job.eval_batch(job._vocab(str(run.moe))), job.EVAL_TEMPERATURE)
    assert _max_diff(run.logprobs("ep2"), lps) <= TOL
    ranks = run.ranks("ep2")
    names = {n: tuple(s) for bucket in ranks[0]["buckets"] for n, s in bucket}
    assert names == {n: tuple(p.shape) for n, p in model.named_parameters()}  # fused experts, as in memory
    assert ranks[0]["metrics"][0]["grad_norm"] > 0 and ranks[1]["metrics"] == ranks[0]["metrics"]
    _, info = AutoModelForCausalLM.from_pretrained(run.root / "megatron" / "ep2" / "hf", output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


def test_moe_routing_replay_at_expert_parallel_2_equals_hf_with_the_same_experts(run: Run) -> None:
    """R3 on Megatron-Core: the routers take the engine's experts (a routing the model would not choose), so
    the logprobs equal an HF forward forced to the same experts (miles-fsdp's router patch), differ from
    the model's own routing, and the step reports how rarely the router agreed."""
    from miles.training.routing import ROUTED_EXPERTS
    from miles_fsdp.routing import patch_routers

    model = _hf_model(run.moe)
    state = patch_routers(model, replay=True)
    assert state is not None
    forced = job.with_forced_routing(job.eval_batch(job._vocab(str(run.moe))), str(run.moe))
    want = []
    with torch.no_grad():
        for i, (tokens, prompt) in enumerate(zip(forced.sequences(), forced.prompt_lengths.tolist(), strict=True)):
            state.set_rows(forced.token_tensor_rows(ROUTED_EXPERTS, [i]))
            logits = model(torch.tensor([tokens])).logits[0, prompt - 1 : -1].float() / job.EVAL_TEMPERATURE
            want.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[prompt:])[:, None])[:, 0])
    got = run.logprobs("ep2", "r3_logprobs")
    assert _max_diff(got, want) <= TOL
    assert _max_diff(got, run.logprobs("ep2")) > 1e-3  # the forced experts are not the model's own
    for name in job.R3_LAYOUTS:  # TP=2 with sequence parallel (each rank its slice of the tokens), PP=2
        assert _max_diff(run.logprobs("ep2", f"{name}_logprobs"), want) <= TOL, name
    for rank in run.ranks("ep2"):
        metrics = rank["r3_metrics"]
        assert metrics["grad_norm"] > 0 and 0.0 <= metrics["fidelity/routing_agreement"] < 0.5
        assert metrics["fidelity/routing_agreement_layer0"] >= 0.0


def test_a_nan_loss_refuses_the_step_on_every_rank(run: Run) -> None:
    """NaN advantages at EP=2: each rank refuses the optimizer step naming it; step count and weights kept."""
    for rank in run.ranks("ep2"):
        nan = rank["nan_step"]
        assert nan["error"] is not None and nan["error"].startswith(f"train step {nan['step_before'] + 1}: loss is nan")
        assert nan["step_after"] == nan["step_before"] and nan["weights_unchanged"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_critic_values_equal_miles_fsdp(run: Run, layout: str) -> None:
    """After two critic steps (one before the checkpoint, one after the resume) the values agree."""
    assert _max_diff(run.logprobs(layout, "values"), run.fsdp["values"]) <= TOL


@pytest.mark.parametrize("layout", LAYOUTS)
def test_topk_distillation_equals_miles_fsdp_and_an_hf_gather(run: Run, layout: str) -> None:
    """The student's logprobs at the teacher's top-k ids equal an HF forward's gather (before the step),
    and the step equals miles-fsdp's."""
    ranks = run.ranks(layout)
    got, want = ranks[0]["distill_metrics"], run.fsdp["distill_metrics"]
    for name in ("loss", "grad_norm", "distill_topk_reverse_kl"):
        assert got[name] == pytest.approx(want[name], rel=TOL), name
    assert "critic_grad_norm" not in got  # the idle critic is not stepped
    # each recorded row names its position by the teacher's (distinct) logprobs
    batch = job.distill_batch(run.vocab)
    assert batch.teacher_topk_ids is not None and batch.teacher_topk_logprobs is not None
    model = _hf_model(run.root / "megatron" / layout / "hf_resumed")  # the weights the step started from
    expected: dict[tuple[float, ...], torch.Tensor] = {}
    with torch.no_grad():
        for i, tokens in enumerate(batch.sequences()):
            p = int(batch.prompt_lengths[i])
            logits = model(torch.tensor([tokens])).logits[0, p - 1 : -1].float()
            logp = torch.log_softmax(logits / job.DISTILL_TEMPERATURE, dim=-1)
            span = slice(batch.response_offsets[i], batch.response_offsets[i + 1])
            gathered = logp.gather(1, batch.teacher_topk_ids[span])
            for row, teacher in zip(gathered, batch.teacher_topk_logprobs[span].tolist(), strict=True):
                expected[tuple(teacher)] = row
    seen: dict[tuple[float, ...], torch.Tensor] = {}
    for rank in ranks:
        for student, teacher in rank["distill_seen"]:
            for s_row, t_row in zip(student, teacher, strict=True):
                seen[tuple(t_row)] = torch.tensor(s_row)
    assert seen.keys() == expected.keys()  # every response token, by some rank
    worst = max(float((seen[k] - expected[k]).abs().max()) for k in expected)
    assert worst <= TOL, worst
    fsdp = load_dir(run.root / "fsdp" / "hf_distilled")
    megatron = load_dir(run.root / "megatron" / layout / "hf_distilled")
    assert max(float((megatron[k] - fsdp[k]).abs().max()) for k in fsdp) <= TOL
