"""The text-game example as a reader runs it, from the repository root: its settings resolved as ``miles train``
resolves them (the game exists and is single-player), and the run itself —
``miles train examples/text-game/guess_the_number.toml`` on the tiny random model (built here, as
``examples/tiny/build_model.py`` builds it), two GRPO steps of textarena's GuessTheNumber played through the
session server (about 40 s of processes starting and training on 2 cores)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.testing.runs import read_metrics, run_miles, tiny_model  # noqa: F401  (a fixture)
from miles.types import Sample

pytest.importorskip("textarena")
pytest.importorskip("miles_fsdp")

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "text-game" / "guess_the_number.toml"


def test_the_text_game_example_is_a_valid_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its settings resolve as ``miles train`` resolves them (the game exists and is single-player, the reward and
    the data are there), without the model the run itself needs."""
    from miles.components import ComponentKind
    from miles.compose import build_run
    from miles.plugins.builtin import BUILTIN_PLUGINS
    from miles.plugins.manager import PluginManager
    from miles.settings.loader import load_settings
    from miles_envs.text_games.games import TextGameRollout

    monkeypatch.chdir(ROOT)
    envs = (("gym_text", "miles_envs.gym_text.plugin"), ("text_games", "miles_envs.text_games.plugin"))
    plugins = PluginManager(builtins=(*BUILTIN_PLUGINS, *envs), entry_points=False).load()
    kinds = (ComponentKind.DATA_SOURCE, ComponentKind.ROLLOUT_FUNCTION, ComponentKind.REWARD)
    run = build_run(load_settings(CONFIG), plugins, kinds=kinds)
    function = run.rollout_function
    assert isinstance(function, TextGameRollout) and function.settings.game == "GuessTheNumber-v0"
    assert [name for name, _, _ in run.rewards()] == ["env_return"]
    assert "between 1 and 10" in function.make_env(None).reset(seed=0)[0]


@pytest.mark.slow
def test_the_text_game_example_trains(tmp_path: Path, tiny_model: Path) -> None:  # noqa: F811
    run_dir = tmp_path / "run"
    out = run_miles(
        "train", str(CONFIG), "--set", f'train.model_path="{tiny_model}"', "--set", f'log.run_dir="{run_dir}"',
        "--set", "precision=fp32",  # the agreement check below is to float32 rounding, on every machine
        cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["sessions/episodes"] == 8 and row["sessions/append_only_violations"] == 0
        assert 1.0 <= row["env/turns_mean"] <= 4.0 and "reward/env_return/mean" in row
        assert 0.0 <= row["fidelity/train_rollout_logprob_abs_diff"] < 1e-4
    for line in (run_dir / "samples" / "rollout_000002.jsonl").read_text().splitlines():
        s = Sample.from_json(line)
        s.validate()
        messages = s.metadata["messages"]
        assert messages[0]["role"] == "system" and "square brackets" in messages[0]["content"]
        assert "You are playing Guess The Number" in messages[1]["content"]  # the game's own prompt
        assert "between 1 and 10" in messages[1]["content"]
        turns = [m for m in messages if m["role"] == "assistant"]
        assert len(turns) == s.metadata["env_turns"] == len(s.metadata["env_rewards"])
        # the game ended (won, lost on invalid moves, or out of guesses) and paid its reward, which trains
        assert s.metadata["env_terminated"] is True and s.reward == s.metadata["env_rewards"][-1]
        assert 0.0 <= s.reward <= 1.0 and sum(s.loss_mask) > 0 and 0 in s.loss_mask
    assert json.loads((run_dir / "settings.json").read_text())["rollout"]["function"]["game"] == "GuessTheNumber-v0"
