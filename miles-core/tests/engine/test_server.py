"""The local engine over real HTTP: logprobs, determinism, continuous batching, prefix cache, streaming,
pause / abort, and bad input (one server process for the whole file)."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from miles.testing.engine import EngineProcess

from .conftest import hf_greedy, hf_logprobs, start_engine

PROMPT = [5, 17, 33, 48, 91, 120, 7, 250, 300, 12, 64, 77]


@pytest.fixture(scope="module")
def engine(engine_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    log = tmp_path_factory.mktemp("logs") / "server.log"
    yield from start_engine(engine_models["qwen2"], log, "--max-cache-tokens", "4096")


def gen(engine: EngineProcess, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(engine.url + "/generate", json=body, timeout=timeout)


def test_logprobs_match_an_independent_hf_forward(engine: EngineProcess, engine_models: dict[str, Path]) -> None:
    for temperature in (1.0, 0.7):
        body = {
            "input_ids": PROMPT,
            "sampling_params": {
                "max_new_tokens": 24,
                "temperature": temperature,
                "ignore_eos": True,
                "sampling_seed": 11,
            },
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        out = gen(engine, body).json()
        meta = out["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 24}
        assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == 24
        ids = out["output_ids"]
        assert [t[1] for t in meta["output_token_logprobs"]] == ids
        ref = hf_logprobs(engine_models["qwen2"], PROMPT + ids, temperature)
        got = [t[0] for t in meta["output_token_logprobs"]]
        for i, lp in enumerate(got):
            assert abs(lp - float(ref[len(PROMPT) + i])) < 1e-5, (temperature, i)
        # prompt scoring: first token has none, the rest match
        inp = meta["input_token_logprobs"]
        assert [t[1] for t in inp] == PROMPT and inp[0][0] is None
        for i in range(1, len(PROMPT)):
            assert abs(inp[i][0] - float(ref[i])) < 1e-5
    # raw-logit logprobs (before temperature), SGLang's "original" logprobs
    body["return_original_logprob"] = True
    out = gen(engine, body).json()
    ref1 = hf_logprobs(engine_models["qwen2"], PROMPT + out["output_ids"], 1.0)
    for i, (lp, _, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        assert abs(lp - float(ref1[len(PROMPT) + i])) < 1e-5


def test_greedy_matches_hf_and_text_decodes(engine: EngineProcess, engine_models: dict[str, Path]) -> None:
    out = gen(
        engine, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
    ).json()
    assert out["output_ids"] == hf_greedy(engine_models["qwen2"], PROMPT, 16)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(engine_models["qwen2"])
    assert out["text"] == tok.decode(out["output_ids"], skip_special_tokens=True)
    by_text = gen(engine, {"text": "What is 3+4?", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).json()
    assert by_text["meta_info"]["prompt_tokens"] == len(tok.encode("What is 3+4?"))


def test_seeded_sampling_is_deterministic(engine: EngineProcess) -> None:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {
            "max_new_tokens": 20,
            "temperature": 1.0,
            "top_p": 0.9,
            "top_k": 50,
            "sampling_seed": 1234,
            "ignore_eos": True,
        },
    }
    first = gen(engine, body).json()["output_ids"]
    assert gen(engine, body).json()["output_ids"] == first
    # same seed inside a batch with other requests: same tokens
    batch = {
        "input_ids": [PROMPT, [9, 8, 7, 6], PROMPT[:5]],
        "sampling_params": [body["sampling_params"], {"max_new_tokens": 30, "ignore_eos": True}, {"max_new_tokens": 7}],
    }
    outs = gen(engine, batch).json()
    assert isinstance(outs, list) and len(outs) == 3
    assert outs[0]["output_ids"] == first
    other = dict(body["sampling_params"], sampling_seed=99)
    assert gen(engine, {"input_ids": PROMPT, "sampling_params": other}).json()["output_ids"] != first


def test_continuous_batching_short_request_finishes_first(engine: EngineProcess) -> None:
    async def run() -> list[str]:
        order: list[str] = []
        async with httpx.AsyncClient(base_url=engine.url, timeout=300) as client:
            long_body = {
                "input_ids": [1, 2, 3],
                "stream": True,
                "sampling_params": {"max_new_tokens": 900, "ignore_eos": True},
            }

            async def long() -> None:
                async with client.stream("POST", "/generate", json=long_body) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            chunk = json.loads(line[6:])
                            if not started.is_set():
                                started.set()
                            if chunk["meta_info"]["finish_reason"] is not None:
                                order.append("long")
                                assert chunk["meta_info"]["completion_tokens"] == 900

            started = asyncio.Event()
            task = asyncio.create_task(long())
            await started.wait()
            short = await client.post(
                "/generate", json={"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
            )
            assert short.json()["meta_info"]["completion_tokens"] == 3
            order.append("short")
            await task
        return order

    assert asyncio.run(run()) == ["short", "long"]


def test_prefix_cache_hits_for_groups_and_turns(engine: EngineProcess) -> None:
    httpx.post(engine.url + "/flush_cache", timeout=30).raise_for_status()
    prompt = [40 + i for i in range(30)]
    outs = gen(
        engine, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "n": 4, "ignore_eos": True}}
    ).json()
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    assert cached[0] == 0 and cached[1:] == [len(prompt) - 1] * 3
    # a second turn extends the first: its whole history is cached
    turn = prompt + outs[0]["output_ids"] + [100, 101]
    second = gen(engine, {"input_ids": turn, "sampling_params": {"max_new_tokens": 2}}).json()
    assert second["meta_info"]["cached_tokens"] >= len(prompt) + len(outs[0]["output_ids"]) - 1
    httpx.post(engine.url + "/flush_cache", timeout=30).raise_for_status()
    again = gen(engine, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}}).json()
    assert again["meta_info"]["cached_tokens"] == 0
    info = httpx.get(engine.url + "/server_info", timeout=30).json()
    assert info["cache_tokens"] > 0 and info["max_cache_tokens"] == 4096


def test_cached_prefix_gives_the_same_tokens(engine: EngineProcess) -> None:
    body = {
        "input_ids": [*PROMPT, 3, 4],
        "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }
    httpx.post(engine.url + "/flush_cache", timeout=30)
    cold = gen(engine, body).json()
    warm = gen(engine, body).json()
    assert warm["meta_info"]["cached_tokens"] > 0
    assert warm["output_ids"] == cold["output_ids"]
    for a, b in zip(
        cold["meta_info"]["output_token_logprobs"], warm["meta_info"]["output_token_logprobs"], strict=False
    ):
        assert math.isclose(a[0], b[0], abs_tol=1e-5)


def test_stop_conditions(engine: EngineProcess) -> None:
    base = gen(
        engine, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}}
    ).json()
    ids = base["output_ids"]
    stop_tok = ids[3]
    out = gen(
        engine,
        {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 10, "temperature": 0, "stop_token_ids": [stop_tok]},
        },
    ).json()
    first = ids.index(stop_tok)
    assert out["output_ids"] == ids[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    # min_new_tokens masks stop tokens until reached
    out = gen(
        engine,
        {
            "input_ids": PROMPT,
            "sampling_params": {
                "max_new_tokens": 10,
                "min_new_tokens": 10,
                "temperature": 0,
                "stop_token_ids": [stop_tok],
            },
        },
    ).json()
    assert len(out["output_ids"]) == 10 and stop_tok not in out["output_ids"]
    # stop strings trim the text
    text = base["text"]
    stop_str = text[len(text) // 2 :][:2]
    if stop_str.strip():
        out = gen(
            engine,
            {
                "input_ids": PROMPT,
                "sampling_params": {"max_new_tokens": 10, "temperature": 0, "stop": [stop_str], "ignore_eos": True},
            },
        ).json()
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_str}
        assert stop_str not in out["text"]


def test_streaming_is_cumulative(engine: EngineProcess) -> None:
    chunks = []
    with httpx.stream(
        "POST",
        engine.url + "/generate",
        json={
            "input_ids": PROMPT,
            "stream": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
        },
        timeout=60,
    ) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    parsed = [json.loads(c) for c in chunks[:-1]]
    assert [len(c["output_ids"]) for c in parsed] == [1, 2, 3, 4, 5]
    assert parsed[-1]["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ("{not json", "malformed JSON"),
        (json.dumps({"input_ids": [1, 2], "sampling_params": {"temprature": 1.0}}), "temprature"),
        (json.dumps({"input_ids": [1, 99999]}), "out of the vocabulary"),
        (json.dumps({"input_ids": [1, -3]}), "out of the vocabulary"),
        (json.dumps({"input_ids": []}), "empty"),
        (json.dumps({"input_ids": [7] * 1030}), "context length"),
        (json.dumps({"text": ""}), "empty"),
        (json.dumps({"sampling_params": {}}), "input_ids or text"),
        (json.dumps({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}), "top_p"),
        (json.dumps({"input_ids": ["a"]}), "list of integers"),
        (json.dumps([1, 2, 3]), "JSON object"),
    ],
)
def test_bad_input_is_400_and_server_keeps_serving(engine: EngineProcess, raw: str, fragment: str) -> None:
    resp = httpx.post(engine.url + "/generate", content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert resp.status_code == 400
    assert fragment in resp.json()["error"]["message"]
    assert httpx.get(engine.url + "/health", timeout=30).status_code == 200


def test_admin_bad_input_is_400(engine: EngineProcess) -> None:
    resp = httpx.post(engine.url + "/pause_generation", json={"mode": "sideways"}, timeout=30)
    assert resp.status_code == 400 and resp.json()["success"] is False and "mode" in resp.json()["message"]
    resp = httpx.post(engine.url + "/update_weights_from_disk", json={"model_path": "/nonexistent/dir"}, timeout=30)
    assert resp.status_code == 400 and resp.json()["success"] is False
    resp = httpx.post(engine.url + "/update_weights_from_disk", content="{", timeout=30)
    assert resp.status_code == 400 and resp.json()["success"] is False
    assert httpx.get(engine.url + "/health_generate", timeout=60).status_code == 200


def _steps(engine: EngineProcess) -> int:
    return int(httpx.get(engine.url + "/server_info", timeout=30).json()["decode_steps"])


def test_pause_in_place_retract_and_abort(engine: EngineProcess) -> None:
    async def run(mode: str) -> dict:
        async with httpx.AsyncClient(base_url=engine.url, timeout=300) as client:
            task = asyncio.create_task(
                client.post(
                    "/generate",
                    json={
                        "input_ids": [1, 2, 3],
                        "rid": f"long-{mode}",
                        "sampling_params": {"max_new_tokens": 600, "ignore_eos": True},
                    },
                )
            )
            while (await client.get("/server_info")).json()["num_running_reqs"] == 0:
                await asyncio.sleep(0.01)
            assert (await client.post("/pause_generation", json={"mode": mode})).json()["success"]
            before = _steps(engine)
            await asyncio.sleep(0.3)
            assert _steps(engine) == before  # nothing is decoded while paused
            if mode != "abort":
                assert not task.done()
            await client.post("/continue_generation", json={})
            return (await task).json()

    assert asyncio.run(run("abort"))["meta_info"]["finish_reason"]["type"] == "abort"
    for mode in ("in_place", "retract"):
        out = asyncio.run(run(mode))
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 600}
        assert out["meta_info"]["weight_version_spans"] == [[0, 600, "0"]]


def test_abort_request_by_rid(engine: EngineProcess) -> None:
    async def run() -> dict:
        async with httpx.AsyncClient(base_url=engine.url, timeout=300) as client:
            task = asyncio.create_task(
                client.post(
                    "/generate",
                    json={
                        "input_ids": [1, 2, 3],
                        "rid": "to-abort",
                        "sampling_params": {"max_new_tokens": 900, "ignore_eos": True},
                    },
                )
            )
            while (await client.get("/server_info")).json()["num_running_reqs"] == 0:
                await asyncio.sleep(0.01)
            resp = await client.post("/abort_request", json={"rid": "to-abort"})
            assert resp.json()["num_aborted"] == 1
            return (await task).json()

    out = asyncio.run(run())
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["finish_reason"]["message"]
    assert out["meta_info"]["completion_tokens"] < 900


def test_model_info(engine: EngineProcess, engine_models: dict[str, Path]) -> None:
    info = httpx.get(engine.url + "/model_info", timeout=30).json()
    assert info["weight_version"] == "0" and info["model_path"] == str(engine_models["qwen2"])
    assert info["is_generation"] is True
    time.sleep(0)  # keep the import used on every platform


def test_sigterm_answers_pending_requests_and_exits(engine_models: dict[str, Path], tmp_path: Path) -> None:
    """``miles serve`` runs the scheduler on its main thread: SIGTERM stops it, a request still waiting is
    answered (aborted, with the reason) instead of hanging, and the process exits cleanly."""
    import signal
    import threading

    with EngineProcess(engine_models["qwen2"], log_path=tmp_path / "engine.log") as engine:
        assert httpx.post(f"{engine.url}/pause_generation", json={"mode": "in_place"}, timeout=30).status_code == 200
        answers: list[httpx.Response] = []
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}}
        waiter = threading.Thread(target=lambda: answers.append(gen(engine, body, timeout=60)))
        waiter.start()
        deadline = time.monotonic() + 30
        while httpx.get(f"{engine.url}/server_info", timeout=10).json()["num_waiting_reqs"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        engine.proc.send_signal(signal.SIGTERM)
        waiter.join(60)
        assert engine.proc.wait(30) == 0
        assert answers and answers[0].status_code == 200
        reason = answers[0].json()["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "shutting down" in reason["message"]
    assert "received signal 15: shutting down" in (tmp_path / "engine.log").read_text()


def test_server_info_counts_generate_requests(engine: EngineProcess) -> None:
    """``generate_requests`` / ``generated_samples``: the engine's own count of what it was asked (a call
    with ``n = 3`` is one request, three samples); health checks and admin calls do not count."""
    before = httpx.get(engine.url + "/server_info", timeout=30).json()
    gen(engine, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    gen(engine, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "n": 3}})
    httpx.get(engine.url + "/health_generate", timeout=60)
    httpx.post(engine.url + "/flush_cache", timeout=30)
    after = httpx.get(engine.url + "/server_info", timeout=30).json()
    assert after["generate_requests"] - before["generate_requests"] == 2
    assert after["generated_samples"] - before["generated_samples"] == 4


def test_the_scheduler_keeps_its_torch_threads_while_serving(engine_models: dict[str, Path], tmp_path: Path) -> None:
    """``--threads 2``: the scheduler still runs torch on 2 threads after requests went through the CPU kernels.
    The HTTP thread runs torch single-threaded; it used to lower the process-wide count as well, and the
    kernels' first parallel region then set the scheduler's count from it (decoding on one core of two)."""
    with EngineProcess(engine_models["qwen2"], threads=2, log_path=tmp_path / "engine.log") as engine:
        assert httpx.get(engine.url + "/server_info", timeout=30).json()["torch_threads"] == 2
        for n in (1, 4):
            gen(engine, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "n": n, "temperature": 1.0}})
        assert httpx.get(engine.url + "/server_info", timeout=30).json()["torch_threads"] == 2
