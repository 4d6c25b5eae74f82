"""The ``verifiers`` data source: a verifiers environment's data set as the run's prompts.

``data.path`` names the environment (an installed environment module, or a ``.py`` file defining
``load_environment``: see :mod:`miles_envs.verifiers.loading`); ``data.source.args`` are its
``load_environment`` arguments. Each row of the environment's data set (``split = "train"``: its
``dataset``; ``"eval"``: its ``eval_dataset``) becomes a prompt: the row's ``prompt`` messages (the
environment's system prompt and few-shot turns included, as verifiers formats them), the rest of the row
(``answer``, ``info``, ``example_id``, ``task`` and any other column) as the label, and the environment's
name and arguments in ``metadata["verifiers_env"]``, which the ``verifiers`` rollout function reads. Rows are
served like a file's (shuffled per epoch from ``data.seed``, resumable).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from miles.components import ComponentSettings
from miles.data.rows import Row
from miles.data.sources import FileDataSource
from miles.errors import DataError, SettingsError
from miles_envs.verifiers.loading import VERIFIERS, EnvSpec, group_reward_functions, load_env

if TYPE_CHECKING:
    from miles.settings.model import MilesSettings

__all__ = ["VerifiersDataSettings", "VerifiersDataSource", "environment_rows"]


class VerifiersDataSettings(ComponentSettings):
    """Settings of the ``verifiers`` data source (``data.path`` names the environment)."""

    args: dict[str, Any] = Field(default_factory=dict)
    """Arguments of the environment's ``load_environment`` (``{num_examples = 100, difficulty = "easy"}``)."""
    split: Literal["train", "eval"] = "train"
    """Which data set of the environment: ``train`` (its ``dataset``) or ``eval`` (its ``eval_dataset``;
    verifiers falls back to ``dataset`` when there is none)."""
    num_examples: int = Field(-1, ge=-1)
    """Use the first this-many rows (-1: all)."""


def _plain(value: Any) -> Any:
    """A data set value as plain JSON (Arrow fills absent struct fields with ``None``: those keys go)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def environment_rows(env: Any, settings: VerifiersDataSettings) -> list[dict[str, Any]]:
    """The rows of ``env``'s data set that ``settings`` select, as plain JSON objects."""
    n = settings.num_examples
    dataset = env.get_dataset(n=n) if settings.split == "train" else env.get_eval_dataset(n=n)
    return [json.loads(json.dumps(dict(row), default=str)) for row in dataset]  # a label travels as JSON


class VerifiersDataSource(FileDataSource[VerifiersDataSettings]):
    """The data set of a verifiers environment (its prompts, answers and task information)."""

    name = "verifiers"
    requires = (VERIFIERS,)

    @classmethod
    def check_settings(cls, options: VerifiersDataSettings, settings: MilesSettings) -> None:
        """Before anything starts: the environment loads, the run plays its episodes with the ``verifiers``
        rollout function, and a rubric with group-level reward functions has the ``verifiers`` reward to score
        each group's episodes together."""
        if settings.data.path is None:
            raise SettingsError("data.path: name the verifiers environment (an installed module or a .py file)")
        if settings.rollout.function_name != "verifiers":
            raise SettingsError(
                f"rollout.function: the verifiers data source needs rollout.function = 'verifiers' (the "
                f"environment's own multi-turn protocol), got {settings.rollout.function_name!r}"
            )
        from miles.settings.loader import sources_of

        try:
            env = load_env(EnvSpec(settings.data.path, options.args))
        except SettingsError as exc:
            source = sources_of(settings).of("data.path")
            raise SettingsError(f"data.path ({source}): {exc}" if source else f"data.path: {exc}") from None
        grouped = group_reward_functions(env) if env.score_rollouts else []
        if grouped and "verifiers" not in [f.name for f in settings.reward.functions]:
            raise SettingsError(
                f"reward.functions: the rubric of verifiers environment {settings.data.path!r} has group-level reward "
                f"functions ({', '.join(grouped)}), which the 'verifiers' reward runs on each group's episodes; add "
                "[[reward.functions]] name = 'verifiers'"
            )

    def rows(self) -> Iterator[Row]:
        spec = EnvSpec(self.path, dict(self.settings.args))
        env = load_env(spec)
        try:
            rows = environment_rows(env, self.settings)
        except Exception as exc:  # verifiers' "dataset is not set", a builder that fails ...
            raise DataError(f"data.path: verifiers environment {self.path!r} has no usable data set: {exc}") from None
        for i, row in enumerate(rows):
            prompt = row.pop("prompt", None)
            if prompt is None:
                raise DataError(f"verifiers:{self.path}:{i}: the environment's row has no 'prompt'")
            yield (
                {
                    self.prompt_key: _plain(prompt),
                    self.label_key: row,
                    "verifiers_env": spec.to_dict(),
                },
                f"verifiers:{self.path}:{i}",
            )
