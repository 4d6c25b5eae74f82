"""The TITO session server: its overhead per turn against a direct ``/generate``, and the prefix-cache hit
rate of multi-turn episodes with and without session affinity.

**Overhead.** A local engine (``python -m miles.engine``) serves the model; a session server runs in this
process in front of it. Each of ``--episodes`` episodes makes ``--turns`` chat requests (raw OpenAI JSON
over loopback HTTP: a user message per turn, ``--max-tokens`` per reply, a fixed seed per turn). The same
turns are then replayed as direct ``/generate`` calls with the very token ids the session sent and the
same sampling parameters and seed; the replay must produce the same tokens. Before each side of an
episode the engine's prefix cache is flushed, so both sides see the same cache behaviour, and the side
that goes first alternates. Overhead = session turn time - direct turn time (medians per turn index; the
history, hence the rendering work, grows with the turn).

**Prefix cache.** With ``--engines`` engines (2 by default) the episodes run ``--concurrency`` at a time,
once with session affinity (every turn of a session to the engine its routing key hashes to) and once
without (the least-loaded engine per turn); with ``smg`` installed (``--routers auto``, the default) also
behind a real smg router, as ``rollout.router = "smg"`` runs it: ``manual`` (the session's routing key in
``x-session-id`` pins it to one engine) and ``round_robin`` (no affinity). The hit rate is cached prompt
tokens over prompt tokens of turns 2 and later (turn 1's prompt is new to every engine), from each
answer's ``usage``::

    python -m benchmarks.sessions                     # tiny model, 8 episodes x 10 turns
    python -m benchmarks.sessions --quick
    python -m benchmarks.sessions --model smollm2     # SmolLM2-135M-Instruct and its real template

Prints markdown tables and writes ``benchmarks/results/sessions.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    add_common_args,
    machine_info,
    markdown_table,
    median,
    model_dir,
    pin_threads,
    versions,
    write_result,
)


def question(episode: int, turn: int) -> str:
    return f"Episode {episode}, question {turn}: what is {turn + 3} + {episode * 7 + turn}? Think it through."


async def session_episode(http: Any, episode: int, turns: int, max_tokens: int, seed: int) -> list[dict[str, Any]]:
    """One episode through the session server; per turn: seconds, prompt ids, output ids, cache usage."""
    sid = (await http.post("/sessions", json={"sampling": {"seed": seed, "override": True}})).json()["id"]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant."}]
    out = []
    for turn in range(turns):
        messages.append({"role": "user", "content": question(episode, turn)})
        body = {"model": "policy", "messages": messages, "max_tokens": max_tokens, "return_token_ids": True}
        start = time.perf_counter()
        resp = await http.post(f"/sessions/{sid}/v1/chat/completions", json=body)
        seconds = time.perf_counter() - start
        resp.raise_for_status()
        data = resp.json()
        choice = data["choices"][0]
        out.append({
            "seconds": seconds,
            "prompt": data["prompt_token_ids"],
            "output": choice["token_ids"],
            "prompt_tokens": data["usage"]["prompt_tokens"],
            "cached": data["usage"]["prompt_tokens_details"]["cached_tokens"],
            "engine": data["miles"]["engine"],
        })  # fmt: skip
        messages.append({k: v for k, v in choice["message"].items() if v is not None})
    await http.delete(f"/sessions/{sid}")
    return out


async def direct_episode(server: Any, turns: list[dict[str, Any]], max_tokens: int, seed: int) -> list[float]:
    """The same turns as direct ``/generate`` calls (same ids, sampling and seed); per-turn seconds."""
    from miles.sessions.session import SessionSampling

    probe = server.create_session(sampling=SessionSampling(seed=seed, override=True))
    times = []
    try:
        for k, turn in enumerate(turns):
            params = server._params(probe, _Request(max_tokens), server.context_length - len(turn["prompt"]), k)
            start = time.perf_counter()
            (output,) = await server.client.generate(turn["prompt"], params, routing_key=probe.routing_key)
            times.append(time.perf_counter() - start)
            if list(output.output_ids) != turn["output"]:
                raise SystemExit(f"turn {k}: /generate on the session's ids sampled other tokens")
    finally:
        server.sessions.pop(probe.id, None)
    return times


class _Request:
    """A chat request with only ``max_tokens`` set (the session's sampling applies)."""

    temperature = None
    top_p = None
    seed = None
    stop_list: list[str] = []  # noqa: RUF012

    def __init__(self, max_tokens: int) -> None:
        self.limit = max_tokens


async def overhead(engine_url: str, args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from miles.rollout.http_client import HttpEngineClient
    from miles.sessions.server import SessionServer
    from miles.settings.sessions import SessionSettings

    async with HttpEngineClient([engine_url]) as client:
        server = await SessionServer.for_engines(client, SessionSettings(live_check=False))
        url = await server.start()
        session_t: list[list[float]] = [[] for _ in range(args.turns)]
        direct_t: list[list[float]] = [[] for _ in range(args.turns)]
        # the breakdown of a session turn: time inside the server's chat() less its engine call is the
        # server's own work (matching, rendering, tokenising, recording); the rest is HTTP and JSON
        inside: list[float] = []
        engine: list[float] = []
        chat, generate = server.chat, client.generate

        async def timed_chat(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return await chat(*a, **k)
            finally:
                inside.append(time.perf_counter() - start)

        async def timed_generate(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return await generate(*a, **k)
            finally:
                engine.append(time.perf_counter() - start)

        server.chat = timed_chat  # type: ignore[method-assign]
        server_work: list[float] = []
        http_work: list[float] = []
        try:
            async with httpx.AsyncClient(base_url=url, timeout=600) as http:
                await session_episode(http, -1, 2, args.max_tokens, 1)  # warm-up (tokenizer, jinja, HTTP)
                for e in range(args.episodes):
                    seed = 1000 + e
                    sides = ["session", "direct"] if e % 2 == 0 else ["direct", "session"]
                    turns: list[dict[str, Any]] | None = None
                    if sides[0] == "direct":  # the direct side needs the session's ids: record them first
                        await client.flush_cache()
                        turns = await session_episode(http, e, args.turns, args.max_tokens, seed)
                    for side in sides:
                        await client.flush_cache()
                        if side == "session":
                            inside.clear()
                            engine.clear()
                            client.generate = timed_generate  # type: ignore[method-assign]
                            turns = await session_episode(http, e, args.turns, args.max_tokens, seed)
                            client.generate = generate  # type: ignore[method-assign]
                            for k, t in enumerate(turns):
                                session_t[k].append(t["seconds"])
                                server_work.append(inside[k] - engine[k])
                                http_work.append(t["seconds"] - inside[k])
                        else:
                            assert turns is not None
                            for k, s in enumerate(await direct_episode(server, turns, args.max_tokens, seed)):
                                direct_t[k].append(s)
                    assert turns is not None
        finally:
            await server.stop()
    rows = []
    for k in range(args.turns):
        s, d = median(session_t[k]), median(direct_t[k])
        rows.append({"turn": k + 1, "prompt_tokens": len(turns[k]["prompt"]), "session_ms": s * 1e3, "direct_ms": d * 1e3, "overhead_ms": (s - d) * 1e3})  # fmt: skip
    all_s = [x for ts in session_t for x in ts]
    all_d = [x for ts in direct_t for x in ts]
    return {
        "per_turn": rows,
        "session_ms": median(all_s) * 1e3,
        "direct_ms": median(all_d) * 1e3,
        "server_work_ms": median(server_work) * 1e3,
        "http_json_ms": median(http_work) * 1e3,
    }


ROUTINGS = {
    "session affinity": (True, None),
    "least loaded": (False, None),
    "smg manual (affinity)": (True, "manual"),
    "smg round_robin": (True, "round_robin"),
}
"""The cache comparison's routings: ``(rollout.sessions.affinity, smg policy or None)``. Behind smg the
session's routing key travels as ``x-session-id`` (``manual``: a key stays on the engine it first went to;
``round_robin``: no affinity); without a router the engine client hashes the key itself."""


def routings(choice: str) -> list[str]:
    """``--routers``: ``none`` (the engine client only), ``smg``, or ``auto`` (smg when it is installed)."""
    if choice == "none":
        return ["session affinity", "least loaded"]
    if choice == "auto":
        from miles.errors import SettingsError
        from miles.rollout.router import smg_executable

        try:
            smg_executable()
        except SettingsError:
            return ["session affinity", "least loaded"]
    return list(ROUTINGS)


async def cache_hit_rates(urls: list[str], args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    import contextlib

    from benchmarks.router import smg

    results = []
    for routing in routings(args.routers):
        affinity, policy = ROUTINGS[routing]
        with contextlib.ExitStack() as stack:
            router_url = stack.enter_context(smg(policy, urls, workdir)) if policy is not None else None
            episodes, seconds = await _cache_run(urls, router_url, affinity, args)
        later = [t for ep in episodes for t in ep[1:]]
        every = [t for ep in episodes for t in ep]
        engines_per_episode = sum(len({t["engine"] for t in ep}) for ep in episodes) / len(episodes)
        results.append({
            "routing": routing,
            "engines": len(urls),
            "hit_rate_turn2plus": sum(t["cached"] for t in later) / max(sum(t["prompt_tokens"] for t in later), 1),
            "hit_rate_all": sum(t["cached"] for t in every) / max(sum(t["prompt_tokens"] for t in every), 1),
            "engines_per_episode": engines_per_episode,
            "seconds": seconds,
        })  # fmt: skip
    return results


async def _cache_run(
    urls: list[str], router_url: str | None, affinity: bool, args: argparse.Namespace
) -> tuple[list[list[dict[str, Any]]], float]:
    """The episodes of one routing through a session server (caches flushed first), and their seconds."""
    import httpx

    from miles.rollout.http_client import HttpEngineClient
    from miles.sessions.server import SessionServer
    from miles.settings.sessions import SessionSettings

    async with HttpEngineClient(urls, router_url=router_url) as client:
        await client.flush_cache()
        server = await SessionServer.for_engines(client, SessionSettings(live_check=False, affinity=affinity))
        url = await server.start()
        try:
            async with httpx.AsyncClient(base_url=url, timeout=600) as http:
                gate = asyncio.Semaphore(args.concurrency)

                async def one(e: int, gate: asyncio.Semaphore = gate) -> list[dict[str, Any]]:
                    async with gate:
                        return await session_episode(http, e, args.turns, args.max_tokens, 2000 + e)

                start = time.perf_counter()
                episodes = await asyncio.gather(*(one(e) for e in range(args.episodes)))
                seconds = time.perf_counter() - start
        finally:
            await server.stop()
    return list(episodes), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--model", default="tiny", help="tiny or smollm2")
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--engines", type=int, default=2, help="engines of the prefix-cache comparison")
    parser.add_argument("--concurrency", type=int, default=4, help="episodes in flight in the cache comparison")
    parser.add_argument(
        "--routers", choices=["auto", "smg", "none"], default="auto", help="also route through smg (auto: if installed)"
    )
    args = parser.parse_args()
    if args.quick:
        args.episodes, args.turns = 4, 6
    pin_threads(args.threads)
    from miles.testing.engine import EngineProcess

    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir(args.model, Path(tmp))
        extra = ["--device", args.device]
        engines = [EngineProcess(model, threads=args.threads, extra_args=extra) for _ in range(args.engines)]
        try:
            for engine in engines:
                engine.start()
            cost = asyncio.run(overhead(engines[0].url, args))
            cache = asyncio.run(cache_hit_rates([e.url for e in engines], args, Path(tmp)))
        finally:
            for engine in engines:
                engine.stop()
    print(
        f"\n## Session server overhead per turn ({args.model}, {args.episodes} episodes, {args.max_tokens} tokens a reply)\n"
    )
    print(
        markdown_table(
            ["turn", "prompt tokens", "session ms", "direct /generate ms", "overhead ms"],
            [
                [r["turn"], r["prompt_tokens"], f"{r['session_ms']:.1f}", f"{r['direct_ms']:.1f}", f"{r['overhead_ms']:+.1f}"]
                for r in cost["per_turn"]
            ],
        )
    )  # fmt: skip
    print(
        f"\nall turns (medians): session {cost['session_ms']:.1f} ms, direct {cost['direct_ms']:.1f} ms; of a session "
        f"turn, the server's own work (match, render, tokenise, record) {cost['server_work_ms']:.1f} ms and HTTP + JSON "
        f"{cost['http_json_ms']:.1f} ms"
    )
    print(
        f"\n## Prefix-cache hit rate of multi-turn episodes ({args.episodes} episodes x {args.turns} turns, {args.concurrency} at a time)\n"
    )
    print(
        markdown_table(
            ["routing", "engines", "hit rate (turns 2+)", "hit rate (all)", "engines per episode", "seconds"],
            [
                [r["routing"], r["engines"], f"{r['hit_rate_turn2plus']:.1%}", f"{r['hit_rate_all']:.1%}", f"{r['engines_per_episode']:.2f}", f"{r['seconds']:.1f}"]
                for r in cache
            ],
        )
    )  # fmt: skip
    path = write_result(
        "sessions",
        {"machine": machine_info(args.device), "versions": versions(), "settings": vars(args) | {"results_dir": str(args.results_dir)}, "overhead": cost, "prefix_cache": cache},
        args.results_dir,
    )  # fmt: skip
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
