"""The scheduler in-process: requests of different lengths join and leave one batch (slots are
compacted as they leave) and each still gets exactly its solo greedy continuation; the batch is cut to
``max_running_requests``; retraction recomputes the KV."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from miles.engine.launch import build_engine
from miles.engine.request import Request
from miles.rollout.protocol import FinishReason, SamplingParams

from .conftest import hf_greedy


class Collector:
    def __init__(self) -> None:
        self.done: dict[str, Request] = {}
        self.order: list[str] = []
        self.event = threading.Event()
        self.expected = 0

    def sink(self, req: Request, done: bool) -> None:
        if done:
            self.done[req.rid] = req
            self.order.append(req.rid)
            if len(self.done) == self.expected:
                self.event.set()


def make(rid: str, prompt: list[int], n: int, sink: Collector, **kw: object) -> Request:
    cfg = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)  # type: ignore[arg-type]
    return Request(rid=rid, parent_rid=rid, index=0, prompt_ids=prompt, config=cfg, sink=sink.sink)


@pytest.mark.parametrize("arch", ["llama"])
def test_mixed_batch_equals_solo_greedy(engine_models: dict[str, Path], arch: str) -> None:
    torch.set_num_threads(1)
    state = build_engine(engine_models[arch], max_running_requests=3, max_cache_tokens=0)
    sched = state.scheduler
    try:
        col = Collector()
        lengths = [3, 17, 6, 25, 1, 9]
        prompts = [[(7 * i + j) % 500 + 1 for j in range(2 + i // 2)] for i in range(len(lengths))]
        col.expected = len(lengths)
        sched.add([make(f"r{i}", p, n, col) for i, (p, n) in enumerate(zip(prompts, lengths, strict=False))])
        assert col.event.wait(120)
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=False)):
            assert col.done[f"r{i}"].output_ids == hf_greedy(engine_models[arch], p, n), i
        assert col.order.index("r0") < col.order.index("r1")  # the short one left the batch first
        assert sched.steps < sum(lengths)  # decode steps were shared
    finally:
        sched.stop()


def test_requests_that_arrive_during_a_prefill_join_before_the_next_decode_step(
    engine_models: dict[str, Path],
) -> None:
    """The samples of a step reach the engine a few milliseconds apart; one sent while the first is being
    prefilled is prefilled before the batch decodes (SGLang's prefill priority), not after a decode step of
    the first alone, which costs a step at the start and one more at the end."""
    torch.set_num_threads(1)
    state = build_engine(engine_models["qwen2"], max_cache_tokens=0)
    sched = state.scheduler
    runner = sched.runner
    col = Collector()
    col.expected = 2
    late = make("late", [9, 8, 7, 6], 6, col)
    prefill, decode = runner.prefill, runner.decode
    decoded_rows: list[int] = []
    sent: list[Request] = []

    def prefill_then_send(*args: object, **kwargs: object) -> object:
        out = prefill(*args, **kwargs)
        if not sent:
            sent.append(late)
            sched.add(sent)  # (sent from another thread in a run; the engine sees it after this prefill)
        return out

    def counted(tokens: list[int], *args: object, **kwargs: object) -> object:
        decoded_rows.append(len(tokens))
        return decode(tokens, *args, **kwargs)

    runner.prefill, runner.decode = prefill_then_send, counted
    try:
        sched.add([make("first", [1, 2, 3, 4, 5], 6, col)])
        assert col.event.wait(120)
        assert decoded_rows == [2] * 6  # six tokens each, from six decode steps of both (the prompt's last
        assert sched.steps == 6  # token is fed by the first); before: [1, 2, 2, 2, 2, 2, 1]
    finally:
        sched.stop()


def test_retract_recomputes_kv(engine_models: dict[str, Path]) -> None:
    torch.set_num_threads(1)
    state = build_engine(engine_models["qwen2"], max_cache_tokens=1000)
    sched = state.scheduler
    try:
        col = Collector()
        col.expected = 1
        prompt = [5, 6, 7, 8, 9]
        sched.submit(sched.pause, "in_place").result()
        sched.add([make("a", prompt, 30, col)])

        # admit and decode a few tokens by hand on the scheduler thread, then retract and resume
        def few_steps() -> int:
            sched._admit()
            for _ in range(5):
                sched._decode_step()
            return len(sched.running)

        assert sched.submit(few_steps).result() == 1
        sched.submit(sched.pause, "retract").result()
        assert sched.submit(lambda: (len(sched.running), len(sched.waiting))).result() == (0, 1)
        sched.submit(sched.resume).result()
        assert col.event.wait(60)
        assert col.done["a"].output_ids == hf_greedy(engine_models["qwen2"], prompt, 30)
    finally:
        sched.stop()


def test_kv_budget_bounds_the_batch_and_rejects_what_can_never_fit(engine_models: dict[str, Path]) -> None:
    torch.set_num_threads(1)
    # 8 slots x 512 positions: requests of span 5 + 300 + 1 fit 8 at a time
    state = build_engine(engine_models["qwen2"], max_cache_tokens=0, max_kv_tokens=8 * 512)
    sched = state.scheduler
    try:
        col = Collector()
        col.expected = 13
        reqs = [make(f"r{i}", [i + 1, 2, 3, 4, 5], 300, col) for i in range(12)]
        reqs.append(make("huge", [1, 2, 3], 5000, col))  # capped at the context (1024): 8 x 1024 > budget
        sched.add(reqs)
        assert col.event.wait(300)
        assert all(col.done[f"r{i}"].finish_reason == FinishReason("length", length=300) for i in range(12))
        assert sched.peak_running == 8
        huge = col.done["huge"].finish_reason
        assert huge is not None and huge.type == "abort" and huge.message is not None and "budget" in huge.message
        assert sched.runner.slots * sched.runner.capacity <= 8 * 512
    finally:
        sched.stop()


def test_deterministic_inference_is_batch_and_cache_invariant(engine_models: dict[str, Path]) -> None:
    """With ``deterministic``, a seeded sampled request gets bit-identical tokens and logprobs alone, in a
    mixed batch, as a cache hit, and after a flush; the samples of a group hit the whole prompt."""
    torch.set_num_threads(1)
    state = build_engine(engine_models["qwen2"], max_cache_tokens=4096, enable_deterministic_inference=True)
    sched = state.scheduler
    prompt = [(11 * j) % 400 + 3 for j in range(21)]

    def sampled(rid: str, p: list[int], n: int, col: Collector) -> Request:
        cfg = SamplingParams(max_new_tokens=n, temperature=0.8, ignore_eos=True, sampling_seed=1234)
        req = Request(rid=rid, parent_rid=rid, index=0, prompt_ids=p, config=cfg, sink=col.sink)
        req.return_logprob = True
        return req

    def run(reqs: list[Request], col: Collector) -> dict[str, Request]:
        col.expected = len(reqs)
        sched.add(reqs)
        assert col.event.wait(120)
        return col.done

    try:
        alone = run([sampled("solo", prompt, 12, col := Collector())], col)["solo"]
        assert alone.cached_tokens == 0
        first = (alone.output_ids, list(alone.output_logprobs))
        assert len(first[0]) == 12
        # the same request among others of different lengths, twice (the second one hits the cache)
        col2 = Collector()
        others = [
            sampled(f"o{i}", [(5 * i + j) % 300 + 1 for j in range(3 + 4 * i)], 4 + 5 * i, col2) for i in range(4)
        ]
        mixed = run(
            [others[0], sampled("a", prompt, 12, col2), others[1], sampled("b", prompt, 12, col2), *others[2:]], col2
        )
        for rid in ("a", "b"):
            assert (mixed[rid].output_ids, list(mixed[rid].output_logprobs)) == first, rid
        assert {mixed["a"].cached_tokens, mixed["b"].cached_tokens} == {len(prompt) - 1}  # whole-prompt hits
        sched.submit(sched.flush_cache).result()
        again = run([sampled("c", prompt, 12, col3 := Collector())], col3)["c"]
        assert again.cached_tokens == 0
        assert (again.output_ids, list(again.output_logprobs)) == first
        assert sched.stats()["deterministic"] is True
    finally:
        sched.stop()
