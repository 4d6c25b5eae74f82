"""Reward functions (built-in plugins) and the scoring helper that runs them with timeouts.

Registered names (``[[reward.functions]] name = "<name>"  weight = 1.0``):

- ``math``: the last ``\\boxed{}`` of the response against the label, equivalence by math-verify (sympy);
- ``exact_match``: the (extracted) answer equals the label after normalisation;
- ``regex``: a format reward, the response matches a regular expression;
- ``length_penalty``: DAPO's soft overlong punishment or a linear length cost;
- ``remote``: a reward model / verifier over HTTP (async httpx, timeout, retries);
- ``model``: a reward model served for the run — a classifier, a process reward model or a generative judge
  (:mod:`miles.rewards.model`);
- ``python_output``: the response's program run in the sandbox (:mod:`miles.rewards.sandbox`), its output
  against the label.

:func:`miles.rewards.scoring.score_samples` combines them with their weights, fills ``Sample.reward``
and ``Sample.reward_parts``, and marks a sample failed when a function raises or times out. A plugin's reward
of a whole group (:class:`miles.rewards.base.GroupReward`: a rank within the group, a verifiers rubric's group
functions) is called once per group with the group's samples.
"""
