"""The allowed-directory check of the weight routes (:mod:`miles.engine.weight_paths`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from miles.engine.options import parse_serve_args
from miles.engine.weight_paths import WeightDirs, parse_weight_dirs


def test_paths_inside_are_allowed_and_resolved(tmp_path: Path) -> None:
    (tmp_path / "run" / "weights" / "v1").mkdir(parents=True)
    dirs = WeightDirs([tmp_path / "run"])
    assert dirs.check(str(tmp_path / "run" / "weights" / "v1"), field="model_path") == (tmp_path / "run/weights/v1")
    assert dirs.check(str(tmp_path / "run"), field="model_path") == tmp_path / "run"
    assert dirs.check(str(tmp_path / "run" / "weights" / ".." / "weights"), field="x") == tmp_path / "run/weights"


@pytest.mark.parametrize("escape", ["sibling", "prefix", "dotdot", "symlink"])
def test_escapes_are_refused_naming_the_field(tmp_path: Path, escape: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (tmp_path / "run-other").mkdir()
    (tmp_path / "secret").mkdir()
    (run / "link").symlink_to(tmp_path / "secret")
    path = {
        "sibling": str(tmp_path / "secret"),
        "prefix": str(tmp_path / "run-other"),  # a string prefix of the allowed directory is not inside it
        "dotdot": str(run / ".." / "secret"),
        "symlink": str(run / "link"),
    }[escape]
    with pytest.raises(PermissionError, match=r"model_path: .* is outside the directories .*--allowed-weight-dirs"):
        WeightDirs([run]).check(path, field="model_path")


def test_the_flag_lists_directories(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    value = os.pathsep.join([str(tmp_path / "a"), "", str(tmp_path / "b")])
    opts = parse_serve_args(["--model", str(tmp_path), "--allowed-weight-dirs", value])
    assert parse_weight_dirs(opts.allowed_weight_dirs) == [tmp_path / "a", tmp_path / "b"]
    assert parse_weight_dirs(None) == []
