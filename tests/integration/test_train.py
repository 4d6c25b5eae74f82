"""End-to-end runs of ``miles train`` in the sync mode on this CPU: a real engine process, real trainer ranks over
gloo, real weight pushes with verification, checkpoints and an exact resume, colocation, a multi-turn rollout
function. SFT and ``miles generate``: ``test_sft_and_generate.py``; ``--debug``: ``test_debug.py``; engines
killed mid-run: ``test_failover.py``; the async modes: ``test_async.py``."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.driver.colocate import PHASES
from miles.testing.run_faults import (
    kill_rank_after,
)
from miles.testing.runs import (
    children_of_run,
    hf_weights,
    leaked_torch_segments,
    read_metrics,
    run_miles,
    torch_segments,
    write_run_config,
)

pytestmark = pytest.mark.slow


ROOT = Path(__file__).resolve().parents[2]


CHECKPOINTED = """
[checkpoint]
save_interval = 2

[rollout.engine]
name = "local"
enable_deterministic_inference = true
"""


def test_grpo_broadcast_checkpoint_and_exact_resume(tmp_path: Path, tiny_model: Path, prompts: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    full_dir = tmp_path / "full"
    config = write_run_config(tmp_path, tiny_model, prompts, full_dir, CHECKPOINTED)
    out = run_miles("train", str(config))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = read_metrics(full_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["weight_sync/verified"] == 1.0 and row["weight_sync/verified_tensors"] > 0
        assert 0.0 <= row["fidelity/train_rollout_logprob_abs_diff"] < 1e-4
        assert row["rollout/prefix_cache_hit_rate"] > 0.5  # 3 of 4 samples per group reuse the prompt
    assert (full_dir / "checkpoints" / "step_000002" / "driver.json").exists()
    model = AutoModelForCausalLM.from_pretrained(full_dir / "hf")  # strict keys: transformers raises on mismatch
    assert sum(p.numel() for p in model.parameters()) > 0
    assert children_of_run(full_dir) == []

    # the same run with trainer rank 1 SIGKILLed in step 3, after the step-2 checkpoint: the run stops
    # within 30 s naming the rank, nothing is left running, and --resume from its step-2 checkpoint gives
    # the uninterrupted run's metrics and bit-identical final weights
    part_dir = tmp_path / "part"
    config = write_run_config(tmp_path, tiny_model, prompts, part_dir, CHECKPOINTED, rollouts=3)
    killed_at, out = kill_rank_after(
        config, part_dir, rank=1, when=part_dir / "checkpoints" / "step_000002" / "driver.json"
    )
    assert out.returncode != 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert time.monotonic() - killed_at < 30
    said = " ".join(out.stderr.split())
    assert "trainer-1" in said and "SIGKILL" in said, said[-3000:]
    assert children_of_run(part_dir) == []
    assert [r["step"] for r in read_metrics(part_dir)] == [1, 2]
    out = run_miles("train", str(config), "--resume", str(part_dir))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    resumed = read_metrics(part_dir)
    assert resumed[-1]["step"] == 3
    # with deterministic inference the engine's logprobs (fidelity/*), the prefix-cache hit rate, samples,
    # rewards, losses and grad norms are all bit for bit the uninterrupted run's; only timings differ
    timings = ("time/", "seconds", "per_second")
    compared = [key for key in rows[-1] if not any(s in key for s in timings)]
    assert "fidelity/train_rollout_logprob_abs_diff" in compared and "rollout/prefix_cache_hit_rate" in compared
    for key in compared:
        assert resumed[-1][key] == rows[-1][key], key
    full_w, part_w = hf_weights(full_dir / "hf"), hf_weights(part_dir / "hf")
    assert full_w.keys() == part_w.keys()
    for name in full_w:
        assert torch.equal(full_w[name], part_w[name]), name  # type: ignore[arg-type]
    assert children_of_run(part_dir) == []


def test_colocated_disk_transport_with_periodic_eval(tmp_path: Path, tiny_model: Path, prompts: Path) -> None:
    """Colocated, each side gives its memory back while the other works, in one phase order (read back from
    rank 0's log): the trainer offloads (here on a CPU, ``cluster.offload_trainer``: the same code as on a
    GPU) before the engines start and while they roll out, the engines release theirs while it trains; the
    push restores every tensor and the engines generate on the pushed weights."""
    run_dir = tmp_path / "disk"
    config = write_run_config(
        tmp_path, tiny_model, prompts, run_dir, ranks=1, transport="disk", rollouts=2,
        transport_options="keep_after_run = true",
    )  # fmt: skip
    evaluation = [
        "--set",
        f"data.eval_path={json.dumps(str(prompts))}",
        "--set",
        "train.eval_interval=1",
        "--set",
        "train.eval_pass_k=[1, 2]",
    ]
    # one optimizer step per rollout at temperature 0.7: the PPO ratio must be exactly 1 (the trainer scores
    # at the temperature the engine sampled at)
    on_policy = ["--set", "train.global_batch_size=16", "--set", "rollout.temperature=0.7"]
    colocated = ["--set", "cluster.colocate=true", "--set", "cluster.offload_trainer=true"]
    out = run_miles("train", str(config), *colocated, *evaluation, *on_policy)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    phases = [
        (m.group(1), float(m.group(2)))
        for m in re.finditer(
            r"colocation: ([a-z ]+?)(?:: [^\n]*?)? \(trainer holds ([0-9.]+) MB",
            (run_dir / "logs" / "trainer-0.log").read_text(),
        )
    ]
    steps = ["trainer offload", *PHASES, *PHASES]  # loaded, then two steps (a checkpoint after them: offload)
    assert [p for p, _ in phases][: len(steps)] == steps and {p for p, _ in phases[len(steps) :]} <= {"trainer offload"}
    held = dict.fromkeys(p for p, _ in phases)
    for phase, mb in phases:
        held[phase] = max(mb, held[phase] or 0.0)
    assert held["trainer offload"] == held["rollout"] == held["trainer offload weights"] == 0.0
    assert held["train"] and held["trainer offload state"] and held["push"]  # the weights stay for the push
    assert held["push"] < held["train"]  # (the optimizer state left before the push)
    host = out.stderr + out.stdout
    assert "the trainer ranks have loaded and offloaded; starting the engines" in host
    rows = read_metrics(run_dir)
    assert [r["weight_sync/verified"] for r in rows] == [1.0, 1.0]
    for row in rows:
        assert 0.0 <= row["eval/pass@1"] <= row["eval/pass@2"] <= 1.0
        assert "eval/reward_mean" in row
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == ["v2"]  # older versions removed
    engine_log = (run_dir / "logs" / "engine-0.log").read_text()
    assert engine_log.count("released kv_cache, weights, cuda_graph") == 2
    assert engine_log.count("resumed weights") == 2 and engine_log.count("resumed kv_cache, cuda_graph") == 2
    for row in rows:
        assert row["fidelity/train_rollout_logprob_abs_diff"] < 1e-4  # the engine generated on restored weights
        assert row["train/ratio"] == pytest.approx(1.0, abs=1e-5) and row["train/clipfrac"] == 0.0


def test_colocated_tensor_ipc_hands_each_engine_its_ranks_tensors(
    tmp_path: Path, tiny_model: Path, prompts: Path
) -> None:
    """Two colocated engines, each fed by the trainer rank beside it: every rank keeps the full tensors of each
    bucket and makes handles of them (shared memory on a CPU, CUDA IPC on a GPU: one code path), rank 0 sends
    each engine its rank's payload through ``/update_weights_from_tensor``; every push is verified by checksum
    and the engines generate on the pushed weights. Nothing of the shared memory outlives the run."""

    run_dir = tmp_path / "ipc"
    config = write_run_config(tmp_path, tiny_model, prompts, run_dir, ranks=2, transport="tensor_ipc", rollouts=2)
    before = torch_segments()
    out = run_miles("train", str(config), "--set", "cluster.colocate=true", "--set", "cluster.num_engines=2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["weight_sync/verified"] == 1.0 and row["weight_sync/verified_tensors"] > 0
        assert row["fidelity/train_rollout_logprob_abs_diff"] < 1e-4  # both engines serve the pushed weights
    trainer = (run_dir / "logs" / "trainer-0.log").read_text()
    assert re.search(r"tensor_ipc: version 2, \d+ tensors to 2 engines", trainer), trainer[-2000:]
    assert leaked_torch_segments(before) == []
    assert children_of_run(run_dir) == []


FAULTY = """
from miles.markers import hookimpl
from miles.transport.disk import DiskTransport


def drop(bucket):
    return [(n, t) for n, t in bucket if n != "model.norm.weight"]


class SkippingDisk(DiskTransport):
    '''Drops one tensor from every push (in line or staged): what verification exists to catch.'''

    name = "skipping_disk"

    async def stage(self, buckets, **kwargs):  # every push (in line or overlapped) goes through stage
        return await super().stage((drop(b) for b in buckets), **kwargs)


@hookimpl
def miles_register_transports(register):
    register(SkippingDisk)
"""


@pytest.mark.parametrize("mode", ["sync", "fully_async"])
def test_skipped_tensor_is_caught_by_name(tmp_path: Path, tiny_model: Path, prompts: Path, mode: str) -> None:
    """In line (sync) and staged with the commit overlapping the next step (fully_async, 2 steps)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "miles_faulty.py").write_text(FAULTY)
    info = site / "miles_faulty-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: miles-faulty\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[miles.plugins]\nfaulty = miles_faulty\n")
    run_dir = tmp_path / "faulty"
    config = write_run_config(
        tmp_path,
        tiny_model,
        prompts,
        run_dir,
        '\n[rollout.engine]\nname = "local"\nenable_debug_endpoints = true\n',
        ranks=1,
        transport="skipping_disk",
        transport_options="randomize_engines_first = true",
        rollouts=1 if mode == "sync" else 2,
    )
    config.write_text(config.read_text().replace("temperature = 1.0", f'temperature = 1.0\nmode = "{mode}"'))
    out = run_miles(
        "train", str(config), env={"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    )
    assert out.returncode != 0
    log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert "1 tensor(s) were not updated by the push, e.g. 'model.norm.weight'" in log
    if mode == "fully_async":  # version 1's commit failed while step 2 trained: step 2 never completed
        assert [r["step"] for r in read_metrics(run_dir)] == [1]
    assert children_of_run(run_dir) == []


def test_a_failure_on_the_driver_rank_ends_the_run_with_its_error(
    tmp_path: Path, tiny_model: Path, prompts: Path
) -> None:
    """Rank 0 fails in set-up (the tokenised prompts are all over ``data.max_prompt_tokens``) while rank 1
    waits for its first batch: the run exits non-zero naming the cause, and no process is left behind (it
    used to hang in a teardown barrier). A missing data file is caught earlier: by the settings pass, before
    any process starts."""
    run_dir = tmp_path / "too-long"
    config = write_run_config(tmp_path, tiny_model, prompts, run_dir, ranks=2)
    config.write_text(config.read_text().replace("[data]\npath", "[data]\nmax_prompt_tokens = 1\npath", 1))
    out = run_miles("train", str(config), timeout=240)
    assert out.returncode != 0
    log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert "no prompts (all 24 dropped by the pipeline)" in log, log[-2000:]
    assert children_of_run(run_dir) == []
    missing = tmp_path / "missing-data"
    config = write_run_config(tmp_path, tiny_model, tmp_path / "no-such.jsonl", missing, ranks=2)
    out = run_miles("train", str(config), timeout=240)
    assert out.returncode == 2 and "no-such.jsonl: no such file or directory (data.path)" in out.stderr
    assert not (missing / "logs").exists()  # nothing was started


TWO_TURNS = """
from dataclasses import replace

from miles.types import SampleStatus, WeightSpan

TOOL = [13, 14, 15]  # token ids of a pretend tool result, appended exactly (never re-tokenised)


async def two_turns(client, sample, params):
    key = f"group-{sample.group_id}"
    first = (await client.generate(sample.prompt_ids, replace(params, n=1), routing_key=key))[0]
    context = sample.prompt_ids + first.output_ids + TOOL
    second = (await client.generate(context, replace(params, n=1), routing_key=key))[0]
    response = first.output_ids + TOOL + second.output_ids
    return replace(
        sample,
        response_ids=response,
        rollout_logprobs=first.output_logprobs + [0.0] * len(TOOL) + second.output_logprobs,
        loss_mask=[1] * len(first.output_ids) + [0] * len(TOOL) + [1] * len(second.output_ids),
        response=first.text + second.text,
        status=SampleStatus.COMPLETED,
        weight_versions=[WeightSpan(0, len(response), int(second.weight_version or 0))],
        metadata={**sample.metadata, "turns": 2, "second_turn_cached_tokens": second.cached_tokens},
    )
"""


def test_custom_multi_turn_rollout_function_trains(tmp_path: Path, tiny_model: Path, prompts: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "my_agent.py").write_text(TWO_TURNS)
    run_dir = tmp_path / "agent"
    config = write_run_config(tmp_path, tiny_model, prompts, run_dir, ranks=1, transport="disk", rollouts=1)
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    out = run_miles(
        "train", str(config), "--set", 'rollout.function="my_agent:two_turns"',
        "--set", 'log.trainer_logprobs="always"', env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    from miles.types import Sample

    samples = [
        Sample.from_json(line) for line in (run_dir / "samples" / "rollout_000001.jsonl").read_text().splitlines()
    ]
    assert len(samples) == 16
    for s in samples:
        s.validate()
        assert s.metadata["turns"] == 2
        first = s.loss_mask.index(0)
        assert s.response_ids[first : first + 3] == [13, 14, 15] and s.loss_mask[first : first + 3] == [0, 0, 0]
        assert s.metadata["second_turn_cached_tokens"] >= len(s.prompt_ids)  # the first turn's context was cached
    row = read_metrics(run_dir)[0]
    assert row["fidelity/train_rollout_logprob_abs_diff"] < 1e-4  # tool tokens excluded from the comparison
    # the trainer's own logprobs of every token, kept beside the samples: equal to the engine's on policy tokens
    recorded = [
        json.loads(line) for line in (run_dir / "samples" / "trainer_logprobs_000001.jsonl").read_text().splitlines()
    ]
    assert [(r["group_id"], r["index"]) for r in recorded] == [(s.group_id, s.index) for s in samples]
    for r, s in zip(recorded, samples, strict=True):
        assert len(r["logprobs"]) == s.response_length
        diffs = [abs(a - b) for a, b, m in zip(r["logprobs"], s.rollout_logprobs, s.loss_mask, strict=True) if m]
        assert max(diffs) < 1e-4
    view_in_browser(run_dir, tmp_path, samples)


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def view_in_browser(run_dir: Path, tmp_path: Path, samples: list[object]) -> None:
    """``miles view`` on the run, rendered by a real headless Chromium: the page shows the run's samples
    (asserted on the DOM); a screenshot is kept in .test-artifacts/."""
    browser = chromium()
    if browser is None:
        if os.environ.get("MILES_REQUIRE_BROWSER"):
            pytest.fail("MILES_REQUIRE_BROWSER is set but no chromium is installed (apt-get install chromium)")
        pytest.skip("no chromium (apt-get install chromium) to render miles view")
    from miles.net import free_port

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "miles", "view", str(run_dir), "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        import httpx

        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.communicate()[0]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/run", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
        flags = [
            browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
            f"--user-data-dir={tmp_path / 'chromium-profile'}", "--virtual-time-budget=20000",
        ]  # fmt: skip
        url = f"http://127.0.0.1:{port}/"
        dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=180).stdout
        artifacts = ROOT / ".test-artifacts"
        artifacts.mkdir(exist_ok=True)
        shot = artifacts / "miles-view.png"
        subprocess.run(
            [*flags, "--window-size=1400,1800", f"--screenshot={shot}", url], capture_output=True, timeout=180
        )
    finally:
        server.terminate()
        server.communicate(timeout=30)  # reads and closes its output
    assert 'data-ready="1"' in dom, dom[-3000:]
    assert dom.count('class="sample"') == len(samples) == 16
    assert dom.count('class="group"') == 4 and 'data-step="1"' in dom
    assert dom.count('data-by="environment"') == 16  # every episode's tool turn, shaded
    assert dom.count('class="tok masked"') == 16 * 3  # the tool tokens are loss-masked
    assert "data-diff=" in dom and "reward " in dom
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def test_miles_train_resolves_each_component_once(
    tmp_path: Path, tiny_model: Path, prompts: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The composition root: in the ``miles train`` process every selected component is looked up and its
    settings validated exactly once (the trainer ranks build theirs from the resolved settings). Its output
    is not a terminal here: progress is one plain line per step."""
    from collections import Counter

    from miles.cli import main
    from miles.plugins.manager import PluginManager

    seen: Counter[str] = Counter()
    resolve = PluginManager.resolve

    def counting(self: PluginManager, kind: object, spec: object, *, field: str, **kwargs: object) -> object:
        seen[field] += 1
        return resolve(self, kind, spec, field=field, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(PluginManager, "resolve", counting)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run_dir = tmp_path / "once"
    config = write_run_config(tmp_path, tiny_model, prompts, run_dir, ranks=1, transport="disk", rollouts=1)
    with pytest.raises(SystemExit) as done:
        main(["train", str(config), "--set", "checkpoint.save_final=false", "--set", "checkpoint.export_hf=false"])
    assert done.value.code in (0, None)
    assert [r["step"] for r in read_metrics(run_dir)] == [1]
    printed = capsys.readouterr().out
    assert "step 1/1  reward " in printed and " s/step" in printed, printed[-2000:]
    expected = {
        "cluster.launcher", "data.source", "rollout.engine", "train.backend", "algorithm", "transport",
        "precision", "reward.functions[0]", "log.loggers[0]",
    }  # fmt: skip
    assert set(seen) == expected and set(seen.values()) == {1}, seen
    assert children_of_run(run_dir) == []
    # the disk transport's versions are scratch for the engines: gone with the run (nothing was exported or
    # checkpointed: save_final and export_hf are off)
    assert not (run_dir / "weights").exists() and not (run_dir / "hf").exists()
