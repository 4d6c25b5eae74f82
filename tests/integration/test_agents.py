"""Multi-turn GRPO end to end: ``miles train`` with the ``calculator_agent`` rollout function (the
example environment package), whose episodes drive the openai client against the TITO session server the
run starts on loopback. The policy is a tiny model fine-tuned to call the calculator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("openai")
pytest.importorskip("miles_calculator_agent")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tool_model() -> Path:
    from miles.testing.tool_model import tool_model_for

    return tool_model_for("qwen2.5")


def children_of_run(run_dir: Path) -> list[int]:
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


@pytest.mark.parametrize("true_on_policy", [False, True], ids=["default", "true-on-policy"])
def test_multi_turn_grpo_through_the_openai_client(tmp_path: Path, tool_model: Path, true_on_policy: bool) -> None:
    """Agent episodes as a run trains on them; with ``train.true_on_policy`` (the deterministic engine) the
    trainer's logprob of every policy token of every turn is the engine's exactly."""
    from miles_calculator_agent.episode import SYSTEM_PROMPT

    from miles.types import Sample

    data = tmp_path / "questions.jsonl"
    rows = [
        {"prompt": f"What is {a} + {b}?", "label": str(a + b), "max_turns": 3}
        for a, b in [(12, 30), (7, 8), (21, 5), (9, 9)]
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text(
        textwrap.dedent(
            f"""
            [cluster]
            trainer_ranks = 1
            num_engines = 1

            [data]
            path = "{data}"
            system_prompt = "{SYSTEM_PROMPT}"

            [rollout]
            function = "calculator_agent"
            rollout_batch_size = 2
            n_samples_per_prompt = 4
            max_new_tokens = 48
            temperature = 0.7

            [rollout.engine]
            name = "local"
            enable_deterministic_inference = {str(true_on_policy).lower()}

            [train]
            model_path = "{tool_model}"
            num_rollouts = 2
            global_batch_size = 8
            lr = 1e-4
            true_on_policy = {str(true_on_policy).lower()}

            [algorithm]
            name = "grpo"

            [[reward.functions]]
            name = "calculator_answer"
            tool_bonus = 0.5

            [transport]
            name = "disk"

            [precision]
            name = "fp32"

            [log]
            run_dir = "{run_dir}"
            """
        )
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "miles", "train", str(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows_ = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows_] == [1, 2]
    for row in rows_:
        assert row["sessions/episodes"] == 8 and row["sessions/append_only_violations"] == 0
        assert row["sessions/branches"] == 0 and row["sessions/turns_per_episode_mean"] >= 1
        assert 0 < row["sessions/masked_fraction"] < 1
        assert row["weight_sync/verified"] == 1.0
        # tool, user and template tokens are masked out of the comparison; every policy token matches
        assert 0.0 <= row["fidelity/train_rollout_logprob_abs_diff"] < 1e-4
        if true_on_policy:  # the trainer computes with the engine's batch-invariant ops: exact, not merely close
            assert row["fidelity/train_rollout_logprob_abs_diff"] == 0.0
    # the episodes start from the data's conversation (data.system_prompt, then the question): the tool
    # model calls the calculator on nearly every question it was trained on, and goes on after the result
    for row in rows_:
        assert row["sessions/tool_calls_per_episode_mean"] >= 0.5
        assert row["sessions/turns_per_episode_mean"] > 1
    for step, version in ((1, 0), (2, 1)):
        samples = [
            Sample.from_json(x) for x in (run_dir / "samples" / f"rollout_{step:06d}.jsonl").read_text().splitlines()
        ]
        assert len(samples) == 8
        for s in samples:
            s.validate()
            spans = s.metadata["session"]["policy_spans"]
            mask = [0] * s.response_length
            for a, b in spans:
                mask[a:b] = [1] * (b - a)
            assert s.loss_mask == mask  # token by token: 1 exactly on what the policy sampled
            assert {w.version for w in s.weight_versions} == {version}  # step 2 sampled the pushed weights
            assert s.metadata["messages"][0] == {"role": "system", "content": SYSTEM_PROMPT}
            assert s.metadata["messages"][1] == {"role": "user", "content": s.prompt} and s.prompt.startswith("What")
            assert s.reward is not None
        assert len({s.group_id for s in samples}) == 2 and all(
            len({s.index for s in samples if s.group_id == g}) == 4 for g in {s.group_id for s in samples}
        )
    assert children_of_run(run_dir) == []


def test_sessions_behind_smg_keep_each_session_on_one_engine(tmp_path: Path) -> None:
    """The session server in front of two engines behind a real smg (``rollout.router = "smg"``, launched as
    ``miles train`` does): every turn of a session goes through the router with the session's key and
    lands on one engine (the engines' own counters agree), the sessions spread over both engines, and each
    later turn finds its history in that engine's prefix cache."""
    import asyncio

    import httpx

    from miles.compose import build_run
    from miles.host.train import launch_fleet
    from miles.rollout.router import smg_executable
    from miles.sessions.server import SessionServer
    from miles.settings.model import MilesSettings
    from miles.settings.sessions import SessionSettings
    from miles.testing.models import build_tiny_model

    try:
        smg_executable()
    except Exception:
        pytest.skip("pip install smg")
    model = build_tiny_model(tmp_path / "tiny", "qwen2", seed=0)
    settings = MilesSettings.model_validate({
        "cluster": {"num_engines": 2},
        "train": {"model_path": str(model)},
        "rollout": {"router": {"name": "smg", "policy": "manual"}},
    })  # fmt: skip

    def counters(urls: list[str]) -> list[int]:
        return [int(httpx.get(u + "/server_info", timeout=10).json()["generate_requests"]) for u in urls]

    async def episodes(fleet: Any) -> tuple[dict[str, list[dict[str, Any]]], list[int]]:
        client = fleet.client()
        try:
            server = await SessionServer.for_engines(client, SessionSettings(max_tokens=6))
            url = await server.start()
            before = counters(fleet.engine_urls)
            try:
                async with httpx.AsyncClient(base_url=url, timeout=300) as http:

                    async def turns(
                        k: int, sid: str, messages: list[dict[str, Any]], answers: list[Any], n: int
                    ) -> None:
                        for _ in range(n):
                            messages.append({"role": "user", "content": f"Question {len(answers)} of session {k}?"})
                            body = {"model": "policy", "messages": messages, "return_token_ids": True}
                            resp = await http.post(f"/sessions/{sid}/v1/chat/completions", json=body)
                            assert resp.status_code == 200, resp.text
                            answers.append(resp.json())
                            messages.append(answers[-1]["choices"][0]["message"])

                    # each session's first turn in turn: smg places a new key by the keys each engine holds, and
                    # first requests at the same instant (a loaded host) all found the same counts (24 / 0 once)
                    started = []
                    for k in range(6):
                        sid = (await http.post("/sessions", json={"sampling": {"seed": k, "override": True}})).json()
                        history: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
                        answers: list[Any] = []
                        await turns(k, sid["id"], history, answers, 1)
                        started.append((k, sid["id"], history, answers))
                    await asyncio.gather(*(turns(k, sid, h, a, 3) for k, sid, h, a in started))  # the rest at once
                    done = {sid: answers for _, sid, _, answers in started}
            finally:
                await server.stop()
            after = counters(fleet.engine_urls)
            return done, [a - b for a, b in zip(after, before, strict=True)]
        finally:
            await client.close()

    run = build_run(settings)
    with run.launcher(run_dir=str(tmp_path / "fleet")) as launcher:
        fleet = launch_fleet(run, launcher)
        assert fleet.router_url is not None
        sessions, served = asyncio.run(episodes(fleet))
    engines = {sid: {a["miles"]["engine"] for a in answers} for sid, answers in sessions.items()}
    assert all(len(e) == 1 for e in engines.values()), engines  # each session on one engine
    per_engine = [sum(4 for e in engines.values() if url in e) for url in fleet.engine_urls]
    assert served == per_engine and min(per_engine) > 0  # the engines' own counters; both got sessions
    for answers in sessions.values():
        for prev, now in pairwise(answers):
            history = len(prev["prompt_token_ids"]) + len(prev["choices"][0]["token_ids"])
            assert now["usage"]["prompt_tokens_details"]["cached_tokens"] >= history - 2
