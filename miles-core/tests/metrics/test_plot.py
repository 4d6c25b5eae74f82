from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.metrics.plot import panels_for, plot_run, read_metrics, run_title


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


def test_the_plot_has_a_title_naming_the_run(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [{"step": i, "rollout/reward_mean": 0.1 * i} for i in range(3, 9)]
    assert run_title(tmp_path, rows) == f"{tmp_path}: steps 3-8"
    settings = {"algorithm": {"name": "grpo"}, "train": {"model_path": "/models/SmolLM2-135M"}}
    (tmp_path / "settings.json").write_text(json.dumps(settings))
    assert run_title(tmp_path, rows) == f"{tmp_path}: grpo on SmolLM2-135M, steps 3-8"
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    titles: list[str] = []
    real = plt.Figure.savefig

    def spy(fig: plt.Figure, *args: object, **kwargs: object) -> None:
        titles.append(fig.get_suptitle())
        real(fig, *args, **kwargs)

    plt.Figure.savefig = spy
    try:
        plot_run(tmp_path)
        plot_run(tmp_path, tmp_path / "other.png", title="mine")
    finally:
        plt.Figure.savefig = real
    assert titles == [f"{tmp_path}: grpo on SmolLM2-135M, steps 3-8", "mine"]
