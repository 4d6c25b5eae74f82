"""Prefix-cache hit rate of a fleet behind the smg router: session / group affinity against round-robin.

Two workloads, each sent at once (every session and every group in flight together, as the rollout
manager sends them) to 2 and to 4 local engines (``python -m miles.engine``, one thread each, tiny Qwen2):

- **sessions**: multi-turn conversations of ``--turns`` turns (>= 8): a system prompt shared by every
  session, a first user message, then each turn's prompt is the previous prompt + the model's reply + a
  new user message (the key is the session id);
- **groups**: GRPO groups of ``--group-size`` samples of one prompt, prompts sharing a chat-template prefix
  (the key is the group id).

Each fleet serves every routing in the same run, caches flushed in between: smg ``manual`` with the key
in ``x-session-id`` (Miles' default router), smg ``cache_aware`` (keys stick by smg's routing-key
override), smg ``round_robin`` (no affinity: the baseline) and, without a router, the engine client's own
consistent hashing. Decoding is greedy with fixed lengths, so every routing sees the same token streams.

The hit rate is the engines' own count: ``sum(cached_tokens) / sum(prompt_tokens)`` over the responses
(what ``rollout/prefix_cache_hit_rate`` logs). The ideal is what one engine with an unbounded cache
would reuse: for each request, the longest prefix of its prompt (all but the last token) that an earlier
request of the workload already computed (its prompt and output, all but the last token) — no routing of
several engines can do better. Requests per engine (the engines' ``/server_info`` counters) show the
balance::

    python -m benchmarks.router                 # 2 and 4 engines, 16 sessions x 8 turns, 16 groups x 8
    python -m benchmarks.router --quick         # 2 engines, 8 sessions x 8 turns, 8 groups x 4

Prints a markdown table and writes ``benchmarks/results/router.json``. The engines run on the CPU
(``--device`` is accepted for the suite's sake and ignored): the hit rate is a property of the routing.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import add_common_args, machine_info, markdown_table, pin_threads, versions, write_result

ROUTINGS = ("smg manual (affinity)", "smg cache_aware", "smg round_robin", "client hashing (no router)")
"""Each fleet serves these in turn; ``smg round_robin`` is the no-affinity baseline."""


@dataclass
class Record:
    """What one request sent and got back."""

    key: str
    prompt: list[int]
    output: list[int] = field(default_factory=list)
    cached: int = 0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def ideal_cached(records: Sequence[Record]) -> int:
    """Tokens one unbounded cache would reuse, requests taken in the order they were issued."""
    seen: list[list[int]] = []
    total = 0
    for record in records:
        want = record.prompt[:-1]
        total += max((common_prefix(want, s) for s in seen), default=0)
        seen.append([*record.prompt, *record.output][:-1])
    return total


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 500) for _ in range(n)]


async def run_sessions(client: Any, args: argparse.Namespace, seed: int) -> list[Record]:
    from miles.rollout.protocol import SamplingParams

    rng = random.Random(seed)
    system = random_tokens(rng, 24)
    firsts = [random_tokens(rng, 16) for _ in range(args.sessions)]
    follow_ups = [[random_tokens(rng, 8) for _ in range(args.turns)] for _ in range(args.sessions)]
    params = SamplingParams(max_new_tokens=args.reply_tokens, temperature=0.0, ignore_eos=True)
    order: list[Record] = []

    async def session(s: int) -> None:
        prompt = [*system, *firsts[s]]
        for turn in range(args.turns):
            record = Record(f"session-{seed}-{s}", prompt)
            order.append(record)
            out = (await client.generate(prompt, params, routing_key=record.key))[0]
            record.output, record.cached = list(out.output_ids), out.cached_tokens
            prompt = [*prompt, *out.output_ids, *follow_ups[s][turn]]

    await asyncio.gather(*(session(s) for s in range(args.sessions)))
    return order


async def run_groups(client: Any, args: argparse.Namespace, seed: int) -> list[Record]:
    from miles.rollout.protocol import SamplingParams

    rng = random.Random(seed)
    template = random_tokens(rng, 16)
    prompts = [[*template, *random_tokens(rng, 32)] for _ in range(args.groups)]
    params = SamplingParams(max_new_tokens=args.reply_tokens, temperature=0.0, ignore_eos=True)
    order = [Record(f"group-{seed}-{g}", prompts[g]) for g in range(args.groups) for _ in range(args.group_size)]

    async def sample(record: Record) -> None:
        out = (await client.generate(record.prompt, params, routing_key=record.key))[0]
        record.output, record.cached = list(out.output_ids), out.cached_tokens

    await asyncio.gather(*(sample(r) for r in order))
    return order


@contextmanager
def smg(policy: str, urls: list[str], workdir: Path) -> Iterator[str]:
    """A real smg in front of ``urls`` (the command Miles launches), stopped on leaving."""
    from miles.net import free_port
    from miles.rollout.router import smg_argv, wait_for_router
    from miles.settings.model import RouterSettings

    port = free_port()
    argv = smg_argv(
        RouterSettings(name="smg", policy=policy), urls, host="127.0.0.1", port=port, prometheus_port=free_port()
    )  # type: ignore[arg-type]
    with open(workdir / f"smg-{policy}-{len(urls)}.log", "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            exited = lambda: None if process.poll() is None else f"exit code {process.returncode}"  # noqa: E731
            wait_for_router(url, urls, timeout=60, exited=exited)
            yield url
        finally:
            process.terminate()
            process.wait(timeout=30)


def served(urls: list[str]) -> list[int]:
    import httpx

    return [int(httpx.get(u + "/server_info", timeout=30).json()["generate_requests"]) for u in urls]


async def measure(urls: list[str], router_url: str | None, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    from miles.rollout.http_client import HttpEngineClient

    client = HttpEngineClient(urls, router_url=router_url)
    out: dict[str, Any] = {}
    try:
        for workload, run in (("sessions", run_sessions), ("groups", run_groups)):
            await client.flush_cache()
            before = served(urls)
            start = time.perf_counter()
            records = await run(client, args, seed)
            seconds = time.perf_counter() - start
            per_engine = [a - b for a, b in zip(served(urls), before, strict=True)]
            prompt = sum(len(r.prompt) for r in records)
            cached = sum(r.cached for r in records)
            out[workload] = {
                "requests": len(records),
                "prompt_tokens": prompt,
                "cached_tokens": cached,
                "hit_rate": cached / prompt,
                "ideal_hit_rate": ideal_cached(records) / prompt,
                "per_engine": per_engine,
                "seconds": seconds,
                "outputs": [r.output for r in records],
            }
    finally:
        await client.close()
    return out


def run_fleet(size: int, model: Path, args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    from miles.testing.engine import EngineProcess

    rows = []
    with ExitStack() as stack:
        engines = [
            stack.enter_context(EngineProcess(model, threads=args.threads, log_path=workdir / f"engine-{size}-{i}.log"))
            for i in range(size)
        ]
        urls = [e.url for e in engines]
        for routing in ROUTINGS:
            if routing.startswith("smg"):
                with smg(routing.split()[1], urls, workdir) as router_url:
                    result = asyncio.run(measure(urls, router_url, args, seed=size))
            else:
                result = asyncio.run(measure(urls, None, args, seed=size))
            rows.append({"engines": size, "routing": routing, **result})
    for row in rows:  # greedy and fixed lengths: the routings see the same streams unless batching flips a tie
        for workload in ("sessions", "groups"):
            row[workload]["same_tokens_as_first"] = row[workload]["outputs"] == rows[0][workload]["outputs"]
    for row in rows:
        for workload in ("sessions", "groups"):
            row[workload].pop("outputs")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--engines", default="2,4", help="fleet sizes (default 2,4)")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--reply-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    if args.quick:
        args.engines, args.sessions, args.groups, args.group_size = "2", 8, 8, 4
    if args.turns < 8:
        raise SystemExit("--turns: the benchmark's sessions have at least 8 turns")
    pin_threads(args.threads)  # this process; each engine gets --threads of its own
    from miles.testing.models import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="miles-router-bench-") as tmp:
        workdir = Path(tmp)
        model = build_tiny_model(workdir / "tiny", "qwen2", seed=0)
        rows = []
        for size in (int(s) for s in args.engines.split(",")):
            rows += run_fleet(size, model, args, workdir)
    table = []
    for row in rows:
        for workload in ("sessions", "groups"):
            r = row[workload]
            table.append(
                [
                    row["engines"],
                    workload,
                    row["routing"],
                    f"{100 * r['hit_rate']:.1f}%",
                    f"{100 * r['ideal_hit_rate']:.1f}%",
                    f"{100 * r['hit_rate'] / r['ideal_hit_rate']:.1f}%",
                    "/".join(str(n) for n in r["per_engine"]),
                    f"{r['seconds']:.1f}",
                ]
            )
    headers = ["engines", "workload", "routing", "hit rate", "ideal", "of ideal", "requests per engine", "s"]
    print(
        f"\n{args.sessions} sessions x {args.turns} turns, {args.groups} groups x {args.group_size} samples, "
        f"{args.reply_tokens} tokens per reply, {args.threads} thread(s) per engine\n"
    )
    print(markdown_table(headers, table))
    write_result(
        "router",
        {
            "machine": machine_info(),
            "versions": versions(["smg", "torch"]),
            "args": vars(args) | {"results_dir": None},
            "rows": rows,
        },
        args.results_dir,
    )


if __name__ == "__main__":
    main()
