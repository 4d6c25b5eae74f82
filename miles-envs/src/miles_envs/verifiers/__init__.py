"""The connector to `verifiers <https://github.com/PrimeIntellect-ai/verifiers>`_ environments
(``pip install "miles-envs[verifiers]"``).

A run names an environment in ``data.path`` and selects the three components the plugin registers, each named
``verifiers``: the data source (:mod:`~miles_envs.verifiers.data`: the environment's data set as prompts), the
rollout function (:mod:`~miles_envs.verifiers.rollout`: the environment's multi-turn episode through Miles'
TITO session server, scored by its rubric) and the reward (:mod:`~miles_envs.verifiers.reward`: that score,
each rubric function a logged part). Environments load once per process (:mod:`~miles_envs.verifiers.loading`); a
rubric's group-level functions score the episodes of each GRPO group together (:mod:`~miles_envs.verifiers.groups`).
"""

from __future__ import annotations

__all__: list[str] = []
