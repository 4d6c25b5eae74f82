"""``miles bench``: finds the repository's benchmarks/, lists them, runs one with the arguments forwarded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def miles(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "miles", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120
    )


def _suite(root: Path) -> Path:
    folder = root / "benchmarks"
    folder.mkdir(parents=True)
    (folder / "run_all.py").write_text('"""Run everything."""\nif __name__ == "__main__":\n    pass\n')
    (folder / "common.py").write_text('"""Helpers, not a benchmark."""\n')
    (folder / "echo.py").write_text(
        '"""Write argv and exit with the code given."""\n'
        "import json, sys\n"
        "from pathlib import Path\n"
        'if __name__ == "__main__":\n'
        "    Path(sys.argv[1]).write_text(json.dumps(sys.argv[2:]))\n"
        "    sys.exit(int(sys.argv[2]))\n"
    )
    return folder


def test_lists_the_repository_benchmarks_from_a_subfolder() -> None:
    out = miles("bench", cwd=REPO / "docs")
    assert out.returncode == 0, out.stderr
    names = {line.split()[0] for line in out.stdout.splitlines()[1:] if line.strip()}
    assert {"grpo_vs_trl", "weight_sync", "scaling", "run_all", "engine"} <= names
    assert "common" not in names


def test_forwards_arguments_and_exit_code(tmp_path: Path) -> None:
    _suite(tmp_path)
    out_file = tmp_path / "argv.json"
    ok = miles("bench", "echo", str(out_file), "0", "--quick", "--sizes", "9M", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(out_file.read_text()) == ["0", "--quick", "--sizes", "9M"]
    failed = miles("bench", "echo", str(out_file), "3", cwd=tmp_path)
    assert failed.returncode == 3


def test_benchmarks_dir_option(tmp_path: Path) -> None:
    folder = _suite(tmp_path / "elsewhere")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    out = miles("bench", "--benchmarks-dir", str(folder), cwd=elsewhere)
    assert out.returncode == 0, out.stderr
    assert "echo" in out.stdout and "common" not in out.stdout


def test_missing_folder_and_unknown_benchmark_are_named(tmp_path: Path) -> None:
    out = miles("bench", "scaling", cwd=tmp_path)
    assert out.returncode == 1
    assert "no benchmarks/ folder" in out.stderr and str(tmp_path) in out.stderr.replace("\n", "")
    _suite(tmp_path)
    out = miles("bench", "nope", cwd=tmp_path)
    assert out.returncode == 1
    assert "nope" in out.stderr and "echo" in out.stderr
