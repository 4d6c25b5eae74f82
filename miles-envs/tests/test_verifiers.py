"""The verifiers connector without an engine: loading environments (by file, by installed module name, and
every way that fails), the data source over a real environment's data set, the reward, the plugin's
conformance."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verifiers")

import miles_envs.verifiers.plugin as plugin
from miles.testing import check_data_source, check_light_import, check_plugin, check_reward, check_rollout_function
from miles.types import Sample
from miles_envs.verifiers.data import VerifiersDataSource
from miles_envs.verifiers.groups import PENDING
from miles_envs.verifiers.loading import EnvSpec, VerifiersEnvError, forget_envs, group_reward_functions, load_env
from miles_envs.verifiers.reward import VerifiersReward


@pytest.fixture(autouse=True)
def _fresh() -> Any:
    forget_envs()
    yield
    forget_envs()


def test_an_environment_loads_from_its_file_once_and_keeps_the_run_signal_handlers(envs_dir: Path) -> None:
    import verifiers as vf

    def ours(signum: int, frame: Any) -> None:  # stands in for the launcher's handler
        pass

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, ours)
    try:
        spec = EnvSpec(str(envs_dir / "two_turn_sums.py"), {"num_examples": 3})
        env = load_env(spec)
        assert isinstance(env, vf.MultiTurnEnv) and env.max_turns == 2
        assert len(env.get_dataset()) == 3
        assert load_env(EnvSpec(spec.id, {"num_examples": 3})) is env  # once per process
        assert load_env(EnvSpec(spec.id, {"num_examples": 2})) is not env
        # verifiers installs its own SIGINT / SIGTERM handlers when an environment is built: put back
        assert signal.getsignal(signal.SIGTERM) is ours
        assert signal.getsignal(signal.SIGINT) is before[signal.SIGINT]
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_an_installed_environment_module_loads_by_its_id(envs_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(envs_dir))
    env = load_env(EnvSpec("two-turn-sums", {"max_turns": 3}))  # vf-eval's id: my-env imports my_env
    assert type(env).__name__ == "FollowUpEnv" and env.max_turns == 3


@pytest.mark.parametrize(
    ("env_id", "args", "message"),
    [
        ("no_such_env_module", {}, "cannot import module 'no_such_env_module'"),
        ("missing_file.py", {}, "'missing_file.py': no such file"),
        ("not_an_env.py", {}, "returned list, not a verifiers Environment"),
        ("two_turn_sums.py", {"bogus": 1}, "load_environment(bogus=1) raised TypeError"),
        ("conftest.py", {}, "defines no load_environment"),
    ],
)
def test_environments_that_cannot_serve_are_refused_by_name(
    envs_dir: Path, env_id: str, args: dict[str, Any], message: str
) -> None:
    where = env_id if not env_id.endswith(".py") or env_id == "missing_file.py" else str(envs_dir / env_id)
    if env_id == "conftest.py":
        where = str(envs_dir.parent / env_id)
    with pytest.raises(VerifiersEnvError) as err:
        load_env(EnvSpec(where, args))
    assert message in str(err.value) and "verifiers environment" in str(err.value)


def test_an_environment_with_group_reward_functions_loads_naming_them(envs_dir: Path) -> None:
    env = load_env(EnvSpec(str(envs_dir / "grouped.py"), {}))
    assert group_reward_functions(env) == ["length_rank", "group_size"] and env.rubric.has_group_rewards
    assert group_reward_functions(load_env(EnvSpec(str(envs_dir / "two_turn_sums.py"), {}))) == ["shortest"]


def test_the_data_source_serves_the_environment_rows(envs_dir: Path) -> None:
    path = str(envs_dir / "two_turn_sums.py")
    check_data_source(VerifiersDataSource, path, settings={"args": {"num_examples": 5}})
    source = VerifiersDataSource(
        VerifiersDataSource.Settings(args={"num_examples": 5}, num_examples=4), path=path, seed=0, shuffle=False
    )
    prompts = source.next_batch(4)
    assert [p.label["answer"] for p in prompts] == ["8", "8", "8", "5"]
    first = prompts[0]
    # verifiers' formatting: the environment's system prompt, then the question
    assert first.prompt == [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "What is 3 + 4?"},
    ]
    assert first.label == {"question": "What is 3 + 4?", "answer": "8", "info": {"a": 3, "b": 4}, "example_id": 0}
    assert first.metadata["verifiers_env"] == {"id": path, "args": {"num_examples": 5}}
    assert first.source == f"verifiers:{path}:0"


def _scored(reward: float | None, **metrics: float) -> Sample:
    info = {"reward": reward, "metrics": metrics, "turns": 2, "stop_condition": "max_turns_reached", "error": None}
    return Sample(prompt_ids=[1], metadata={"verifiers": info})


def test_the_reward_hands_on_the_rubric_score_with_each_function_as_a_part() -> None:
    values = check_reward(VerifiersReward, samples=[_scored(1.5, correct=1.0, brief=1.0, num_turns=2.0)])
    assert values == [1.5]
    import asyncio

    out = asyncio.run(VerifiersReward(VerifiersReward.Settings()).score(_scored(0.5, correct=0.0, brief=1.0)))
    assert out.parts == {"correct": 0.0, "brief": 1.0}
    for sample, message in [
        (Sample(prompt_ids=[1]), "not played by the 'verifiers' rollout function"),
        (_scored(None), "gave no finite reward"),
    ]:
        with pytest.raises(ValueError, match=message):
            asyncio.run(VerifiersReward(VerifiersReward.Settings()).score(sample))


def test_a_group_sample_whose_episode_state_is_gone_fails_alone() -> None:
    import asyncio

    # a sample of a group-scored episode whose state this process does not hold (scored already, or read back
    # from a file): it fails with the reason; the group's other samples keep their scores
    gone = _scored(None)
    gone.metadata["verifiers"]["pending"] = "0123abcd"
    results = asyncio.run(VerifiersReward(VerifiersReward.Settings()).score_group([_scored(1.0, correct=1.0), gone]))
    assert results[0].value == 1.0  # type: ignore[union-attr]
    assert isinstance(results[1], LookupError) and "not held by this process" in str(results[1])
    assert "pending" not in gone.metadata["verifiers"] and len(PENDING) == 0


def test_plugin_conforms_and_imports_cheaply() -> None:
    entries = check_plugin(
        plugin,
        name="verifiers",
        expect=[("data_source", "verifiers"), ("rollout_function", "verifiers"), ("reward", "verifiers")],
    )
    check_rollout_function(next(e for e in entries if e.kind.value == "rollout_function").component, name="verifiers")
    check_light_import("miles_envs.verifiers.plugin", forbidden=("torch", "transformers", "openai", "verifiers"))


def test_a_run_is_checked_before_anything_starts(envs_dir: Path) -> None:
    from miles.errors import SettingsError
    from miles.settings.model import MilesSettings

    def settings(
        path: str, function: str | dict[str, str] | None = "verifiers", rewards: tuple[str, ...] = ("verifiers",)
    ) -> MilesSettings:
        return MilesSettings.model_validate(
            {
                "data": {"path": path, "source": {"name": "verifiers"}},
                "rollout": {"function": function},
                "reward": {"functions": list(rewards)},
            }
        )

    options = VerifiersDataSource.Settings()
    VerifiersDataSource.check_settings(options, settings(str(envs_dir / "two_turn_sums.py")))
    table = settings(str(envs_dir / "two_turn_sums.py"), function={"name": "verifiers"})  # ([rollout.function])
    VerifiersDataSource.check_settings(options, table)
    VerifiersReward.check_settings(VerifiersReward.Settings(), table)
    VerifiersDataSource.check_settings(options, settings(str(envs_dir / "grouped.py")))
    # group-level functions run in the 'verifiers' reward: a run without it is told so
    with pytest.raises(
        SettingsError, match=r"^reward\.functions: .*group-level reward functions \(length_rank, group_size\)"
    ):
        VerifiersDataSource.check_settings(options, settings(str(envs_dir / "grouped.py"), rewards=("math",)))
    with pytest.raises(SettingsError, match="needs rollout.function = 'verifiers'"):
        VerifiersDataSource.check_settings(options, settings(str(envs_dir / "two_turn_sums.py"), function=None))
    with pytest.raises(SettingsError, match="rubric score of the 'verifiers' rollout function"):
        VerifiersReward.check_settings(VerifiersReward.Settings(), settings("x.py", function="calculator_agent"))
