"""The algorithms drive a real (tiny) causal LM: a few optimizer steps on one scored group move the
policy toward the rewarded responses, and splitting the step into micro-batches gives the same gradient."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from miles.algorithms.aggregation import StepDenominators, aggregate_loss
from miles.algorithms.base import AdvantageInputs, Algorithm, LossInputs
from miles.components import ComponentKind
from miles.plugins.builtin import BUILTIN_PLUGINS
from miles.plugins.manager import PluginManager
from miles.settings.model import AlgorithmSpec
from miles.testing.models import build_tiny_model
from miles.types import Sample, SampleGroup

PROMPT = [5, 6, 7]
RESPONSES = [[20, 21, 22, 23], [30, 31, 32], [40, 41, 42, 43, 44], [50, 51]]
REWARDS = [1.0, 0.0, 0.0, 1.0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def load(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def response_logprobs(model: Any, responses: list[list[int]]) -> list[torch.Tensor]:
    out = []
    for resp in responses:
        ids = torch.tensor([PROMPT + resp])
        logits = model(ids).logits[0, len(PROMPT) - 1 : -1]
        out.append(torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(resp)[:, None])[:, 0])
    return out


def make_algorithm(name: str, **options: Any) -> Algorithm:
    manager = PluginManager(
        builtins=[b for b in BUILTIN_PLUGINS if b[0] == "algorithms"], entry_points=False, disabled=(), only=()
    )
    return manager.create(ComponentKind.ALGORITHM, AlgorithmSpec(name=name, **options), field="algorithm")  # type: ignore[no-any-return]


def step_loss(
    algo: Algorithm,
    logprobs: list[torch.Tensor],
    old: list[torch.Tensor],
    adv: list[torch.Tensor],
    indices: list[int],
    den: StepDenominators,
) -> torch.Tensor:
    cat = torch.cat
    lengths = [len(RESPONSES[i]) for i in indices]
    lp = cat([logprobs[i] for i in indices])
    inputs = LossInputs(
        logprobs=lp,
        loss_mask=torch.ones_like(lp),
        response_lengths=lengths,
        advantages=cat([adv[i] for i in indices]),
        old_logprobs=cat([old[i] for i in indices]),
        rollout_logprobs=cat([old[i] for i in indices]) - 0.05,  # a small train/inference mismatch
        ref_logprobs=cat([old[i] for i in indices]),
        entropy=torch.zeros_like(lp),
    )
    out = algo.loss(inputs)
    return aggregate_loss(out.per_token_loss, inputs.loss_mask, lengths, algo.aggregation, den)


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("grpo", {"kl_coef": 0.01, "mismatch_correction": "tis"}),
        ("dr_grpo", {"max_response_length": 8}),
        ("dapo", {"mismatch_correction": "icepop", "icepop_high": 1.5}),
        ("gspo", {"clip_eps_low": 0.2, "clip_eps_high": 0.2}),
        ("rloo", {"dual_clip": 3.0}),
        ("reinforce_pp_baseline", {"kl_coef": 0.01, "kl_estimator": "k2"}),
    ],
)
def test_steps_move_the_policy_toward_rewarded_responses(model_dir: Path, name: str, options: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    model = load(model_dir)
    algo = make_algorithm(name, **options)
    samples = [
        Sample(
            prompt_ids=PROMPT,
            response_ids=r,
            rollout_logprobs=[-1.0] * len(r),
            loss_mask=[1] * len(r),
            reward=w,
            index=i,
        )
        for i, (r, w) in enumerate(zip(RESPONSES, REWARDS, strict=True))
    ]
    adv = algo.compute_advantages(AdvantageInputs([SampleGroup(0, samples)])).advantages[0]
    with torch.no_grad():
        before = [lp.sum().item() for lp in response_logprobs(model, RESPONSES)]
    old = [lp.detach() for lp in response_logprobs(model, RESPONSES)]
    den = StepDenominators(num_tokens=sum(map(len, RESPONSES)), num_sequences=4, seq_len_norm=algo.seq_len_norm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):
        optimizer.zero_grad()
        step_loss(algo, response_logprobs(model, RESPONSES), old, adv, [0, 1, 2, 3], den).backward()
        optimizer.step()
    with torch.no_grad():
        after = [lp.sum().item() for lp in response_logprobs(model, RESPONSES)]
    for b, a, r in zip(before, after, REWARDS, strict=True):
        assert (a > b) if r > 0.5 else (a < b), (name, before, after)


def test_micro_batches_give_the_full_step_gradient(model_dir: Path) -> None:
    torch.set_num_threads(1)
    algo = make_algorithm("gspo", kl_coef=0.05, mismatch_correction="tis", mismatch_level="sequence")
    model = load(model_dir)
    old = [lp.detach() - 0.1 for lp in response_logprobs(model, RESPONSES)]
    adv = [torch.full((len(r),), a) for r, a in zip(RESPONSES, [1.0, -0.5, -1.0, 0.5], strict=True)]
    den = StepDenominators(num_tokens=sum(map(len, RESPONSES)), num_sequences=4)

    def grads(splits: list[list[int]]) -> list[torch.Tensor]:
        model.zero_grad()
        for part in splits:
            step_loss(algo, response_logprobs(model, [RESPONSES[i] for i in range(4)]), old, adv, part, den).backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    whole = grads([[0, 1, 2, 3]])
    split = grads([[0, 2], [1], [3]])
    assert len(whole) == len(split) > 0
    for a, b in zip(whole, split, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
