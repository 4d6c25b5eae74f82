"""OpenEnv: the environment server as a real process (OpenEnv's routes and WebSocket sessions, behind the run's
key), the settings refused before anything starts, and GRPO through ``miles train`` on the tiny model with the
server started by the launcher (exact tokens, environment text never in the loss, the environment's rewards as
the samples', the server gone with the run)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles.errors import SettingsError
from miles.net import free_port
from miles.testing.runs import children_of_run, read_metrics, run_miles, tiny_model  # noqa: F401  (a fixture)
from miles.types import Sample
from miles_envs.openenv.letters import LetterAction, LetterHunt
from miles_envs.openenv.rollout import OpenEnvRollout, OpenEnvText

from .conftest import resolve_function

LETTERS = "miles_envs.openenv.letters:LetterHunt"


def _letters(seed: int, turns: int = 3) -> list[str]:
    env = LetterHunt(turns=turns)
    env.reset(seed=seed)
    letters = []
    for _ in range(turns):
        letters.append(env._letters[env.state.step_count])
        env.step(LetterAction(message=""))
    return letters


def _wait(url: str, process: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, "the server exited"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server did not answer /health"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def keyed_server() -> Iterator[str]:
    """``python -m miles_envs.openenv.server`` serving LetterHunt with a run key in its environment."""
    port = free_port("127.0.0.1")
    env = {**os.environ, "MILES_API_KEY": "run-key"}
    argv = [sys.executable, "-m", "miles_envs.openenv.server", "--model", LETTERS, "--host", "127.0.0.1"]
    process = subprocess.Popen([*argv, "--port", str(port)], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(url, process)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_episodes_over_openenv_sessions_need_the_run_key(keyed_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    url = keyed_server
    assert httpx.get(url + "/schema", timeout=5).status_code == 401  # every route but /health needs the key
    schema = httpx.get(url + "/schema", headers={"Authorization": "Bearer run-key"}, timeout=5).json()
    assert schema["action"]["required"] == ["message"] and "prompt" in schema["observation"]["properties"]
    with pytest.raises(ConnectionError, match="cannot open an OpenEnv session"):
        OpenEnvText(url, action_field="message", observation_field="prompt").reset(seed=1)
    with pytest.raises(ConnectionError):
        OpenEnvText(url, action_field="message", observation_field="prompt", api_key="wrong").reset(seed=1)

    # a server that already runs, reached by url (its key from api_key_env): checked, and nothing to start
    monkeypatch.setenv("LETTERS_KEY", "run-key")
    reached = resolve_function({"name": "openenv", "url": url, "api_key_env": "LETTERS_KEY"}).rollout_function
    assert isinstance(reached, OpenEnvRollout) and reached.server() is None
    assert reached._schema_fields() == ("message", "prompt")  # the one text field of each, from /schema
    wrong = OpenEnvRollout(reached.settings.model_copy(update={"action_field": "text"}))
    with pytest.raises(SettingsError, match=r"rollout\.function\.action_field: the environment's action fields are"):
        wrong._schema_fields()

    letters = _letters(seed=7)
    envs = [OpenEnvText(url, action_field="message", observation_field="prompt", api_key="run-key") for _ in range(2)]
    try:  # two sessions at once, each its own environment
        first = [env.reset(seed=7)[0] for env in envs]
        assert first == [f"Write a word that contains the letter '{letters[0]}'."] * 2
        observation, reward, terminated, truncated, _ = envs[0].step(f"x{letters[0]}x")
        assert (reward, terminated, truncated) == (1.0, False, False)
        assert observation == f"Yes. Now a word with the letter '{letters[1]}'."
        missing = next(c for c in "abcdefgh" if c != letters[0])
        assert envs[1].step(missing * 3)[1:3] == (0.0, False)  # the other session is still at its first letter
        assert envs[0].step("")[1:3] == (0.0, False)
        assert envs[0].step(letters[2])[1:3] == (1.0, True)
    finally:
        for env in envs:
            env.close()


def test_the_rollout_function_resolves_with_its_settings() -> None:
    run = resolve_function({"name": "openenv", "env": LETTERS, "max_turns": 5})
    function = run.rollout_function
    assert isinstance(function, OpenEnvRollout) and function.settings.max_turns == 5
    server = function.server()
    assert server is not None and server.module == "miles_envs.openenv.server" and server.model_path == LETTERS


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ({}, r"rollout\.function\.env: the openenv rollout function needs an environment"),
        (
            {"env": "miles_envs.openenv.letters.LetterHunt"},
            r"rollout\.function\.env: expected .*package\.module:attribute",
        ),
        ({"env": "no_such_package_xyz:Env"}, r"rollout\.function\.env: cannot import 'no_such_package_xyz'"),
        ({"env": "miles_envs.openenv.letters:NoSuchEnv"}, r"rollout\.function\.env: module .* no attribute 'NoSuch"),
        ({"env": "miles_envs.openenv.letters:LetterAction"}, r"rollout\.function\.env: .* neither an OpenEnv Env"),
        ({"url": "ftp://127.0.0.1:80"}, r"rollout\.function\.url: expected http://host:port"),
        ({"url": "http://127.0.0.1"}, r"rollout\.function\.url: expected http://host:port"),
        ({"url": "http://127.0.0.1:9/reset"}, r"rollout\.function\.url: .*the server's root"),
        ({"max_turns": 0, "env": LETTERS}, r"rollout\.function\.max_turns"),
    ],
)
def test_bad_environments_and_urls_are_refused_naming_the_field(function: dict[str, Any], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        resolve_function({"name": "openenv", **function})


def test_a_url_where_no_server_answers_is_refused() -> None:
    port = free_port("127.0.0.1")
    with pytest.raises(
        SettingsError, match=rf"rollout\.function\.url: no OpenEnv server answers at http://127\.0\.0\.1:{port}"
    ):
        resolve_function({"name": "openenv", "url": f"http://127.0.0.1:{port}"})


def _config(tmp_path: Path, model: Path, function: str, rollouts: int = 2) -> tuple[Path, Path]:
    data = tmp_path / "episodes.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"episode {i}", "env_seed": i}) + "\n" for i in range(8)))
    run_dir = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text(
        textwrap.dedent(
            f"""
            [cluster]
            trainer_ranks = 1
            num_engines = 1

            [data]
            path = "{data}"

            [rollout]
            rollout_batch_size = 2
            n_samples_per_prompt = 4
            max_new_tokens = 8

            [train]
            model_path = "{model}"
            num_rollouts = {rollouts}
            global_batch_size = 8
            lr = 1e-3

            [algorithm]
            name = "grpo"

            [[reward.functions]]
            name = "env_return"

            [transport]
            name = "disk"

            [precision]
            name = "fp32"

            [log]
            run_dir = "{run_dir}"
            """
        )
        + textwrap.dedent(function)
    )
    return config, run_dir


def test_a_bad_environment_stops_miles_train_before_anything_starts(tmp_path: Path) -> None:
    config, run_dir = _config(
        tmp_path, tmp_path / "no-model", '[rollout.function]\nname = "openenv"\nenv = "nope:Env"\n'
    )
    out = run_miles("train", str(config), "--dry-run", timeout=120)
    assert out.returncode != 0
    assert "rollout.function.env: cannot import 'nope'" in out.stdout + out.stderr
    assert not (run_dir / "logs").exists()


@pytest.mark.slow
def test_openenv_episodes_train_through_miles_train(tmp_path: Path, tiny_model: Path) -> None:  # noqa: F811
    from transformers import AutoTokenizer

    function = f"""
        [rollout.function]
        name = "openenv"
        env = "{LETTERS}"
        max_turns = 5
        """
    config, run_dir = _config(tmp_path, tiny_model, function)
    out = run_miles("train", str(config), timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["sessions/episodes"] == 8 and row["sessions/append_only_violations"] == 0
        assert row["env/turns_mean"] == 3.0 and row["env/terminated_fraction"] == 1.0  # LetterHunt's 3 letters
        assert row["reward/env_return/mean"] == pytest.approx(row["env/return_mean"])
        assert 0.0 <= row["fidelity/train_rollout_logprob_abs_diff"] < 1e-4  # every policy token as sampled
        assert 0 < row["sessions/masked_fraction"] < 1

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    for step in (1, 2):
        lines = (run_dir / "samples" / f"rollout_{step:06d}.jsonl").read_text().splitlines()
        samples = [Sample.from_json(line) for line in lines]
        assert len(samples) == 8
        for s in samples:
            s.validate()
            letters = _letters(int(s.metadata["env_seed"]))
            messages = s.metadata["messages"]
            observations = [m["content"] for m in messages if m["role"] == "user"]
            replies = [m["content"] for m in messages if m["role"] == "assistant"]
            assert observations[0] == f"Write a word that contains the letter '{letters[0]}'." and len(replies) == 3
            # the environment's rewards, as it computed them from the policy's replies, are the sample's reward
            expected = [1.0 if letter in reply.lower() else 0.0 for letter, reply in zip(letters, replies, strict=True)]
            assert s.metadata["env_rewards"] == expected and s.reward == pytest.approx(sum(expected))
            # the first prompt is the first observation, as the chat template renders it
            assert s.prompt_ids == tokenizer.apply_chat_template(
                [{"role": "user", "content": observations[0]}], add_generation_prompt=True, tokenize=True, return_dict=False
            )  # fmt: skip
            # loss mask 1 exactly on the policy's tokens; the environment's text only in the masked tokens
            mask = [0] * s.response_length
            for a, b in s.metadata["session"]["policy_spans"]:
                mask[a:b] = [1] * (b - a)
            assert s.loss_mask == mask and sum(mask) > 0
            masked = tokenizer.decode([t for t, m in zip(s.response_ids, mask, strict=True) if m == 0])
            policy = tokenizer.decode([t for t, m in zip(s.response_ids, mask, strict=True) if m == 1])
            for observation in observations[1:]:
                assert observation in masked and observation not in policy

    # the server was the run's: its log in the run directory, its address dead, no process of the run left
    log = (run_dir / "logs" / "env-openenv.log").read_text()
    assert "OpenEnv environment miles_envs.openenv.letters:LetterHunt serving on 127.0.0.1" in log
    url = json.loads((run_dir / "settings.json").read_text())["rollout"]["function"]["url"]
    assert url.startswith("http://127.0.0.1:")
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=5)
    assert children_of_run(run_dir) == []
    (pid,) = re.findall(r"started env-openenv \(pid (\d+)\)", out.stdout + out.stderr)
    assert not Path(f"/proc/{pid}").exists()  # stopped and reaped
