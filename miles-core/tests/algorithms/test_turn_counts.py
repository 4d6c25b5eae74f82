"""Episodes of different turn counts in one group: advantages and loss weights do not depend on the number
of turns.

A multi-turn episode is one sample (the session's trajectory): the policy's turns with ``loss_mask`` 1, the
environment's / tool's tokens between them with ``loss_mask`` 0, ``request_spans`` marking each turn. A group
here holds episodes of 1, 3, 2 and 1 turns. Checked: each episode's advantage is its reward's group-normalised
value on every policy token of every turn (never spread or divided per turn), 0 on environment tokens, and the
same whatever the turn structure; each aggregation mode gives every policy token the weight its definition
says (per token, or per sequence over its own policy tokens), whatever the turns; GSPO's sequence ratio and
DAPO's overlong shaping count the policy's tokens only (an episode is not "overlong" for the environment's
tokens between its turns).
"""

from __future__ import annotations

import pytest
import torch

from miles.algorithms.advantages import group_normalized, rloo
from miles.algorithms.aggregation import StepDenominators, aggregate_loss
from miles.algorithms.base import AdvantageInputs
from miles.algorithms.builtin import DAPO, GRPO, RLOO, DrGRPO
from miles.algorithms.losses import sequence_log_ratio
from miles.algorithms.settings import DAPOSettings, DrGRPOSettings, GRPOSettings, RLOOSettings
from miles.types import Sample, SampleGroup


def episode(turns: list[int], env: list[int], reward: float, index: int) -> Sample:
    """A session-shaped sample: policy turns of ``turns`` tokens, ``env[k]`` environment tokens after turn ``k``."""
    response: list[int] = []
    mask: list[int] = []
    spans: list[tuple[int, int]] = []
    for k, n in enumerate(turns):
        if k:
            response += [7] * env[k - 1]
            mask += [0] * env[k - 1]
        spans.append((len(response), len(response) + n))
        response += [5] * n
        mask += [1] * n
    sample = Sample(
        prompt_ids=[1, 2],
        response_ids=response,
        rollout_logprobs=[-1.0 if m else 0.0 for m in mask],
        loss_mask=mask,
        request_spans=spans,
        reward=reward,
        group_id=0,
        index=index,
    )
    sample.validate()
    return sample


REWARDS = [1.0, 0.0, 0.5, 0.0]
GROUP = SampleGroup(
    0,
    [
        episode([4], [], REWARDS[0], 0),  # 1 turn
        episode([3, 2, 4], [5, 6], REWARDS[1], 1),  # 3 turns, 11 environment tokens
        episode([2, 3], [4], REWARDS[2], 2),  # 2 turns
        episode([6], [], REWARDS[3], 3),  # 1 turn
    ],
)
# the same rewards, every episode one turn of as many policy tokens
FLAT = SampleGroup(0, [episode([sum(m for m in s.loss_mask)], [], s.reward or 0.0, s.index) for s in GROUP.samples])


@pytest.mark.parametrize(
    ("algorithm", "expected"),
    [
        (GRPO(GRPOSettings()), group_normalized(REWARDS)),
        (DrGRPO(DrGRPOSettings()), group_normalized(REWARDS, std_normalize=False)),
        (RLOO(RLOOSettings()), rloo(REWARDS)),
    ],
    ids=["grpo", "dr_grpo", "rloo"],
)
def test_each_episode_gets_its_group_advantage_on_every_policy_token(algorithm: object, expected: list[float]) -> None:
    advantages = algorithm.compute_advantages(AdvantageInputs([GROUP])).advantages[0]  # type: ignore[attr-defined]
    flat = algorithm.compute_advantages(AdvantageInputs([FLAT])).advantages[0]  # type: ignore[attr-defined]
    assert len(set(expected)) > 1
    for sample, adv, flat_adv, value in zip(GROUP.samples, advantages, flat, expected, strict=True):
        mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
        assert adv.shape == (sample.response_length,)
        assert torch.allclose(adv[mask], torch.full((int(mask.sum()),), value))  # every turn, the full value
        assert not adv[~mask].any()  # the environment's tokens: 0
        assert torch.equal(adv[mask], flat_adv)  # as if the episode were one turn


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_loss_weights_do_not_depend_on_the_number_of_turns(mode: str) -> None:
    """Each token's weight in the step loss (d loss / d per-token loss), for the group above."""

    def weights(group: SampleGroup) -> list[torch.Tensor]:
        lengths = [s.response_length for s in group.samples]
        mask = torch.tensor([m for s in group.samples for m in s.loss_mask])
        per_token = torch.ones(sum(lengths), requires_grad=True)
        denominators = StepDenominators(num_tokens=int(mask.sum()), num_sequences=len(lengths), seq_len_norm=16.0)
        aggregate_loss(per_token, mask, lengths, mode, denominators).backward()  # type: ignore[arg-type]
        assert per_token.grad is not None
        return list(per_token.grad.split(lengths))

    policy_tokens = [sum(s.loss_mask) for s in GROUP.samples]
    for sample, w, flat_w, n in zip(GROUP.samples, weights(GROUP), weights(FLAT), policy_tokens, strict=True):
        mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
        assert not w[~mask].any()
        expected = {
            "token_mean": 1.0 / sum(policy_tokens),
            "seq_mean_token_mean": 1.0 / (len(policy_tokens) * n),  # each episode weighs 1/N in all
            "seq_mean_token_sum_norm": 1.0 / (len(policy_tokens) * 16.0),
        }[mode]
        assert torch.allclose(w[mask], torch.full((n,), expected))
        assert torch.allclose(w[mask], flat_w)


def test_gspo_sequence_ratio_ignores_the_environment_tokens() -> None:
    sample = GROUP.samples[1]
    n = sample.response_length
    mask = torch.tensor(sample.loss_mask)
    old = torch.full((n,), -1.0)
    logprobs = torch.linspace(-2.0, -0.5, n)
    noisy_env = torch.where(mask.bool(), logprobs, torch.full((n,), -50.0))  # anything on environment tokens
    ratio = sequence_log_ratio(logprobs, old, mask, [n])
    assert torch.allclose(ratio, sequence_log_ratio(noisy_env, old, mask, [n]))
    assert ratio[0].item() == pytest.approx(float(((logprobs - old) * mask).sum() / mask.sum()))


def test_dapo_overlong_shaping_counts_the_policy_tokens_only() -> None:
    """9 policy tokens over 3 turns (11 environment tokens between them) are within a budget of 16 with a
    buffer of 4: no penalty; counted with the environment's tokens (20) the episode would lose the whole
    ``overlong_penalty_factor``."""
    dapo = DAPO(DAPOSettings(max_response_length=16, overlong_buffer_length=4))
    assert GROUP.samples[1].response_length == 20 and sum(GROUP.samples[1].loss_mask) == 9
    assert dapo.shaped_rewards(GROUP) == REWARDS  # every episode's policy tokens (4, 9, 5, 6) are within 16 - 4
    longer = SampleGroup(0, [episode([8, 6], [1], 1.0, 0), episode([3], [], 0.0, 1)])
    # 14 policy tokens (15 with the environment's): 2 into the buffer of 4 -> -0.5, whatever the turns
    assert dapo.shaped_rewards(longer) == pytest.approx([1.0 - 0.5, 0.0])
    assert dapo.shaped_rewards(SampleGroup(0, [episode([14], [], 1.0, 0)])) == pytest.approx([0.5])
