"""End-to-end runs of ``miles train`` on this CPU: a real engine process, real trainer ranks over gloo,
real weight pushes with verification, checkpoints and an exact resume, SFT, ``miles generate``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from miles.testing.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", "qwen2", seed=0)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "label": str(a + b)}
        for a in range(3, 9)
        for b in range(2, 6)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_config(
    tmp_path: Path,
    model: Path,
    data: Path,
    run_dir: Path,
    extra: str = "",
    *,
    ranks: int = 2,
    transport: str = "broadcast",
    transport_options: str = "",
    rollouts: int = 3,
) -> Path:
    config = tmp_path / "run.toml"
    config.write_text(
        textwrap.dedent(
            f"""
            [cluster]
            trainer_ranks = {ranks}
            num_engines = 1

            [data]
            path = "{data}"

            [rollout]
            rollout_batch_size = 4
            n_samples_per_prompt = 4
            max_new_tokens = 6
            temperature = 1.0

            [train]
            model_path = "{model}"
            num_rollouts = {rollouts}
            global_batch_size = 8
            lr = 1e-3

            [algorithm]
            name = "grpo"

            [[reward.functions]]
            name = "length_penalty"
            max_length = 6
            buffer_length = 4
            mode = "linear"

            [transport]
            name = "{transport}"
            {transport_options}

            [log]
            run_dir = "{run_dir}"
            """
        )
        + textwrap.dedent(extra)
    )
    return config


def miles(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "miles", *args], capture_output=True, text=True, env=full, timeout=timeout, cwd=ROOT
    )


def metrics(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def children_of_run(run_dir: Path) -> list[int]:
    """PIDs of live processes whose command line mentions the run (engines and ranks of this run)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(run_dir) in cmdline and int(entry.name) != os.getpid():
            found.append(int(entry.name))
    return found


def hf_weights(path: Path) -> dict[str, object]:
    from safetensors.torch import load_file

    out: dict[str, object] = {}
    for shard in sorted(path.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def rank_pid(run_dir: Path, rank: int) -> int | None:
    """The PID of trainer rank ``rank`` of the run (its environment says ``RANK``)."""
    for pid in children_of_run(run_dir):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"miles.driver.worker" in cmdline and f"RANK={rank}".encode() in environ:
            return pid
    return None


def kill_rank_after(
    config: Path, run_dir: Path, *, rank: int, when: Path, timeout: float = 600
) -> tuple[float, subprocess.CompletedProcess[str]]:
    """Run ``miles train config``, SIGKILL trainer rank ``rank`` once ``when`` exists; the kill's time and the
    finished process."""
    import signal

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles", "train", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    deadline = time.monotonic() + timeout
    killed_at = None
    try:
        while killed_at is None and proc.poll() is None and time.monotonic() < deadline:
            pid = rank_pid(run_dir, rank) if when.exists() else None
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed_at = time.monotonic()
            time.sleep(0.05)
        stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed_at is not None, f"rank {rank} was never killed (run ended with {proc.returncode}): {stderr[-2000:]}"
    return killed_at, subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


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
    config = write_config(tmp_path, tiny_model, prompts, full_dir, CHECKPOINTED)
    out = miles("train", str(config))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = metrics(full_dir)
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
    config = write_config(tmp_path, tiny_model, prompts, part_dir, CHECKPOINTED, rollouts=3)
    killed_at, out = kill_rank_after(
        config, part_dir, rank=1, when=part_dir / "checkpoints" / "step_000002" / "driver.json"
    )
    assert out.returncode != 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert time.monotonic() - killed_at < 30
    said = " ".join(out.stderr.split())
    assert "trainer-1" in said and "SIGKILL" in said, said[-3000:]
    assert children_of_run(part_dir) == []
    assert [r["step"] for r in metrics(part_dir)] == [1, 2]
    out = miles("train", str(config), "--resume", str(part_dir))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    resumed = metrics(part_dir)
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
    """Engines free their KV cache and weights while the trainer trains; the push restores every tensor."""
    run_dir = tmp_path / "disk"
    config = write_config(
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
    out = miles("train", str(config), "--set", "cluster.colocate=true", *evaluation, *on_policy)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = metrics(run_dir)
    assert [r["weight_sync/verified"] for r in rows] == [1.0, 1.0]
    for row in rows:
        assert 0.0 <= row["eval/pass@1"] <= row["eval/pass@2"] <= 1.0
        assert "eval/reward_mean" in row
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == ["v2"]  # older versions removed
    engine_log = (run_dir / "logs" / "engine-0.log").read_text()
    assert engine_log.count("released kv_cache, weights") == 2 and engine_log.count("resumed kv_cache, weights") == 2
    for row in rows:
        assert row["fidelity/train_rollout_logprob_abs_diff"] < 1e-4  # the engine generated on restored weights
        assert row["train/ratio"] == pytest.approx(1.0, abs=1e-5) and row["train/clipfrac"] == 0.0


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
    config = write_config(
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
    out = miles(
        "train", str(config), env={"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    )
    assert out.returncode != 0
    log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert "1 tensor(s) were not updated by the push, e.g. 'model.norm.weight'" in log
    if mode == "fully_async":  # version 1's commit failed while step 2 trained: step 2 never completed
        assert [r["step"] for r in metrics(run_dir)] == [1]
    assert children_of_run(run_dir) == []


def test_a_failure_on_the_driver_rank_ends_the_run_with_its_error(
    tmp_path: Path, tiny_model: Path, prompts: Path
) -> None:
    """Rank 0 fails in set-up (the tokenised prompts are all over ``data.max_prompt_tokens``) while rank 1
    waits for its first batch: the run exits non-zero naming the cause, and no process is left behind (it
    used to hang in a teardown barrier). A missing data file is caught earlier: by the settings pass, before
    any process starts."""
    run_dir = tmp_path / "too-long"
    config = write_config(tmp_path, tiny_model, prompts, run_dir, ranks=2)
    config.write_text(config.read_text().replace("[data]\npath", "[data]\nmax_prompt_tokens = 1\npath", 1))
    out = miles("train", str(config), timeout=240)
    assert out.returncode != 0
    log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert "no prompts (all 24 dropped by the pipeline)" in log, log[-2000:]
    assert children_of_run(run_dir) == []
    missing = tmp_path / "missing-data"
    config = write_config(tmp_path, tiny_model, tmp_path / "no-such.jsonl", missing, ranks=2)
    out = miles("train", str(config), timeout=240)
    assert out.returncode == 2 and "no-such.jsonl: no such file or directory (data.path)" in out.stderr
    assert not (missing / "logs").exists()  # nothing was started


def test_sft_without_engines(tmp_path: Path, tiny_model: Path) -> None:
    data = tmp_path / "sft.jsonl"
    rows = [{"prompt": f"Say {w}.", "label": f"{w} {w} {w}"} for w in ["apple", "river", "stone", "cloud"] * 4]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "sft"
    config = write_config(tmp_path, tiny_model, data, run_dir, rollouts=4)
    text = config.read_text().replace("num_engines = 1", "num_engines = 0").replace('name = "grpo"', 'name = "sft"')
    text = text.replace("n_samples_per_prompt = 4", "n_samples_per_prompt = 2").replace(
        "global_batch_size = 8", "global_batch_size = 8"
    )
    config.write_text(text)
    out = miles(
        "train",
        str(config),
        "--set",
        "rollout.rollout_batch_size=8",
        "--set",
        "rollout.n_samples_per_prompt=1",
        "--set",
        "train.lr=3e-3",
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    losses = [r["train/loss"] for r in metrics(run_dir)]
    assert len(losses) == 4 and losses[-1] < losses[0]


def test_generate_writes_token_exact_samples(tmp_path: Path, tiny_model: Path, prompts: Path) -> None:
    run_dir = tmp_path / "gen"
    config = write_config(tmp_path, tiny_model, prompts, run_dir)
    out_file = tmp_path / "samples.jsonl"
    out = miles("generate", str(config), "--out", str(out_file), "--num-rollouts", "2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    from miles.types import Sample

    samples = [Sample.from_json(line) for line in out_file.read_text().splitlines()]
    assert len(samples) == 2 * 4 * 4
    for s in samples:
        s.validate()
        assert s.response_length > 0 and len(s.rollout_logprobs) == s.response_length
        assert s.reward is not None and s.weight_versions
    assert children_of_run(run_dir) == []

    out = miles("eval", str(config), "--data", str(prompts), "--k", "1", "--k", "4")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert 0.0 <= result["eval/pass@1"] <= result["eval/pass@4"] <= 1.0


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
    config = write_config(tmp_path, tiny_model, prompts, run_dir, ranks=1, transport="disk", rollouts=1)
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    out = miles(
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
    row = metrics(run_dir)[0]
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
    config = write_config(tmp_path, tiny_model, prompts, run_dir, ranks=1, transport="disk", rollouts=1)
    with pytest.raises(SystemExit) as done:
        main(["train", str(config), "--set", "checkpoint.save_final=false", "--set", "checkpoint.export_hf=false"])
    assert done.value.code in (0, None)
    assert [r["step"] for r in metrics(run_dir)] == [1]
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


PID_PROBE = """
import os, threading
from miles.rollout.manager import single_turn

async def probe(client, sample, sampling_params):
    out = await single_turn(client, sample, sampling_params)
    out.metadata["pid"] = os.getpid()
    out.metadata["threads"] = sorted({t.name for t in threading.enumerate()})
    return out
"""


def test_debug_mode_runs_engine_driver_and_trainer_in_one_process(
    tmp_path: Path, tiny_model: Path, prompts: Path
) -> None:
    """``miles train --debug``: nothing is launched; the rollout function (like any plugin code) runs in the
    process that was started, next to the in-process engine's threads, so a debugger stops there."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "pid_probe.py").write_text(PID_PROBE)
    run_dir = tmp_path / "debug"
    config = write_config(tmp_path, tiny_model, prompts, run_dir, ranks=1, transport="disk", rollouts=2)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles", "train", str(config), "--debug", "--set", 'rollout.function="pid_probe:probe"'],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert [r["step"] for r in metrics(run_dir)] == [1, 2]
    assert all(r["weight_sync/verified"] == 1.0 for r in metrics(run_dir))
    from miles.types import Sample

    samples = [
        Sample.from_json(line) for line in (run_dir / "samples" / "rollout_000002.jsonl").read_text().splitlines()
    ]
    assert {s.metadata["pid"] for s in samples} == {proc.pid}
    assert "miles-engine-http" in samples[0].metadata["threads"]
    assert not (run_dir / "logs").exists()  # no process was launched
    assert children_of_run(run_dir) == []
    two_ranks = miles("train", str(config), "--debug", "--overwrite", "--set", "cluster.trainer_ranks=2")
    assert two_ranks.returncode == 2 and "cluster.trainer_ranks: --debug runs one trainer rank" in two_ranks.stderr


def engine_pid(run_dir: Path, index: int) -> int | None:
    """The PID of engine ``index`` of the run (found by the port of its URL in ``fleet.json``)."""
    try:
        url = json.loads((run_dir / "fleet.json").read_text())["engine_urls"][index]
    except (OSError, ValueError, KeyError, IndexError):
        return None
    port = f"--port {url.rsplit(':', 1)[1]} ".encode()
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ") + b" "
        except OSError:
            continue
        if entry.name.isdigit() and b"miles.engine" in cmdline and port in cmdline:
            return int(entry.name)
    return None


def train_injecting(
    config: Path, run_dir: Path, inject: Callable[[int], bool], env: dict[str, str] | None = None
) -> tuple[bool, int, str]:
    """``miles train config``, polling ``inject(steps_logged)`` until it returns ``True`` (the fault went in);
    returns whether it did, the exit code and stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles", "train", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        cwd=ROOT,
    )
    injected = False
    deadline = time.monotonic() + 400
    try:
        metrics_file = run_dir / "metrics.jsonl"
        while not injected and proc.poll() is None and time.monotonic() < deadline:
            steps = len(metrics_file.read_text().splitlines()) if metrics_file.exists() else 0
            injected = bool(inject(steps))
            time.sleep(0.02)
        _, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return injected, int(proc.returncode), stderr


GATE = """
import asyncio
import os

from miles.components import ComponentSettings
from miles.markers import hookimpl
from miles.rewards.base import Reward


class GateSettings(ComponentSettings):
    path: str


class Gate(Reward[GateSettings]):
    '''Scores 0; while the file ``path`` exists it waits for it to go (a test holds the run's rollout).'''

    name = "gate"

    async def score(self, sample):
        while os.path.exists(self.settings.path):
            await asyncio.sleep(0.05)
        return 0.0


@hookimpl
def miles_register_rewards(register):
    register(Gate)
"""


def gated(tmp_path: Path, config: Path) -> tuple[Path, dict[str, str]]:
    """Add the ``gate`` reward (weight 0) to ``config``: while the returned file exists, the run's scoring,
    and so its next step, waits. Returns the file and the environment that loads the plugin."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "miles_gate.py").write_text(GATE)
    info = site / "miles_gate-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: miles-gate\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[miles.plugins]\ngate = miles_gate\n")
    gate = tmp_path / "gate"
    text = config.read_text().replace(
        "[transport]", f'[[reward.functions]]\nname = "gate"\nweight = 0.0\npath = "{gate}"\n\n[transport]'
    )
    config.write_text(text.replace("[algorithm]", "[reward]\ntimeout = 600\n\n[algorithm]"))
    return gate, {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


def serves(url: str) -> bool:
    """Whether the engine at ``url`` answers ``/health``."""
    import httpx

    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def kill_then_hold_until_restarted(
    run_dir: Path, gate: Path, kill: Callable[[], object], died: Callable[[], bool] = lambda: True
) -> Callable[[int], bool]:
    """The fault for :func:`train_injecting` in a run with 2 engines: once step 2 is logged, ``kill()``; once
    an engine ``died()``, hold the run (``gate``: the next scoring waits) until the launcher's restart of it
    serves, so that the restarted engine rejoins at the next push however slow the machine. Done (``True``)
    when the gate opens again."""
    pids: dict[int, int | None] = {}

    def step(steps: int) -> bool:
        if steps < 2:
            return False
        if not pids:
            pids.update({i: engine_pid(run_dir, i) for i in (0, 1)})
            kill()
            return False
        if not died():
            return False
        gate.touch()
        urls = json.loads((run_dir / "fleet.json").read_text())["engine_urls"]
        restarted = [i for i in (0, 1) if engine_pid(run_dir, i) not in (None, pids[i])]
        if restarted and all(serves(urls[i]) for i in restarted):
            gate.unlink()
            return True
        return False

    return step


def kill_in_push_then_hold_until_restarted(run_dir: Path, trigger: Path, gate: Path) -> Callable[[int], bool]:
    """:func:`kill_then_hold_until_restarted` with ``MILES_TEST_SIGKILL_IN_PUSH`` armed once step 2 is logged:
    the engine that takes ``trigger`` dies in the next push."""
    return kill_then_hold_until_restarted(run_dir, gate, trigger.touch, lambda: not trigger.exists())


STEPS = 6  # the failover tests: the kill after step 2; held until the restart serves; it rejoins at a later push


def test_an_engine_sigkilled_mid_rollout_is_failed_over_restarted_and_rejoins(
    tmp_path: Path, tiny_model: Path, prompts: Path
) -> None:
    """2 engines; once step 2 is logged, the engine that takes the next ``/generate`` SIGKILLs itself
    (``MILES_TEST_SIGKILL_IN_GENERATE``): its requests go to the other engine with their seeds, the launcher
    restarts it (``rollout.engine_restarts = 1``), the run is held until the restart serves, the broadcast
    group is formed again and it rejoins; every step has exactly its samples, none twice."""
    run_dir = tmp_path / "run"
    config = write_config(tmp_path, tiny_model, prompts, run_dir, ranks=1, rollouts=STEPS)
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
    rows = metrics(run_dir)
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
    config = write_config(
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
    rows = metrics(run_dir)
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
    config = write_config(tmp_path, tiny_model, prompts, run_dir, ranks=2, rollouts=STEPS, transport="p2p")
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
    rows = metrics(run_dir)
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
    config = write_config(
        tmp_path, tiny_model, prompts, run_dir, ranks=2, rollouts=WAIT_STEPS, transport_options="bucket_bytes = 16384"
    )
    config.write_text(config.read_text().replace("temperature = 1.0", "temperature = 1.0\nengine_restarts = 2"))
    in_generate, in_push = tmp_path / "die-in-generate", tmp_path / "die-in-push"

    armed: list[Path] = []

    def arm(steps: int) -> bool:
        if steps >= 1 and not armed:
            in_generate.touch()  # the engine dies at the first /generate of a later rollout
            armed.append(in_generate)
        elif armed == [in_generate] and any(r.get("weight_sync/rejoin_pushes") for r in metrics(run_dir)):
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
    rows = metrics(run_dir)
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
