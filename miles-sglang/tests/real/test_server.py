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
