"""Real SGLang 0.5.23 serving a tiny Llama on this CPU, spoken to over plain HTTP (no Miles client): health,
``/generate`` with token ids and logprobs against transformers (greedy: each token transformers' best next
token, logprobs within 1e-2), a weight update from disk and a refused one. The session's one server
(``conftest.server``)."""

from __future__ import annotations

from typing import Any

PROMPT = [1, 17, 42, 99, 7, 256, 311, 5]
STEPS = 16


def generate(server: Any, prompt: list[int], steps: int = STEPS) -> dict[str, Any]:
    resp = server.post(
        "/generate",
        {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": steps, "temperature": 0.0, "ignore_eos": True},
            "return_logprob": True,
        },
    )
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


def check(reference: Any, model: Any, body: dict[str, Any]) -> None:
    triples = body["meta_info"]["output_token_logprobs"]
    tokens, logprobs = [int(t[1]) for t in triples], [float(t[0]) for t in triples]
    assert body["output_ids"] == tokens and len(tokens) == STEPS
    reference.check_greedy(model, PROMPT, tokens, logprobs)


def test_health_and_processes(server: Any) -> None:
    assert server.get("/health_generate").status_code == 200
    assert server.get("/health").status_code == 200
    # the server, its scheduler and its detokenizer: one process group, which the fixture reaps
    assert len(server.process_ids()) >= 3


def test_generate_equals_transformers_greedy(server: Any, tiny_llamas: Any, reference: Any) -> None:
    body = generate(server, PROMPT)
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": STEPS}
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == STEPS
    check(reference, tiny_llamas.first, body)


def test_update_weights_from_disk(server: Any, tiny_llamas: Any, reference: Any) -> None:
    """Load the second checkpoint (greedy = transformers on it), then the first again."""
    for model, version in ((tiny_llamas.second, "http-1"), (tiny_llamas.first, "http-2")):
        resp = server.post("/update_weights_from_disk", {"model_path": str(model), "weight_version": version})
        assert resp.status_code == 200, resp.text
        assert resp.json()["success"] is True
        body = generate(server, PROMPT)
        assert body["meta_info"]["weight_version"] == version
        check(reference, model, body)
    # a checkpoint that does not exist: HTTP 400 with SGLang's message; the server keeps its weights
    resp = server.post("/update_weights_from_disk", {"model_path": "/nonexistent/model", "weight_version": "x"})
    assert resp.status_code == 400 and resp.json()["success"] is False
    body = generate(server, PROMPT)
    assert body["meta_info"]["weight_version"] == "http-2"
    check(reference, tiny_llamas.first, body)


def test_an_in_place_pause_keeps_requests_running_and_refuses_the_pushs_flush(server: Any, tiny_llamas: Any) -> None:
    """Why Miles refuses ``rollout.pause_mode = "in_place"`` with SGLang in the async modes (the settings check
    in ``miles_sglang.engine.pause_problems``): paused in place with a request running, SGLang loads the weights
    but fails the update call, refusing its cache flush; paused with ``retract``, the same update succeeds and
    the request goes on under the new version, its response's ``weight_versions`` naming both."""
    import json
    import threading

    import httpx

    def long_request(rid: str, started: threading.Event, out: list[dict[str, Any]]) -> None:
        payload = {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 900, "temperature": 0.0, "ignore_eos": True},
            "stream": True,
            "rid": rid,
        }
        with httpx.stream("POST", server.url + "/generate", json=payload, timeout=600, trust_env=False) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    started.set()
                    out.append(json.loads(line.removeprefix("data: ")))

    for mode, version in (("in_place", "pause-1"), ("retract", "pause-2")):
        started, chunks = threading.Event(), []  # type: ignore[var-annotated]
        thread = threading.Thread(target=long_request, args=(f"long-{mode}", started, chunks), daemon=True)
        thread.start()
        assert started.wait(300), "the request never started"
        assert server.post("/pause_generation", {"mode": mode}).status_code == 200
        resp = server.post(
            "/update_weights_from_disk", {"model_path": str(tiny_llamas.first), "weight_version": version}
        )
        assert server.post("/continue_generation", {}).status_code == 200
        if mode == "in_place":
            assert resp.status_code == 400, resp.text
            assert "the cache was not flushed because requests are still running or queued" in resp.json()["message"]
            assert server.post("/abort_request", {"rid": f"long-{mode}"}).status_code == 200
        else:
            assert resp.status_code == 200 and resp.json()["success"] is True, resp.text
        thread.join(600)
        assert not thread.is_alive()
        meta = chunks[-1]["meta_info"]
        if mode == "retract":
            assert meta["finish_reason"]["type"] == "length" and meta["num_retractions"] == 1
            before, after = meta["weight_versions"]
            assert after["version"] == version and before["end"] == after["start"] > 0


def test_what_reproduces_on_sglangs_cpu_path(server: Any) -> None:
    """Seeded behaviour (``docs/how-to/sglang-cpu.md``, "Seeds"): greedy decoding gives the same tokens and the
    same logprobs every time, alone or batched with other requests; sampling with the same ``sampling_seed``
    does not reproduce: SGLang 0.5.23 applies the seed only with ``--enable-deterministic-inference``, which its
    CPU attention backends refuse. (Should a later SGLang honour it, the last assertion fails: update the docs.)"""
    import concurrent.futures

    def one(prompt: list[int], sampling: dict[str, Any]) -> tuple[list[int], list[float]]:
        payload = {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True}
        resp = server.post("/generate", payload)
        assert resp.status_code == 200, resp.text
        triples = resp.json()["meta_info"]["output_token_logprobs"]
        return [int(t[1]) for t in triples], [float(t[0]) for t in triples]

    greedy = {"max_new_tokens": STEPS, "temperature": 0.0, "ignore_eos": True}
    first, again = one(PROMPT, greedy), one(PROMPT, greedy)
    assert first == again  # tokens and logprobs, bit for bit
    others = [[(7 * i + j) % 500 + 3 for j in range(5 + i)] for i in range(7)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        batched, *_ = pool.map(lambda p: one(p, greedy), [PROMPT, *others])
    assert batched[0] == first[0]
    assert max(abs(a - b) for a, b in zip(batched[1], first[1], strict=True)) < 1e-2
    seeded = {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 42}
    assert one(PROMPT, seeded)[0] != one(PROMPT, seeded)[0]


def test_health_answers_while_paused(server: Any) -> None:
    """Miles starts SGLang with ``/health`` as a liveness check (``ENGINE_ENV``): it answers at once, also while
    the engine is paused for a weight push (by default SGLang generates a token for it and a paused engine
    answered 503 after 20 s: Miles took every paused SGLang engine of an async run for dead)."""
    import time

    assert server.post("/pause_generation", {"mode": "retract"}).status_code == 200
    try:
        start = time.monotonic()
        assert server.get("/health", timeout=10).status_code == 200
        assert time.monotonic() - start < 5
    finally:
        assert server.post("/continue_generation", {}).status_code == 200


def test_sampling_masks_of_top_k_sampling_are_the_kept_sets(server: Any) -> None:
    """SGLang 0.5.23's ``return_sampling_mask`` on its CPU path: with top-k sampling each output token's kept
    set (``output_token_sampling_mask``) has at most k ids and holds the sampled token, and its behaviour
    logprob (``output_token_sampling_logprobs``) is the token's under the kept set renormalised, at least the
    full-vocabulary one; Miles reads both (``GenerateOutput``), what sampling-mask replay trains on."""
    from miles.rollout.protocol import GenerateOutput

    resp = server.post(
        "/generate",
        {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "top_k": 5, "ignore_eos": True},
            "return_logprob": True,
            "return_sampling_mask": True,
        },
    )
    assert resp.status_code == 200, resp.text
    out = GenerateOutput.from_json(resp.json())
    assert out.sampling_mask is not None and out.sampling_logprobs is not None, resp.json()["meta_info"].keys()
    assert len(out.sampling_mask) == len(out.output_ids) == len(out.sampling_logprobs) == 8
    for token, kept, behaviour, full in zip(
        out.output_ids, out.sampling_mask, out.sampling_logprobs, out.output_logprobs, strict=True
    ):
        assert token in kept and 1 <= len(kept) <= 5, (token, kept)
        assert behaviour >= full - 1e-3, (behaviour, full)
