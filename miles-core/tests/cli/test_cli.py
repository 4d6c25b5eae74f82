from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def miles(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "miles", *args], capture_output=True, text=True, env=full_env, timeout=120
    )


def test_version_lists_installed_packages() -> None:
    out = miles("--version")
    assert out.returncode == 0
    assert "miles-core 0.1.0" in out.stdout.splitlines()


def test_plugins_list_json_schema_and_hook_filter() -> None:
    out = miles("plugins", "list", "--json", "--hook", "miles_register_precisions")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["schema_version"] == 1
    names = [p["name"] for p in data["plugins"]]
    assert "precision" in names and "jsonl" not in names
    entry = next(p for p in data["plugins"] if p["name"] == "precision")
    assert set(entry) == {
        "name",
        "distribution",
        "version",
        "builtin",
        "status",
        "error",
        "registers",
        "hooks",
        "commands",
    }
    assert {"kind": "precision", "name": "bf16"} in entry["registers"]


def test_plugins_list_shows_blocked(tmp_path: Path) -> None:
    out = miles("plugins", "list", env={"MILES_DISABLE_PLUGINS": "jsonl", "COLUMNS": "200"})
    assert out.returncode == 0
    line = next(line for line in out.stdout.splitlines() if line.startswith("│ jsonl "))
    assert "blocked" in line


@pytest.mark.parametrize(
    ("config", "args", "message"),
    [
        ('[train]\nlr = "fast"\n', [], "train.lr ({path}:2): Input should be a valid number"),
        (
            '[precision]\nname = "fp7"\n',
            [],
            "precision.name ({path}:2): unknown precision 'fp7' (available: bf16, fp32, fp8, mxfp8, nvfp4)",
        ),
        ("", ["--set", "precision=fp7"], "precision (--set precision=fp7): unknown precision 'fp7'"),
    ],
)
def test_train_config_errors_exit_2_without_traceback(
    tmp_path: Path, config: str, args: list[str], message: str
) -> None:
    path = tmp_path / "run.toml"
    path.write_text(config)
    out = miles("train", "--dry-run", str(path), *args, env={"COLUMNS": "300"})
    assert out.returncode == 2, out.stdout + out.stderr
    assert message.format(path=path) in " ".join(out.stderr.split())
    assert "Traceback" not in out.stderr


def test_usage_errors_exit_2_without_traceback() -> None:
    out = miles("train", "--bogus")
    assert out.returncode == 2
    assert "No such option: --bogus" in out.stderr and "Traceback" not in out.stderr


COMMANDS_PLUGIN = '''
import typer
import miles

tools = typer.Typer(help="The example's tools.")


@tools.command("count")
def count(text: str) -> None:
    """Print how many words ``text`` has."""
    typer.echo(f"{len(text.split())} words")


@miles.hookimpl
def miles_register_commands(app):
    app.add_typer(tools, name="example-tools")
'''

CLASHING_PLUGIN = """
import miles


@miles.hookimpl
def miles_register_commands(app):
    app.command("train")(lambda: None)  # "train" is a built-in command
"""

RAISING_PLUGIN = """
import miles


@miles.hookimpl
def miles_register_commands(app):
    raise RuntimeError("no such tool")
"""


def test_plugins_add_commands_and_a_broken_one_is_reported(fake_distribution: Any) -> None:
    fake_distribution("miles-tools", {"tools": "miles_tools_plugin"}, {"miles_tools_plugin": COMMANDS_PLUGIN})
    fake_distribution("miles-clash", {"clash": "miles_clash_plugin"}, {"miles_clash_plugin": CLASHING_PLUGIN})
    fake_distribution("miles-raise", {"raising": "miles_raise_plugin"}, {"miles_raise_plugin": RAISING_PLUGIN})
    out = miles("example-tools", "count", "one two three")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3 words"
    listed = miles("plugins", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    plugins = {p["name"]: p for p in json.loads(listed.stdout)["plugins"]}
    assert plugins["tools"]["status"] == "ok" and plugins["tools"]["commands"] == ["example-tools"]
    assert plugins["clash"]["status"] == "failed" and "command 'train' is already taken" in plugins["clash"]["error"]
    assert plugins["raising"]["status"] == "failed" and "RuntimeError: no such tool" in plugins["raising"]["error"]
    table = miles("plugins", "list")
    assert "command: miles example-tools" in table.stdout
    # the built-in command the clashing plugin tried to replace is still the real one
    assert "Train a policy" in miles("train", "--help").stdout


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from miles.testing.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("cli-model") / "tiny", "qwen2", seed=0)


def _config(tmp_path: Path, model: Path | str, data: Path, run_dir: Path) -> Path:
    path = tmp_path / "quick.toml"
    path.write_text(f'[data]\npath = "{data}"\n\n[train]\nmodel_path = "{model}"\n\n[log]\nrun_dir = "{run_dir}"\n')
    return path


def _data(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_a_run_dir_holding_a_run_is_refused_and_nothing_is_lost(tmp_path: Path, tiny: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "rollout/reward_mean": 0.5}\n')
    config = _config(tmp_path, tiny, _data(tmp_path, ['{"prompt": "1+1?", "label": "2"}']), run_dir)
    out = miles("train", str(config), env={"COLUMNS": "300"})
    assert out.returncode == 2, out.stdout + out.stderr
    said = " ".join(out.stderr.split())
    assert f"log.run_dir ({config}:8): {run_dir} already holds a run (metrics.jsonl, logs)" in said
    # it saved no checkpoint: only what works is suggested (issue 42)
    assert "saved no checkpoint" in said and "--resume" not in said and "--overwrite" in said
    assert "Traceback" not in said
    # a failing run never touches the earlier one's results, even with --overwrite
    bad = _config(tmp_path, tmp_path / "no-model", tmp_path / "train.jsonl", run_dir)
    out = miles("train", str(bad), "--overwrite")
    assert out.returncode == 2 and "train.model_path" in out.stderr
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1, "rollout/reward_mean": 0.5}\n'


def test_dry_run_checks_the_model_and_every_data_row(tmp_path: Path, tiny: Path) -> None:
    good = _data(tmp_path, ['{"prompt": "1+1?", "label": "2"}'])
    config = _config(tmp_path, tmp_path / "missing-model", good, tmp_path / "run")
    out = miles("train", "--dry-run", str(config), env={"COLUMNS": "300"})
    assert out.returncode == 2
    said = " ".join(out.stderr.split())
    assert f"train.model_path ({config}:5): '{tmp_path / 'missing-model'}' is not a Hugging Face model" in said
    data = _data(tmp_path, ['{"prompt": "1+1?"}', '{"prompt": "2+2?"}', '{"prompt": "3+3?", }'])
    config = _config(tmp_path, tiny, data, tmp_path / "run")
    out = miles("train", "--dry-run", str(config), env={"COLUMNS": "300"})
    assert out.returncode == 2
    said = " ".join(out.stderr.split())
    assert f"data.path ({config}:2): train.jsonl:3: invalid JSON" in said, said
    assert said.count("invalid JSON") == 1
    _data(tmp_path, ['{"prompt": "1+1?"}', '{"question": "2+2?"}'])
    out = miles("train", "--dry-run", str(config), env={"COLUMNS": "300"})
    assert "train.jsonl:2: missing key 'prompt' (data.prompt_key; row keys: question)" in " ".join(out.stderr.split())


def miles_without(modules: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    """``miles ARGS`` in a process where ``modules`` cannot be imported (nor found), as if not installed."""
    import os

    code = (
        f"import sys; sys.modules.update(dict.fromkeys({modules!r})); from miles.cli import main; main({list(args)!r})"
    )
    env = {**os.environ, "COLUMNS": "300"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_a_missing_extra_is_refused_for_every_selected_component_before_anything_starts(
    tmp_path: Path, tiny: Path
) -> None:
    run_dir = tmp_path / "run"
    config = _config(tmp_path, tiny, _data(tmp_path, ['{"prompt": "1+1?", "label": "2"}']), run_dir)
    config.write_text(
        config.read_text()
        + '\n[precision]\nname = "fp8"\n'
        + '\n[[log.loggers]]\nname = "jsonl"\n\n[[log.loggers]]\nname = "wandb"\n'
        + '\n[[reward.functions]]\nname = "math"\n'
    )
    present = miles("train", "--dry-run", str(config), env={"COLUMNS": "300"})
    assert " needs " not in present.stderr, present.stderr  # the extras are installed here
    assert present.returncode == 0 or "unknown trainer 'fsdp'" in present.stderr  # (miles-core alone: no trainer)
    for args in (["train", "--dry-run", str(config)], ["train", str(config)]):
        out = miles_without(["torchao", "wandb", "math_verify"], *args)
        assert out.returncode == 2, out.stdout + out.stderr
        said = " ".join(out.stderr.split())
        assert f"precision ({config}:10): precision 'fp8' needs torchao, which is not installed: " in said
        assert 'pip install "miles-core[quant]"' in said
        assert "log.loggers[1]" in said and "logger 'wandb' needs wandb" in said, said
        assert 'pip install "miles-core[wandb]"' in said
        assert "reward.functions[0]" in said and "reward 'math' needs math-verify" in said
        assert 'pip install "miles-core[math]"' in said and "Traceback" not in said
        assert not run_dir.exists()  # the real start stopped before anything was launched


def test_train_without_a_config_says_so() -> None:
    out = miles("train")
    assert out.returncode == 2 and "no config given" in out.stderr and "Traceback" not in out.stderr


GROUP_PLUGIN = '''
import typer
import miles


def add_to_convert(app):
    (group,) = [g.typer_instance for g in app.registered_groups if g.name == "convert"]
    return group


@miles.hookimpl
def miles_register_commands(app):
    @add_to_convert(app).command("shout")
    def shout(text: str) -> None:
        """Print ``text`` in capitals."""
        typer.echo(text.upper())
'''

GROUP_CLASH_PLUGIN = """
import miles


@miles.hookimpl
def miles_register_commands(app):
    (group,) = [g.typer_instance for g in app.registered_groups if g.name == "convert"]
    group.command("whisper")(lambda: None)  # its own, fine alone
    group.command("gguf")(lambda: None)  # the built-in "miles convert gguf"
"""


def test_plugins_add_commands_to_a_built_in_group(fake_distribution: Any) -> None:
    """A plugin may add subcommands to ``miles convert``; one that takes a name already there is refused and
    none of its subcommands stay (the built-in keeps working)."""
    fake_distribution("miles-shout", {"shout": "miles_shout_plugin"}, {"miles_shout_plugin": GROUP_PLUGIN})
    fake_distribution("miles-gclash", {"gclash": "miles_gclash_plugin"}, {"miles_gclash_plugin": GROUP_CLASH_PLUGIN})
    out = miles("convert", "shout", "quiet")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "QUIET"
    plugins = {p["name"]: p for p in json.loads(miles("plugins", "list", "--json").stdout)["plugins"]}
    assert plugins["shout"]["status"] == "ok" and plugins["shout"]["commands"] == ["convert shout"]
    assert plugins["gclash"]["status"] == "failed"
    assert "command 'convert gguf' is already taken" in plugins["gclash"]["error"]
    assert miles("convert", "whisper").returncode == 2  # rolled back with the clash
    assert "Dequantise a GGUF model" in miles("convert", "gguf", "--help").stdout
