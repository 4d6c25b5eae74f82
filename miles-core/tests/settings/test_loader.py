from __future__ import annotations

from pathlib import Path

import pytest

from miles.errors import SettingsError
from miles.settings import MilesSettings, load_settings
from miles.settings.loader import parse_override, sources_of


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_and_derived_values() -> None:
    settings = load_settings(env={})
    assert isinstance(settings, MilesSettings)
    assert settings.train.global_batch_size == 32  # 8 prompts x 4 samples
    assert settings.train.steps_per_rollout == 1
    assert settings.algorithm.name == "grpo"
    # chosen from the machine by build_run (miles.defaults), unless a run names them
    assert settings.transport.name == "auto" and settings.precision.name == "auto"


def test_precedence_file_then_env_then_set(tmp_path: Path) -> None:
    config = _write(
        tmp_path, "run.toml", "[train]\nlr = 1e-4\nseed = 1\nwarmup_steps = 3\n[rollout]\ntemperature = 0.5\n"
    )
    env = {"MILES_TRAIN__LR": "2e-4", "MILES_TRAIN__SEED": "2"}
    settings = load_settings(config, env=env, overrides=["train.seed=3"])
    assert settings.train.lr == 2e-4  # env beats file
    assert settings.train.seed == 3  # --set beats env
    assert settings.train.warmup_steps == 3  # file beats default
    assert settings.rollout.temperature == 0.5


def test_yaml_file_and_plugin_tables(tmp_path: Path) -> None:
    config = _write(
        tmp_path,
        "run.yaml",
        "algorithm:\n  name: ppo\n  gamma: 0.99\nreward:\n  functions:\n    - name: math\n      weight: 2.0\n    - length_penalty\n",
    )
    settings = load_settings(config, env={})
    assert settings.algorithm.name == "ppo" and settings.algorithm.options == {"gamma": 0.99}
    assert [(f.name, f.weight) for f in settings.reward.functions] == [("math", 2.0), ("length_penalty", 1.0)]


def test_batch_invariant(tmp_path: Path) -> None:
    settings = load_settings(
        env={},
        overrides=["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=8", "train.global_batch_size=8"],
    )
    assert settings.train.steps_per_rollout == 4
    config = _write(tmp_path, "run.toml", "[train]\nglobal_batch_size = 12\n")
    with pytest.raises(SettingsError) as info:
        load_settings(config, env={})
    message = str(info.value)
    assert f"train.global_batch_size ({config}:2): 12 must divide" in message
    assert "= 32" in message
    with pytest.raises(
        SettingsError,
        match=r"train.global_batch_size \(env MILES_TRAIN__GLOBAL_BATCH_SIZE\): 32 is not divisible by cluster.trainer_ranks = 3",
    ):
        load_settings(env={"MILES_TRAIN__GLOBAL_BATCH_SIZE": "32", "MILES_CLUSTER__TRAINER_RANKS": "3"})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[train]\nlr = -1.0\n", "train.lr ({path}:2): Input should be greater than 0 (got -1.0)"),
        ("[train]\n\nlrr = 0.1\n", "train.lrr ({path}:3): unknown key (did you mean 'lr'?)"),
        ("[train]\nnum_rolouts = 3\n", "train.num_rolouts ({path}:2): unknown key (did you mean 'num_rollouts'?)"),
        (
            "[rollout.sessions]\nmax_sesions = 3\n",
            "rollout.sessions.max_sesions ({path}:2): unknown key (did you mean 'max_sessions'?)",
        ),
        ("[train]\nzzz = 3\n", "train.zzz ({path}:2): unknown key\n"),
        (
            '[rollout]\nmode = "async"\n',
            "rollout.mode ({path}:2): Input should be 'sync', 'one_step_off' or 'fully_async'",
        ),
        ('[cluster]\ntrainer_ranks = "two"\n', "cluster.trainer_ranks ({path}:2): Input should be a valid integer"),
        (
            '[[reward.functions]]\nname = "math"\n\n[[reward.functions]]\nname = "regex"\nweight = "x"\n',
            "reward.functions[1].weight ({path}:6): Input should be a valid number",
        ),
        ("[sections]\na = 1\n", "sections ({path}:1): unknown key\n"),
        ("[trian]\nlr = 1\n", "trian ({path}:1): unknown key (did you mean 'train'?)"),
    ],
)
def test_file_errors_name_field_and_line(tmp_path: Path, text: str, expected: str) -> None:
    config = _write(tmp_path, "run.toml", text)
    with pytest.raises(SettingsError) as info:
        load_settings(config, env={})
    assert expected.format(path=config) in str(info.value) + "\n"


def test_yaml_errors_name_line(tmp_path: Path) -> None:
    config = _write(tmp_path, "run.yaml", "train:\n  lr: 0.1\n  seed: nope\n")
    with pytest.raises(SettingsError, match=r"train.seed \(.*run.yaml:3\): Input should be a valid integer"):
        load_settings(config, env={})
    broken = _write(tmp_path, "broken.yaml", "train:\n  lr: [1,\n")
    with pytest.raises(SettingsError, match=r"broken.yaml:\d+: invalid YAML"):
        load_settings(broken, env={})


def test_env_and_set_errors_name_their_source() -> None:
    with pytest.raises(
        SettingsError, match=r"rollout.top_p \(env MILES_ROLLOUT__TOP_P\): Input should be less than or equal to 1"
    ):
        load_settings(env={"MILES_ROLLOUT__TOP_P": "1.5"})
    with pytest.raises(
        SettingsError, match=r"rollout.top_k \(--set rollout.top_k=many\): Input should be a valid integer"
    ):
        load_settings(env={}, overrides=["rollout.top_k=many"])
    with pytest.raises(SettingsError, match=r"train.nope \(--set train.nope=1\): unknown key"):
        load_settings(env={}, overrides=["train.nope=1"])
    # a misspelt section given only through --set: its error names the --set it came from
    with pytest.raises(SettingsError, match=r"trian \(--set trian.lr=1\): unknown key \(did you mean 'train'\?\)"):
        load_settings(env={}, overrides=["trian.lr=1"])


def test_env_sources_are_the_variables_that_were_set() -> None:
    """A table filled by one field's variable is not itself from the environment: its other fields'
    errors name no variable (was ``train.backend (env MILES_TRAIN)`` for ``MILES_TRAIN__SEED``)."""
    settings = load_settings(
        env={"MILES_TRAIN__SEED": "7", "MILES_REWARD__FUNCTIONS": '[{"name": "math"}]', "miles_rollout__top_k": "3"}
    )
    sources = sources_of(settings)
    assert sources.of("train.seed") == "env MILES_TRAIN__SEED"
    assert sources.of("train.backend") is None and sources.of("train.lr") is None
    assert sources.of("reward.functions[0].name") == "env MILES_REWARD__FUNCTIONS"
    assert sources.of("rollout.top_k") == "env miles_rollout__top_k"


def test_json_errors_name_the_variable_and_the_column() -> None:
    """A list or table given as JSON in an environment variable or a --set: the error names where, and the
    column in the value as written (a trailing newline is not a line of its own)."""
    with pytest.raises(SettingsError, match=r"^env MILES_REWARD__FUNCTIONS: invalid JSON \(.* at column 18\)$"):
        load_settings(env={"MILES_REWARD__FUNCTIONS": '[{"name": "math",}]\n'})
    with pytest.raises(SettingsError, match=r"^env MILES_REWARD__FUNCTIONS: invalid JSON \(.* at line 2 column 1\)$"):
        load_settings(env={"MILES_REWARD__FUNCTIONS": '[{"name": "math"},\n]'})
    with pytest.raises(
        SettingsError,
        match=r"^--set 'reward.functions=\[\{\"name\": \"math\",\}\]': the value is not valid JSON \(.* at column 18\)$",
    ):
        load_settings(env={}, overrides=['reward.functions=[{"name": "math",}]'])
    settings = load_settings(env={}, overrides=['reward.functions=[{"name": "math"}]', 'rollout.stop=["</a>"]'])
    assert settings.rollout.stop == ["</a>"]


def test_bad_files() -> None:
    with pytest.raises(SettingsError, match="cannot read settings file /nonexistent/run.toml"):
        load_settings("/nonexistent/run.toml", env={})


def test_bad_toml_and_suffix(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="invalid TOML"):
        load_settings(_write(tmp_path, "bad.toml", "[train\n"), env={})
    with pytest.raises(SettingsError, match="expected a .toml, .yaml or .yml file"):
        load_settings(_write(tmp_path, "run.ini", "[train]\n"), env={})


def test_parse_override_literals() -> None:
    assert parse_override("train.lr=1e-5") == (["train", "lr"], 1e-5)
    assert parse_override('rollout.stop=["</s>", "\\n\\n"]') == (["rollout", "stop"], ["</s>", "\n\n"])
    assert parse_override("algorithm=ppo") == (["algorithm"], "ppo")
    assert parse_override("cluster.colocate=true") == (["cluster", "colocate"], True)
    with pytest.raises(SettingsError, match="expected KEY=VALUE"):
        parse_override("train.lr")
    with pytest.raises(SettingsError, match="invalid key"):
        parse_override("train..lr=1")


def test_async_mode_checks_happen_before_launch() -> None:
    with pytest.raises(
        SettingsError, match=r"rollout.max_staleness \(--set rollout.max_staleness=0\): one_step_off trains"
    ):
        load_settings(env={}, overrides=["rollout.mode=one_step_off", "rollout.max_staleness=0"])
    with pytest.raises(SettingsError, match=r"rollout.buffer_groups \(--set rollout.buffer_groups=2\): 2 is smaller"):
        load_settings(env={}, overrides=["rollout.mode=fully_async", "rollout.buffer_groups=2"])
    with pytest.raises(SettingsError, match=r"cluster.colocate .*cannot share devices"):
        load_settings(env={}, overrides=["rollout.mode=fully_async", "cluster.colocate=true"])


def test_component_options_without_a_name_keep_the_default_component(tmp_path: Path) -> None:
    """``--set train.backend.x=...`` with no ``[train.backend]`` table is an option of the default backend; a
    component with no default (``train.adapter``) still needs its name."""
    path = tmp_path / "run.toml"
    path.write_text('[train]\nmodel_path = "m"\n')
    settings = load_settings(
        path, overrides=["train.backend.attn_implementation=packed_sdpa", "transport.bucket_bytes=1024"]
    )
    assert settings.train.backend.name == "fsdp"
    assert settings.train.backend.options == {"attn_implementation": "packed_sdpa"}
    assert (settings.transport.name, settings.transport.bucket_bytes) == ("auto", 1024)
    with pytest.raises(SettingsError, match="train.adapter.name"):
        load_settings(path, overrides=["train.adapter.r=4"])


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (["rollout.replay_sampling_mask=true"], "nothing is truncated"),
        (["rollout.replay_sampling_mask=true", "rollout.top_k=20", "train.true_on_policy=true"], "true_on_policy"),
    ],
)
def test_sampling_mask_replay_is_refused_where_it_cannot_work(sets: list[str], expected: str) -> None:
    with pytest.raises(SettingsError, match=rf"rollout.replay_sampling_mask.*{expected}"):
        load_settings(None, overrides=sets, env={})
    assert load_settings(None, overrides=["rollout.replay_sampling_mask=true", "rollout.top_k=20"], env={})
    # the megatron trainer scores the kept sets too (miles-megatron's test_equality: every layout)
    assert load_settings(
        None, overrides=["rollout.replay_sampling_mask=true", "rollout.top_p=0.9", "train.backend=megatron"], env={}
    )
