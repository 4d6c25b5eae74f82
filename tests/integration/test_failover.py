"""Engines SIGKILLed in the middle of a ``miles train`` run (mid-rollout, midway through a broadcast or a p2p push,
the only engine twice): failed over, restarted, pushed the current weights again, nothing lost."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.testing.run_faults import (
    engine_pid,
    gated,
    kill_in_push_then_hold_until_restarted,
    kill_then_hold_until_restarted,
    train_injecting,
)
from miles.testing.runs import children_of_run, read_metrics, write_run_config

pytestmark = pytest.mark.slow


STEPS = 6  # the failover tests: the kill after step 2; held until the restart serves; it rejoins at a later push


def test_an_engine_sigkilled_mid_rollout_is_failed_over_restarted_and_rejoins(
    tmp_path: Path, tiny_model: Path, prompts: Path
) -> None:
    """2 engines; once step 2 is logged, the engine that takes the next ``/generate`` SIGKILLs itself
    (``MILES_TEST_SIGKILL_IN_GENERATE``): its requests go to the other engine with their seeds, the launcher
    restarts it (``rollout.engine_restarts = 1``), the run is held until the restart serves, the broadcast
    group is formed again and it rejoins; every step has exactly its samples, none twice."""
    run_dir = tmp_path / "run"
    config = write_run_config(tmp_path, tiny_model, prompts, run_dir, ranks=1, rollouts=STEPS)
    text = config.read_text().replace("num_engines = 1", "num_engines = 2")
    config.write_text(text.replace("max_new_tokens = 6", "max_new_tokens = 32\nmin_new_tokens = 32"))
    gate, env = gated(tmp_path, config)
    trigger = tmp_path / "die-in-generate"
    inject = kill_then_hold_until_restarted(run_dir, gate, trigger.touch, lambda: not trigger.exists())
    env["MILES_TEST_SIGKILL_IN_GENERATE"] = str(trigger)
    done, returncode, stderr = train_injecting(config, run_dir, inject, env)
    assert done, stderr[-3000:]
    assert returncode == 0, stderr[-4000:]
    engine_logs = {i: (run_dir / "logs" / f"engine-{i}.log").read_text() for i in (0, 1)}
    dead = next(i for i, text in engine_logs.items() if "killing this engine as a /generate request arrives" in text)
    assert f"engine-{dead} exited (killed by SIGKILL) while the trainers ran: restarting it (restart 1 of 1" in stderr
    trainer_log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert "is down" in trainer_log and "re-sending a /generate" in trainer_log, trainer_log[-3000:]
    assert "forming a new group" in trainer_log and "rejoined at weight version" in trainer_log, trainer_log[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert sum(r["rollout/engine_failures"] for r in rows) == 1
    assert sum(r["rollout/requests_retried"] for r in rows) >= 1
    assert rows[-1]["rollout/engines_serving"] == 2.0
    seen: set[tuple[int, int]] = set()
    for step in range(1, STEPS + 1):
        samples = [
            json.loads(line) for line in (run_dir / "samples" / f"rollout_{step:06d}.jsonl").read_text().splitlines()
        ]
        assert len(samples) == 16  # 4 prompts x 4 samples, every step
        ids = {(s["group_id"], s["index"]) for s in samples}
        assert len(ids) == 16 and not ids & seen
        seen |= ids
        assert all(s["status"] != "failed" and len(s["response_ids"]) == 32 for s in samples)
    assert children_of_run(run_dir) == [] and engine_pid(run_dir, 0) is None and engine_pid(run_dir, 1) is None


def test_an_engine_sigkilled_midway_through_a_push_is_survived_by_pushing_the_version_again(
    tmp_path: Path, tiny_model: Path, prompts: Path
) -> None:
    """2 engines, 2 trainer ranks, broadcast in small buckets. Once step 2 is logged, the engine that takes
    the next push's second bucket SIGKILLs itself (``MILES_TEST_SIGKILL_IN_PUSH``: the other engine has
    loaded the first bucket). The push fails at once (no wait for the group's timeout), the version goes
    again, whole, to the engine left (both ranks gather it again), verified; the run is held until the
    launcher's restart serves, and the restarted engine rejoins at a later push. Every step has exactly its
    samples, each generated on one complete weight version."""
    run_dir = tmp_path / "run"
    config = write_run_config(
        tmp_path, tiny_model, prompts, run_dir, ranks=2, rollouts=STEPS, transport_options="bucket_bytes = 16384"
    )
    config.write_text(config.read_text().replace("num_engines = 1", "num_engines = 2"))
    gate, env = gated(tmp_path, config)
    trigger = tmp_path / "die-in-push"
    env["MILES_TEST_SIGKILL_IN_PUSH"] = str(trigger)
    done, returncode, stderr = train_injecting(
        config, run_dir, kill_in_push_then_hold_until_restarted(run_dir, trigger, gate), env
    )
    assert done, stderr[-3000:]
    assert returncode == 0, stderr[-4000:]
    engine_logs = {i: (run_dir / "logs" / f"engine-{i}.log").read_text() for i in (0, 1)}
    dead = next(i for i, text in engine_logs.items() if "killing this engine in bucket 2" in text)
    assert f"engine-{dead} exited (killed by SIGKILL) while the trainers ran: restarting it" in stderr
    trainer_log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert "failed midway" in trainer_log and "pushing weight version" in trainer_log, trainer_log[-3000:]
    assert "the last push broke the group; forming a new one" in trainer_log, trainer_log[-3000:]
    assert "rejoined at weight version" in trainer_log, trainer_log[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    retried = [r["step"] for r in rows if r.get("weight_sync/retries")]
    assert len(retried) == 1 and retried[0] >= 3, rows
    assert all(r["weight_sync/verified"] == 1.0 for r in rows)
    assert rows[-1]["rollout/engines_serving"] == 2.0  # the restarted engine rejoined
    seen: set[tuple[int, int]] = set()
    for step in range(1, STEPS + 1):
        samples = [
            json.loads(line) for line in (run_dir / "samples" / f"rollout_{step:06d}.jsonl").read_text().splitlines()
        ]
        assert len(samples) == 16
        ids = {(s["group_id"], s["index"]) for s in samples}
        assert len(ids) == 16 and not ids & seen
        seen |= ids
        assert all(s["status"] != "failed" for s in samples)
        # sync training: step k generates on version k - 1 only (never on a half-loaded push)
        assert all({span[2] for span in s["weight_versions"]} == {step - 1} for s in samples), step
    assert children_of_run(run_dir) == [] and engine_pid(run_dir, 0) is None and engine_pid(run_dir, 1) is None


def test_an_engine_sigkilled_midway_through_a_p2p_push_is_survived_by_pushing_the_version_again(
    tmp_path: Path, tiny_model: Path, prompts: Path
) -> None:
    """The mid-push failover above through ``transport = "p2p"`` (the ``torch`` data path: each of the 2
    trainer ranks sends its rows straight to both engines). Once step 2 is logged, the engine that has
    received one chunk of the next push SIGKILLs itself; the push fails on both ranks at once (each gathers
    every rank's outcome), new sessions are opened on the engine left and the version goes to it again,
    whole, verified; the run is held until the launcher's restart serves, and the restarted engine rejoins
    through a new session and a full push. Every step has exactly its samples, each generated on one
    complete weight version."""
    run_dir = tmp_path / "run"
    config = write_run_config(tmp_path, tiny_model, prompts, run_dir, ranks=2, rollouts=STEPS, transport="p2p")
    config.write_text(config.read_text().replace("num_engines = 1", "num_engines = 2"))
    gate, env = gated(tmp_path, config)
    trigger = tmp_path / "die-in-push"
    inject = kill_in_push_then_hold_until_restarted(run_dir, trigger, gate)
    env["MILES_TEST_SIGKILL_IN_PUSH"] = str(trigger)
    done, returncode, stderr = train_injecting(config, run_dir, inject, env)
    assert done, stderr[-3000:]
    assert returncode == 0, stderr[-4000:]
    engine_logs = {i: (run_dir / "logs" / f"engine-{i}.log").read_text() for i in (0, 1)}
    dead = next(i for i, text in engine_logs.items() if "killing this engine in chunk 2" in text)
    assert f"engine-{dead} exited (killed by SIGKILL) while the trainers ran: restarting it" in stderr
    trainer_log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert "did not reach engine" in trainer_log and "pushing weight version 3 again" in trainer_log, trainer_log[
        -3000:
    ]
    assert "opening new sessions" in trainer_log, trainer_log[-3000:]
    assert "rejoined at weight version" in trainer_log, trainer_log[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["step"] for r in rows if r.get("weight_sync/retries")] == [3], rows
    assert all(r["weight_sync/verified"] == 1.0 for r in rows)
    assert rows[-1]["rollout/engines_serving"] == 2.0  # the restarted engine rejoined
    seen: set[tuple[int, int]] = set()
    for step in range(1, STEPS + 1):
        samples = [
            json.loads(line) for line in (run_dir / "samples" / f"rollout_{step:06d}.jsonl").read_text().splitlines()
        ]
        assert len(samples) == 16
        ids = {(s["group_id"], s["index"]) for s in samples}
        assert len(ids) == 16 and not ids & seen
        seen |= ids
        assert all(s["status"] != "failed" for s in samples)
        # sync training: step k generates on version k - 1 only (never on a half-loaded push)
        assert all({span[2] for span in s["weight_versions"]} == {step - 1} for s in samples), step
    assert children_of_run(run_dir) == [] and engine_pid(run_dir, 0) is None and engine_pid(run_dir, 1) is None


WAIT_STEPS = 6


def test_a_run_that_loses_its_only_engine_waits_for_the_restart_and_pushes_it_the_weights(
    tmp_path: Path, tiny_model: Path, prompts: Path
) -> None:
    """1 engine, 2 trainer ranks, broadcast in small buckets, ``rollout.engine_restarts = 2``; the engine dies
    twice and the run waits for it each time instead of stopping. First, once step 1 is logged, it SIGKILLs
    itself as the next ``/generate`` arrives (``MILES_TEST_SIGKILL_IN_GENERATE``): that rollout has no engine
    left, generation waits, rank 0 probes the engine until the launcher's restart answers, both ranks push it
    the current weights (the version the rollout generates on), verified, and the rollout goes on with the
    same seeds. Then, once that step is logged, it dies on the next push's second bucket
    (``MILES_TEST_SIGKILL_IN_PUSH``): the push waits for the next restart and goes to it again, whole,
    verified. Every step has exactly its samples, each on version k - 1."""
    run_dir = tmp_path / "run"
    config = write_run_config(
        tmp_path, tiny_model, prompts, run_dir, ranks=2, rollouts=WAIT_STEPS, transport_options="bucket_bytes = 16384"
    )
    config.write_text(config.read_text().replace("temperature = 1.0", "temperature = 1.0\nengine_restarts = 2"))
    in_generate, in_push = tmp_path / "die-in-generate", tmp_path / "die-in-push"

    armed: list[Path] = []

    def arm(steps: int) -> bool:
        if steps >= 1 and not armed:
            in_generate.touch()  # the engine dies at the first /generate of a later rollout
            armed.append(in_generate)
        elif armed == [in_generate] and any(r.get("weight_sync/rejoin_pushes") for r in read_metrics(run_dir)):
            in_push.touch()  # that rollout's wait is over: the engine dies in the next push
            armed.append(in_push)
        return len(armed) == 2

    env = {"MILES_TEST_SIGKILL_IN_GENERATE": str(in_generate), "MILES_TEST_SIGKILL_IN_PUSH": str(in_push)}
    done, returncode, stderr = train_injecting(config, run_dir, arm, env)
    assert done, stderr[-3000:]
    assert returncode == 0, stderr[-4000:]
    assert not in_generate.exists() and not in_push.exists()  # the engine took both
    engine_log = (run_dir / "logs" / "engine-0.log").read_text()
    assert "killing this engine as a /generate request arrives" in engine_log
    assert "killing this engine in bucket 2 of a weight push" in engine_log
    for n in (1, 2):
        assert f"engine-0 exited (killed by SIGKILL) while the trainers ran: restarting it (restart {n} of 2" in stderr
    trainer_log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert "no engine serves" in trainer_log and "generation waits up to" in trainer_log, trainer_log[-3000:]
    assert "no engine is left" in trainer_log and "pushing weight version" in trainer_log, trainer_log[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, WAIT_STEPS + 1))
    waited = [r["step"] for r in rows if r.get("weight_sync/rejoin_pushes")]
    retried = [r["step"] for r in rows if r.get("weight_sync/retries")]
    assert len(waited) == 1 and waited[0] >= 2 and rows[waited[0] - 1]["weight_sync/rejoin_pushes"] == 1.0, rows
    assert len(retried) == 1 and retried[0] > waited[0] and rows[retried[0] - 1]["weight_sync/retries"] == 1.0, rows
    assert sum(r["rollout/engine_failures"] for r in rows) == 2
    assert sum(r["rollout/requests_retried"] for r in rows) >= 1
    assert all(r["weight_sync/verified"] == 1.0 and r["rollout/engines_serving"] == 1.0 for r in rows)
    seen: set[tuple[int, int]] = set()
    for step in range(1, WAIT_STEPS + 1):
        samples = [
            json.loads(line) for line in (run_dir / "samples" / f"rollout_{step:06d}.jsonl").read_text().splitlines()
        ]
        assert len(samples) == 16
        ids = {(s["group_id"], s["index"]) for s in samples}
        assert len(ids) == 16 and not ids & seen
        seen |= ids
        assert all(s["status"] != "failed" for s in samples)
        assert all({span[2] for span in s["weight_versions"]} == {step - 1} for s in samples), step
    assert children_of_run(run_dir) == [] and engine_pid(run_dir, 0) is None
