"""Whole runs in a test: a tiny model and prompts, a run's settings file, ``miles train`` as a subprocess, and
what a run leaves (metrics, its live processes).

Plugin authors and Miles' own integration suites use these instead of writing them again::

    from miles.testing.runs import arithmetic_prompts, run_miles, tiny_model, write_run_config  # fixtures too

    def test_my_reward_trains(tmp_path, tiny_model, arithmetic_prompts):
        config = write_run_config(tmp_path, tiny_model, arithmetic_prompts, tmp_path / "run", MY_TABLES)
        assert run_miles("train", str(config)).returncode == 0

Importing the fixtures into a test module (or a ``conftest.py``) makes pytest offer them; each is built once
per module (the model is random, from a config: no hub).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

__all__ = [
    "arithmetic_prompts",
    "children_of_run",
    "hf_weights",
    "leaked_torch_segments",
    "paced_reward",
    "read_metrics",
    "run_miles",
    "tiny_model",
    "torch_segments",
    "write_arithmetic_prompts",
    "write_run_config",
]


def write_arithmetic_prompts(path: Path) -> Path:
    """24 chat prompts "What is A + B?" with the sum as ``label`` (JSONL), as ``data.path`` reads them."""
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "label": str(a + b)}
        for a in range(3, 9)
        for b in range(2, 6)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen2 with a locally trained tokenizer and chat template (seed 0), once per module."""
    from miles.testing.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", "qwen2", seed=0)


@pytest.fixture(scope="module")
def arithmetic_prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """:func:`write_arithmetic_prompts` in a module's temporary folder."""
    return write_arithmetic_prompts(tmp_path_factory.mktemp("data") / "prompts.jsonl")


def write_run_config(
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
    precision: str | None = "fp32",
) -> Path:
    """``tmp_path/run.toml``: GRPO on ``model`` over ``data``, one local engine, ``ranks`` trainer ranks,
    ``rollouts`` steps of 4 prompts x 4 samples x 6 tokens, a length reward, pushes by ``transport``, computed in
    ``precision`` (float32 by default, so that checks of trainer / engine agreement mean the same on every
    machine; ``None`` leaves Miles' default, chosen from the machine); TOML ``extra`` is appended (later tables
    win)."""
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
        + (f'\n[precision]\nname = "{precision}"\n' if precision else "")
        + textwrap.dedent(extra)
    )
    return config


def run_miles(
    *args: str, env: dict[str, str] | None = None, timeout: float = 600, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m miles ARGS`` with one torch thread per process (the tests' processes share the cores)."""
    full = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "miles", *args], capture_output=True, text=True, env=full, timeout=timeout, cwd=cwd
    )


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    """The rows of ``run_dir/metrics.jsonl``, one per step."""
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


def torch_segments() -> set[str]:
    """Names of torch's shared-memory files in ``/dev/shm`` now (``torch_<creator pid>_<n>_<k>``)."""
    return {p.name for p in Path("/dev/shm").glob("torch_*")}


def leaked_torch_segments(before: set[str]) -> list[str]:
    """torch's shared-memory files that appeared since ``before`` (:func:`torch_segments`) and whose creating
    process has exited: what a finished run left behind. A file of a live process belongs to a process still at
    work (another run on the host, another test suite beside this one), not to the finished run."""
    leaked = []
    for name in sorted(torch_segments() - before):
        pid = name.split("_")[1]
        if not (pid.isdigit() and Path(f"/proc/{pid}").exists()):
            leaked.append(name)
    return leaked


def hf_weights(path: Path) -> dict[str, object]:
    """Every tensor of the safetensors shards in ``path`` (an exported HF model), by name."""
    from safetensors.torch import load_file

    out: dict[str, object] = {}
    for shard in sorted(path.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


PACED_REWARD_SERVER = """
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
gate, port, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])

class Score(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        if not os.path.exists(gate):
            time.sleep(delay)
        body = json.dumps({"reward": 0.0}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

server = ThreadingHTTPServer(("127.0.0.1", port), Score)
print("listening", flush=True)
server.serve_forever()
"""


def paced_reward(
    gate: Path, *, port: int | None = None, delay: float = 2.0, popen: Any = subprocess.Popen
) -> tuple[subprocess.Popen[str], str]:
    """A reward server that paces a run: every score takes ``delay`` seconds more until ``gate`` exists (the
    test creates it once what it does mid-run is done), so a step lasts at least ``delay`` whatever the
    machine's load, and the run then finishes at full speed. Returns the process (listening on 127.0.0.1:
    ``port``; the caller ends it) and the TOML of its ``remote`` reward, to append to a run's settings.

    :param popen: starts it (``Host.popen``: in the host where trainer rank 0 scores).
    """
    from miles.net import free_port

    port = port or free_port()
    process = popen(
        [sys.executable, "-c", PACED_REWARD_SERVER, str(gate), str(port), str(delay)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    if process.stdout.readline().strip() != "listening":
        process.kill()
        process.wait()
        raise RuntimeError(f"the paced reward server did not start (exit {process.poll()})")
    toml = f'\n[[reward.functions]]\nname = "remote"\nurl = "http://127.0.0.1:{port}/score"\nrequest_timeout = 30\n'
    return process, toml
