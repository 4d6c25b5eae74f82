"""RL objectives: advantage estimators, policy losses and their composable terms (built-in plugins).

Registered names (``algorithm = "<name>"``; settings in :mod:`miles.algorithms.settings`):

============================  ==================================================================
``grpo``                      group mean/std advantages, PPO clip, sequence-mean-token-mean loss
``dr_grpo``                   group mean only, token sum over ``max_response_length``
``dapo``                      clip-higher, token-mean loss, dynamic sampling, overlong shaping
``gspo``                      group advantages, clipped sequence-level ratio
``rloo``                      leave-one-out baseline
``reinforce_pp``              returns whitened over the batch (KL optionally in the reward)
``reinforce_pp_baseline``     group mean subtracted, then whitened over the batch
``ppo``                       GAE from a critic, PPO clip plus clipped value loss
``sft``                       masked NLL
``distill``                   on-policy distillation: reverse KL to a teacher (per token or top-k)
============================  ==================================================================

Every policy-gradient algorithm also composes, by settings: a KL term (k1 / k2 / k3, in the loss or in
the reward), an entropy bonus, TIS / IcePop mismatch correction (token, sequence or geometric level),
dual clip, and added SFT / distillation terms (:mod:`miles.algorithms.policy`).
"""
