"""The sandbox runs real subprocesses: a program that loops forever or allocates without bound is stopped within
its limits and the next one runs; a file past the size limit fails its writer; a socket to the host's
127.0.0.1 fails inside the sandbox and works with ``network = true``; the ``python_output`` reward turns a
sandbox failure into a failed sample with the reason."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from miles.rewards.code import PythonOutputReward, PythonOutputSettings, extract_code
from miles.rewards.sandbox import SandboxError, SandboxLimits, run_command, run_python
from miles.rewards.scoring import score_samples
from miles.types import Sample, SampleStatus

LOOP = "while True:\n    pass\n"
TOUCHING_HOG = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))  # (zero-filled: every page touched)\n"
HOG = "chunks = []\nwhile True:\n    chunks.append(bytes(16 << 20))  # (calloc: no page touched, the limit is hit at once)\n"


def test_a_program_runs_with_its_input_and_output() -> None:
    result = asyncio.run(run_python("import sys\nprint(sum(map(int, sys.stdin.read().split())))", stdin="2 3 4"))
    assert result.ok and result.returncode == 0 and result.stdout.strip() == "9", result
    assert result.check() is result


def test_an_endless_loop_is_killed_at_the_timeout_and_the_next_program_runs() -> None:
    start = time.monotonic()
    result = asyncio.run(run_python(LOOP, limits=SandboxLimits(timeout=1.0)))
    took = time.monotonic() - start
    assert result.timed_out and result.returncode == -9 and "timed out after 1 s" in result.reason
    assert took < 4.0, took
    with pytest.raises(SandboxError, match="timed out"):
        result.check()
    assert asyncio.run(run_python("print('next')")).stdout == "next\n"


def test_unbounded_allocation_stops_at_the_memory_limit() -> None:
    start = time.monotonic()
    result = asyncio.run(run_python(TOUCHING_HOG, limits=SandboxLimits(memory_mb=256, timeout=20.0)))
    assert not result.ok and not result.timed_out
    assert "MemoryError (memory limit 256 MiB)" in result.reason, result
    assert time.monotonic() - start < 10.0


def test_a_file_past_the_size_limit_fails_its_writer() -> None:
    code = "with open('big', 'wb') as f:\n    for _ in range(8):\n        f.write(b'x' * (1 << 20))\n"
    result = asyncio.run(run_python(code, limits=SandboxLimits(file_size_mb=1)))
    assert result.returncode == 1 and "file size limit (1 MiB)" in result.reason, result
    assert "File too large" in result.reason
    shell = asyncio.run(
        run_command(["/bin/sh", "-c", "exec head -c 4000000 /dev/zero > big"], limits=SandboxLimits(file_size_mb=1))
    )
    assert shell.returncode == -25 and "killed by SIGXFSZ: file size limit (1 MiB)" in shell.reason, shell
    assert asyncio.run(run_python(code, limits=SandboxLimits(file_size_mb=16))).ok


@pytest.fixture
def listener() -> Iterator[int]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    accepted: list[socket.socket] = []

    def accept() -> None:
        try:
            while True:
                accepted.append(server.accept()[0])
        except OSError:
            pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        server.close()
        for conn in accepted:
            conn.close()


def test_no_network_inside_and_the_host_loopback_outside(listener: int) -> None:
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {listener}), timeout=3)\nprint('connected')\n"
    inside = asyncio.run(run_python(code))
    assert not inside.ok and "connected" not in inside.stdout
    assert "OSError" in inside.reason or "Error" in inside.reason, inside
    outside = asyncio.run(run_python(code, limits=SandboxLimits(network=True)))
    assert outside.ok and outside.stdout == "connected\n", outside  # (the test can fail: the port is real)


def sample(response: str, label: object, i: int) -> Sample:
    return Sample(
        prompt_ids=[1], response_ids=[2], status=SampleStatus.COMPLETED, response=response, label=label, index=i
    )


def test_python_output_reward_scores_and_fails_samples_with_the_reason() -> None:
    reward = PythonOutputReward(PythonOutputSettings(sandbox=SandboxLimits(timeout=1.0, memory_mb=256)))
    samples = [
        sample("```python\nprint(6 * 7)\n```", "42", 0),
        sample("Here:\n```\nprint(41)\n```", "42", 1),
        sample(f"```python\n{LOOP}```", "42", 2),
        sample(f"```py\n{HOG}```", "42", 3),
        sample("no code at all", "42", 4),
        sample("```python\nprint(int(input()) + 1)\n```", {"stdin": "9", "output": "10"}, 5),
    ]
    asyncio.run(score_samples(samples, [("py", reward, 1.0)], timeout=30.0))
    assert [s.reward for s in samples] == [1.0, 0.0, None, None, 0.0, 1.0]
    assert samples[2].status == SampleStatus.FAILED and "timed out after 1 s" in samples[2].status_reason
    assert samples[3].status == SampleStatus.FAILED and "MemoryError" in samples[3].status_reason
    assert samples[4].reward_parts == {"py": 0.0, "py/has_code": 0.0}
    assert extract_code("a ```python\nx = 1\n``` b ```\ny = 2\n```") == "y = 2\n"
