from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.metrics.plot import panels_for, plot_run, read_metrics


def test_plot_writes_a_png_with_the_logged_panels(tmp_path: Path) -> None:
    rows = [
        {"step": i, "rollout/reward_mean": 0.1 * i, "time/step_seconds": 2.0 + i, "train/kl": None} for i in range(1, 6)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = plot_run(tmp_path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert len(read_metrics(tmp_path)) == 5
    # every panel has a y label; no KL panel without a KL term, an entropy panel titled as such
    assert panels_for(rows) == [
        ("reward", "mean reward", ["rollout/reward_mean"]),
        ("step time", "seconds", ["time/step_seconds"]),
    ]
    with_kl = [{**r, "train/kl": 0.01 * r["step"], "train/entropy": 1.5} for r in rows]
    assert [(title, keys) for title, _, keys in panels_for(with_kl)][1:3] == [
        ("KL to the reference", ["train/kl"]),
        ("entropy", ["train/entropy"]),
    ]


def test_plot_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not JSON"):
        read_metrics(tmp_path)
