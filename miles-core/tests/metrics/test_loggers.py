from __future__ import annotations

import json
import time
from pathlib import Path

from miles.components import ComponentKind
from miles.plugins import PluginManager
from miles.settings import PluginSpec


def test_jsonl_logger_appends_steps(tmp_path: Path) -> None:
    pm = PluginManager(entry_points=False).load()
    logger = pm.create(ComponentKind.LOGGER, PluginSpec(name="jsonl"), field="log.loggers[0]", run_dir=str(tmp_path))
    logger.log(1, {"rollout/reward_mean": 0.25, "train/loss": float("nan")})
    logger.log(2, {"rollout/reward_mean": 0.5})
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [
        {"step": 1, "rollout/reward_mean": 0.25, "train/loss": None},
        {"step": 2, "rollout/reward_mean": 0.5},
    ]


def test_tensorboard_logger_writes_readable_events(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    pm = PluginManager(entry_points=False).load()
    logger = pm.create(
        ComponentKind.LOGGER, PluginSpec(name="tensorboard"), field="log.loggers[0]", run_dir=str(tmp_path)
    )
    for step in range(1, 4):
        logger.log(step, {"rollout/reward_mean": step / 10})
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("rollout/reward_mean")
    assert [(e.step, round(e.value, 6)) for e in scalars] == [(1, 0.1), (2, 0.2), (3, 0.3)]


def test_wandb_logger_writes_an_offline_run(tmp_path: Path) -> None:
    pm = PluginManager(entry_points=False).load()
    logger = pm.create(
        ComponentKind.LOGGER,
        PluginSpec(name="wandb", project="miles-test"),
        field="log.loggers[0]",
        run_dir=str(tmp_path),
    )
    for step in range(1, 4):
        logger.log(step, {"rollout/reward_mean": step / 10 + 0.01})
    logger.close()
    files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    # wandb's service process finishes writing the run file after finish() returns
    deadline = time.monotonic() + 60
    while (data := files[0].read_bytes()).count(b"rollout/reward_mean") < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    # history records are protobuf messages with the key and the JSON value as plain strings
    assert data.count(b"rollout/reward_mean") >= 3
    for value in (b"0.11", b"0.21", b"0.31"):
        assert value in data
