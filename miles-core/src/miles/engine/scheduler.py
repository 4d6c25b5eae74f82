"""The continuous-batching scheduler: one thread that owns the model, the KV buffers and the cache.

Every iteration it (1) runs commands sent from the HTTP side (add / abort requests, pause, continue,
flush, weight updates), (2) admits waiting requests into free slots — copying their longest cached
prefix from the radix cache and prefilling the rest — and (3) runs one batched decode step for every
running request. When commands arrived while a prefill ran, the iteration starts over before decoding, so
requests sent together are prefilled before the batch decodes, as SGLang gives prefill priority (a GRPO
step's samples reach the engine over a few milliseconds: the first was otherwise prefilled and decoded a
step alone, and the batch needed a step more at its end). Requests therefore join and leave the batch at
token granularity: a short request never waits for a long one. Running request ``i`` always sits in KV
slot ``i``; when one leaves, the last one is moved into its slot.

With ``deterministic`` (``--enable-deterministic-inference``, SGLang's flag) every forward is
batch-invariant, and the prefix cache is an :class:`ExactPrefixCache`, whose hits are bit for bit what a
recomputation gives. Where the model runner computes with the batch-invariant ops (:mod:`miles.engine.invariant`:
dense float32 models on CPU) requests are batched as usual, each row's numbers being independent of the
others; elsewhere each request is prefilled alone from position 0 (chunked at fixed boundaries) and decoded
alone over exactly its own KV (decode then runs one request at a time). A request's tokens and logprobs are
then a function of the request alone (its tokens, sampling parameters and seed) and the weights: not of what
else runs, of timing, or of what the cache holds, which is what an exact resume of a training run needs.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from miles.engine.model_runner import ModelRunner
from miles.engine.multimodal import ImageInputs
from miles.engine.radix_cache import ExactPrefixCache, PrefixCache, PrefixMatch, RadixCache
from miles.engine.request import Request
from miles.engine.sampling import KeptSet, sample_rows
from miles.engine.top_logprobs import record_input_top_logprobs, record_output_top_logprobs
from miles.rollout.protocol import FinishReason
from miles.types import PauseMode

__all__ = ["Scheduler", "SchedulerConfig"]

log = logging.getLogger(__name__)

_Command = tuple[Callable[..., Any], tuple[Any, ...], "concurrent.futures.Future[Any] | None"]
_CHUNK = 1024
"""Longest piece of one prompt prefilled in one forward (chunked prefill beyond)."""
_BATCH_TOKENS = 8192
"""Most (padded) tokens in one batched prefill forward."""


@dataclass
class _Plan:
    """Admission of one request: its cache hit and the prefill work left."""

    req: Request
    seq: list[int]
    key: list[int]
    """``seq`` as the prefix cache knows it (:attr:`Request.cache_tokens`)."""
    need: int
    want_input: bool
    match: PrefixMatch
    done: int = 0
    routed: list[torch.Tensor] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)


@dataclass
class SchedulerConfig:
    """Limits of the scheduler."""

    max_running_requests: int = 64
    max_cache_tokens: int = 1 << 16
    context_length: int | None = None
    """Longest sequence (prompt + output); ``None``: the model's ``max_position_embeddings``."""
    weight_version: str = "0"
    max_kv_tokens: int | None = None
    """Token positions the running batch's KV buffers may hold (slots x capacity); requests wait for
    room beyond it. ``None``: what fits in 4 GiB for this model."""
    deterministic: bool = False
    """Batch-invariant forwards and an exact-match prefix cache (see the module docstring)."""


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class Scheduler:
    """Owns a :class:`ModelRunner`; all state changes happen on its own thread."""

    def __init__(
        self,
        runner: ModelRunner,
        eos_token_ids: list[int],
        config: SchedulerConfig,
        text_of: Callable[[list[int], bool], str],
    ) -> None:
        self.runner = runner
        self.eos_token_ids = eos_token_ids
        self.config = config
        self.text_of = text_of
        self.context_length = min(config.context_length or runner.context_length, runner.context_length)
        self.cache: PrefixCache = (
            ExactPrefixCache(config.max_cache_tokens) if config.deterministic else RadixCache(config.max_cache_tokens)
        )
        self.weight_version = config.weight_version
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.paused: PauseMode | None = None
        self._inbox: queue.Queue[_Command] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="miles-engine", daemon=True)
        self.steps = 0
        self.generated_tokens = 0
        self.peak_running = 0
        self.max_kv_tokens = config.max_kv_tokens or max(1, (4 << 30) // runner.kv_bytes_per_token)

    # ------------------------------------------------------------- public API
    def start(self) -> None:
        """Run the loop on a background thread (in-process use: tests)."""
        self._thread.start()

    def run_forever(self) -> None:
        """Run the loop on the calling thread until :meth:`stop` — what ``miles serve`` does on its main
        thread, with HTTP on another one. torch's OpenMP thread pool belongs to the thread that first ran
        a parallel region (the main thread, which loaded the model); a second thread issuing parallel
        regions gets a second pool, and libgomp then throttles spin-waiting (more OpenMP threads than
        cores): with 2 threads, a bf16 SmolLM2 decode step measured 1.4-1.7x slower off the main thread."""
        self._loop()

    def run_until_idle(self) -> None:
        """Run the loop on the calling thread until nothing waits, runs or is queued (benchmarks)."""
        self._loop(until_idle=True)

    def stop(self) -> None:
        """Stop the loop (thread-safe; from a signal handler too); joins the background thread."""
        self._stop.set()
        self._inbox.put((lambda: None, (), None))
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """Run ``fn(*args)`` on the scheduler thread between steps; the future holds its result."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._inbox.put((fn, args, future))
        return future

    def add(self, requests: list[Request]) -> None:
        """Queue requests (thread-safe)."""
        self._inbox.put((self._add, (requests,), None))

    def abort(self, rid: str | None) -> None:
        """Abort a request by id (or parent id); ``None`` aborts all (thread-safe)."""
        self._inbox.put((self._abort, (rid, "aborted by /abort_request"), None))

    # ---------------------------------------------------------- commands (thread)
    def _add(self, requests: list[Request]) -> None:
        for req in requests:
            if req.generator is None:
                req.generator = torch.Generator(device=self.runner.device)
                seed = req.config.sampling_seed
                req.generator.manual_seed(
                    int(torch.randint(0, 2**62, (1,)).item()) if seed is None else seed + req.index
                )
            self.waiting.append(req)  # while paused, new requests wait for /continue_generation

    def _abort(self, rid: str | None, message: str) -> int:
        count = 0
        for req in list(self.running) + list(self.waiting):
            if rid is None or req.rid == rid or req.parent_rid == rid:
                count += 1
                self._finish(req, FinishReason("abort", message=message))
        return count

    def pause(self, mode: PauseMode) -> None:
        """Stop scheduling; ``abort`` aborts every request, ``retract`` frees the running ones' KV (they are
        recomputed on resume), ``in_place`` keeps them as they are."""
        self.paused = mode
        if mode == "abort":
            self._abort(None, "aborted by /pause_generation (mode abort)")
        elif mode == "retract":
            for req in reversed(list(self.running)):
                self._release(req)
                self.waiting.appendleft(req)
        log.info("generation paused (mode %s)", mode)

    def resume(self) -> None:
        self.paused = None
        log.info("generation continued")

    def flush_cache(self) -> None:
        self.cache.flush()

    def update_weights(self, model_path: str, weight_version: str | None, flush_cache: bool, abort_all: bool) -> str:
        """Pause (unless already paused), load the weights, bump the version, flush, resume."""
        was_paused = self.paused is not None
        if not was_paused:
            self.pause("abort" if abort_all else "retract")
        try:
            count = self.runner.load_weights(model_path)
        finally:
            if not was_paused:
                self.resume()
        if weight_version is None:
            current = self.weight_version
            weight_version = str(int(current) + 1) if current.isdigit() else current + "+1"
        self.weight_version = weight_version
        if flush_cache:
            self.cache.flush()
        log.info("loaded %d tensors from %s; weight version %s", count, model_path, weight_version)
        return weight_version

    def set_weight_version(self, version: str) -> None:
        self.weight_version = version

    def stats(self) -> dict[str, Any]:
        return {
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
            "cache_tokens": self.cache.num_tokens,
            "cache_hit_rate": self.cache.hit_rate,
            "paused": self.paused,
            "decode_steps": self.steps,
            "generated_tokens": self.generated_tokens,
            "peak_running_reqs": self.peak_running,
            "max_kv_tokens": self.max_kv_tokens,
            "deterministic": self.config.deterministic,
            "attention_backend": self.runner.attention_backend,
            "weights_on_huge_pages": self.runner.huge_pages,
            "torch_threads": torch.get_num_threads(),  # the scheduler thread's (this runs on it)
        }

    # ------------------------------------------------------------------ loop
    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, args, future = item
            try:
                result = fn(*args)
            except Exception as exc:  # reported to the caller, never kills the engine
                if future is None:
                    log.exception("engine command %s failed", getattr(fn, "__name__", fn))
                else:
                    future.set_exception(exc)
            else:
                if future is not None:
                    future.set_result(result)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _loop(self, until_idle: bool = False) -> None:
        with torch.inference_mode():
            while not self._stop.is_set():
                idle = self.paused is not None or (not self.running and not self.waiting)
                if until_idle and idle and self._inbox.empty():
                    return
                self._drain(block=idle and not until_idle)
                if self.paused is not None:
                    continue
                try:
                    admitted = self._admit()
                    self._finish_prefill_only()
                    if admitted and not self._inbox.empty():
                        continue  # what arrived during the prefill joins before the next decode step
                    if self.running:
                        self._decode_step()
                except Exception as exc:  # a model error fails the batch, not the server
                    log.exception("engine step failed")
                    for req in list(self.running) + list(self.waiting):
                        self._finish(req, FinishReason("abort", message=f"engine error: {exc}"), cache=False)
            self._shutdown()

    def _shutdown(self) -> None:
        """After :meth:`stop`: answer everything still pending, so no HTTP handler waits forever."""
        for req in list(self.running) + list(self.waiting):
            self._finish(req, FinishReason("abort", message="the engine is shutting down"), cache=False)
        while True:
            try:
                _, _, future = self._inbox.get_nowait()
            except queue.Empty:
                return
            if future is not None and not future.done():
                future.set_exception(RuntimeError("the engine is shutting down"))

    # ------------------------------------------------------------- admission
    def _admit(self) -> bool:
        """Move waiting requests into free slots, prefilling them in padded batches; whether any moved.

        Requests with the same sequence as an earlier one of this round (the ``n`` samples of a prompt)
        are admitted after it, so they find its KV in the prefix cache instead of recomputing it.
        """
        if not self.waiting:
            return False
        idle = not self.running
        batch: list[Request] = []
        count = len(self.running)
        longest = max((self._span(r) for r in self.running), default=0)
        while self.waiting and count < self.config.max_running_requests:
            req = self.waiting[0]
            span = max(longest, self._span(req))
            slots = max(self.runner.slots, _pow2(count + 1))
            capacity = max(self.runner.capacity, min(_pow2(span), max(span, self.context_length)))
            if slots * capacity > self.max_kv_tokens:
                if count == 0:
                    self.waiting.popleft()
                    message = f"the request needs {capacity} KV positions; the engine's budget is {self.max_kv_tokens}"
                    self._finish(req, FinishReason("abort", message=message))
                    continue
                break  # waits until running requests leave
            batch.append(self.waiting.popleft())
            count += 1
            longest = span
        if not batch:
            return False
        if idle:
            self.runner.fit(count, longest)
        self.peak_running = max(self.peak_running, count)
        first: list[Request] = []
        later: list[Request] = []
        seen: set[tuple[int, ...]] = set()
        for req in batch:
            key = tuple(req.cache_tokens[:-1])
            if self.cache.max_tokens > 0 and key and key in seen:
                later.append(req)
            else:
                seen.add(key)
                first.append(req)
        for group in (first, later):
            if group:
                self._prefill(group)
        return True

    def _span(self, req: Request) -> int:
        """KV positions ``req`` may need at most."""
        return min(len(req.prompt_ids) + req.config.max_new_tokens, self.context_length) + 1

    def _prefill(self, reqs: list[Request]) -> None:
        plans = []
        for req in reqs:
            seq = req.tokens
            need = len(seq) - 1  # the last token is fed by the decode step
            want_input = not req.admitted and req.return_logprob and 0 <= req.logprob_start_len < len(req.prompt_ids)
            limit = min(need, max(req.logprob_start_len - 1, 0)) if want_input else need
            key = req.cache_tokens
            match = self.cache.match(key[:need], limit=0 if req.lora_name else limit)  # KV depends on the adapter
            plans.append(_Plan(req, seq, key, need, want_input, match))
        # the vision tower on the prefill that first feeds a prompt's placeholders, one forward for all of them
        generation = self.runner.weights_generation
        todo: dict[int, ImageInputs] = {}  # (the n requests of a prompt share its images)
        for plan in plans:
            images = plan.req.images
            if images is not None and images.needs_encoding(plan.match.length, generation):
                todo[id(images)] = images
        if todo:
            self.runner.encode_images(list(todo.values()))
        plans.sort(key=lambda plan: plan.need - plan.match.length)
        first_slot = len(self.running)
        self.runner.ensure(first_slot + len(plans), max(len(plan.seq) for plan in plans) + 1)  # grows once
        for offset, plan in enumerate(plans):
            slot = first_slot + offset
            if plan.match.length:
                self.runner.load_prefix(slot, plan.match.k, plan.match.v)
            plan.routed = [plan.match.experts] if plan.match.experts is not None else []
            self.running.append(plan.req)
        # one padded forward per group of similar lengths; long prompts go in chunks
        work = [(first_slot + i, p) for i, p in enumerate(plans) if p.need > p.match.length]
        for _, plan in work:
            plan.done = plan.match.length
        while work:
            group = [work[0]]
            for item in work[1:]:
                sizes = [min(p.need - p.done, _CHUNK) for _, p in [*group, item]]
                padded = max(sizes) * len(sizes)
                if (
                    self._one_per_forward  # deterministic without the batch-invariant ops
                    or item[0] != group[-1][0] + 1
                    or padded > 1.25 * sum(sizes)
                    or padded > _BATCH_TOKENS
                ):
                    break
                group.append(item)
            chunks = [p.seq[p.done : min(p.need, p.done + _CHUNK)] for _, p in group]
            self.runner.lora.set_rows([p.req.lora_name for _, p in group])
            chunk_images = [p.req.images for _, p in group]
            logits, experts = self.runner.prefill(
                group[0][0], chunks, [p.done for _, p in group], [p.want_input for _, p in group], chunk_images
            )
            for (_, plan), chunk, lg, ex in zip(group, chunks, logits, experts, strict=True):
                plan.done += len(chunk)
                if ex is not None:
                    plan.routed.append(ex)
                if lg is not None:
                    plan.logits.append(lg)
            work = [item for item in work if item[1].done < item[1].need]
            work.sort(key=lambda item: item[0])
        for offset, plan in enumerate(plans):
            req = plan.req
            if plan.need > plan.match.length and req.lora_name is None:
                k, v = self.runner.read_kv(first_slot + offset, plan.need)
                experts = torch.cat(plan.routed) if self.runner.is_moe and plan.routed else None
                self.cache.insert(plan.key[: plan.need], k, v, experts)
            if plan.want_input:
                if plan.logits:
                    self._input_logprobs(req, torch.cat(plan.logits), plan.match.length)
                else:
                    req.input_logprobs = [None] if req.logprob_start_len == 0 else []
            if not req.admitted:
                req.cached_tokens = plan.match.length
                req.admitted = True
            req.routed = plan.routed
            req.kv_len = plan.need

    def _input_logprobs(self, req: Request, logits: torch.Tensor, offset: int) -> None:
        """Logprobs of prompt tokens ``logprob_start_len..`` from prefill logits (row ``p - 1 - offset``)."""
        start = req.logprob_start_len
        temperature = 1.0 if req.config.greedy or req.return_original_logprob else req.config.temperature
        logp = torch.log_softmax(logits / temperature, dim=-1)
        prompt = req.prompt_ids
        out: list[float | None] = []
        for p in range(start, len(prompt)):
            if p == 0:
                out.append(None)
            else:
                out.append(float(logp[p - 1 - offset, prompt[p]]))
        req.input_logprobs = out
        record_input_top_logprobs(req, logits, offset)

    def _finish_prefill_only(self) -> None:
        """Finish requests with ``max_new_tokens == 0`` once prefilled (SGLang's scoring-only requests: the
        prompt's logprobs, no output token)."""
        for req in [r for r in self.running if r.config.max_new_tokens == 0]:
            self._finish(req, FinishReason("length", length=0))

    # ----------------------------------------------------------------- decode
    def _forward(self, running: list[Request]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``[B, vocab]`` (and routed experts) of the next token of every running request: one
        batched forward, or one forward per request in deterministic mode."""
        lora = self.runner.lora
        if not self._one_per_forward:
            lora.set_rows([r.lora_name for r in running])
            deltas = [r.rope_delta for r in running]
            return self.runner.decode([r.last_token for r in running], [r.kv_len for r in running], rope_deltas=deltas)
        rows = []
        for i, r in enumerate(running):
            lora.set_rows([r.lora_name])
            rows.append(self.runner.decode([r.last_token], [r.kv_len], first_slot=i, rope_deltas=[r.rope_delta]))
        routed = None if rows[0][1] is None else torch.cat([r for _, r in rows if r is not None])
        return torch.cat([lg for lg, _ in rows]), routed

    def _sample(
        self, logits: torch.Tensor, running: list[Request], banned: list[list[int]]
    ) -> tuple[list[int], list[float], list[float], list[KeptSet | None]]:
        """One token per running request, with its logprobs and, where asked, its kept set."""
        kept: list[KeptSet | None] = []
        masks = [r.return_sampling_mask for r in running]
        if not self._one_per_forward:  # (sampling is row by row: batch-invariant given invariant logits)
            configs, generators = [r.config for r in running], [r.generator for r in running]
            ids, logprobs, raws = sample_rows(logits, configs, generators, banned, kept=kept, masks=masks)
            return ids, logprobs, raws, kept
        ids, logprobs, raws = [], [], []
        for i, req in enumerate(running):
            one = sample_rows(
                logits[i : i + 1].clone(), [req.config], [req.generator], [banned[i]], kept=kept, masks=masks[i : i + 1]
            )
            ids += one[0]
            logprobs += one[1]
            raws += one[2]
        return ids, logprobs, raws, kept

    @property
    def _one_per_forward(self) -> bool:
        """Deterministic inference where the model's ops are not batch-invariant (or LoRA adapters, whose
        per-row additions are not, are loaded): each request alone."""
        if not self.config.deterministic:
            return False
        return not getattr(self.runner, "invariant", False) or bool(self.runner.lora.adapters)

    def _decode_step(self) -> None:
        running = self.running
        logits, routed = self._forward(running)
        self.steps += 1
        banned: list[list[int]] = []
        for i, req in enumerate(running):
            req.kv_len += 1
            if routed is not None:
                req.routed.append(routed[i : i + 1])
            if len(req.output_ids) < req.config.min_new_tokens:
                banned.append(self.eos_token_ids + req.config.stop_token_ids)
            else:
                banned.append([])
        record_output_top_logprobs(running, logits, banned)
        ids, logprobs, raws, kept = self._sample(logits, running, banned)
        self.generated_tokens += len(ids)
        done: list[tuple[Request, FinishReason]] = []
        for req, token, lp, raw, mask in zip(running, ids, logprobs, raws, kept, strict=True):
            req.record_token(token, lp, raw, self.weight_version, mask)
            reason = self._check_stop(req, token)
            if reason is not None:
                req.finish_reason = reason
                done.append((req, reason))
            elif req.stream:
                req.text = self.text_of(req.output_ids, req.config.skip_special_tokens)
                req.sink(req, False)
        for req, reason in done:
            self._finish(req, reason)

    def _check_stop(self, req: Request, token: int) -> FinishReason | None:
        cfg = req.config
        n = len(req.output_ids)
        if n >= cfg.min_new_tokens:
            if token in cfg.stop_token_ids:
                return FinishReason("stop", matched=token)
            if not cfg.ignore_eos and token in self.eos_token_ids:
                return FinishReason("stop", matched=token)
            if cfg.stop:
                text = self.text_of(req.output_ids, cfg.skip_special_tokens)
                for stop in cfg.stop:
                    if stop in text:
                        return FinishReason("stop", matched=stop)
        if n >= cfg.max_new_tokens:
            return FinishReason("length", length=n)
        if len(req.prompt_ids) + n >= self.context_length:
            return FinishReason("length", length=n)
        return None

    # ---------------------------------------------------------------- finish
    def _release(self, req: Request) -> None:
        """Take ``req`` out of the running batch (its slot gets the last running request)."""
        slot = self.running.index(req)
        last = len(self.running) - 1
        if slot != last:
            moved = self.running[last]
            self.runner.move_slot(last, slot, moved.kv_len)
            self.running[slot] = moved
        self.running.pop()

    def _finish(self, req: Request, reason: FinishReason, cache: bool = True) -> None:
        req.finish_reason = reason
        if req in self.running:
            seq = req.cache_tokens[: req.kv_len]
            # deterministic mode caches prefills only: decode-step KV differs in the last bits from a prefill's
            cacheable = cache and req.lora_name is None  # an adapter's KV is not the base model's
            if cacheable and reason.type != "abort" and req.kv_len and not self.config.deterministic:
                k, v = self.runner.read_kv(self.running.index(req), req.kv_len)
                experts = torch.cat(req.routed) if self.runner.is_moe and req.routed else None
                self.cache.insert(seq, k, v, experts)
            self._release(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        text = self.text_of(req.output_ids, req.config.skip_special_tokens)
        if reason.type == "stop" and isinstance(reason.matched, str) and not req.config.no_stop_trim:
            text = text[: text.find(reason.matched)]
        req.text = text
        req.sink(req, True)

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Block until nothing runs or waits (for tests and benchmarks)."""
        deadline = time.monotonic() + timeout
        while (self.running or self.waiting) and time.monotonic() < deadline:
            time.sleep(0.01)
