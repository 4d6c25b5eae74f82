"""Weight sync across two hosts, against the link's own bandwidth measured in the same run.

The hosts are Linux network namespaces joined by a bridge (:mod:`miles.testing.hosts`; needs root and
iproute2): host ``a`` runs the two trainer ranks (FSDP2 over gloo, one thread each), host ``b`` one local
engine listening on b's address, so every byte a transport moves between them crosses the veth link (each
host has its own loopback: nothing can take a shortcut). Beyond loopback the engine needs a key: it gets one
made for the run, which rank 0's client sends (``MILES_API_KEY`` in both hosts' environment). The pushes are ``benchmarks/weight_sync.py``'s
(the real transport classes, a real :class:`~miles.rollout.http_client.HttpEngineClient`, an Adam-sized
change before each push, one warm-up then ``--repeats`` timed pushes, medians), run inside host a with
``MILES_NODE_ADDRESS`` set to a's address as the ``ray`` launcher sets it:

- ``broadcast``: rank 0 gathers and broadcasts over a gloo group spanning it (on a) and the engine (on b);
- ``p2p-torch``: each rank sends its own shards over ``torch.distributed`` (gloo) point to point, the
  group's store on rank 0's address;
- ``p2p-mooncake``: each rank writes its shards into the engine's receive buffer through the Mooncake
  Transfer Engine over TCP (each endpoint advertises its own host's address);
- ``disk`` / ``disk_delta``: rank 0 writes safetensors (deltas) that the engine reads: through the file
  system both hosts share, not the link (listed for comparison).

**The link**: a plain TCP socket copy from a to b (``--link-mb`` MB, sent in 1 MiB writes, the receiver
acknowledging the last byte), median of 5, in the same run: one stream, and two at once (each half the
bytes; ``p2p`` sends from both trainer ranks at once); and the one-stream copy over a's own loopback.
**GB/s** is one copy of the model's bytes over the push's time (to every engine serving it: the checks after
it are apart, **checks s**); **of link** sets it against the link's one-stream copy.

::

    sudo python -m benchmarks.weight_sync_multinode            # 83M Llama, every transport
    sudo python -m benchmarks.weight_sync_multinode --quick    # 25M, 2 repeats

Prints markdown tables and writes ``benchmarks/results/weight_sync_multinode.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    add_common_args,
    machine_info,
    markdown_table,
    median,
    pin_threads,
    versions,
    write_result,
)

TRANSPORTS = ("broadcast", "p2p-torch", "p2p-mooncake", "disk", "disk_delta")
ENGINE_PORT = 30000
"""The engine's port on host b (a fresh host: nothing else listens there)."""

SEND = """
import socket, sys, time
host, port, total = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
chunk = b"\\0" * (1 << 20)
with socket.create_connection((host, port)) as conn:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    start = time.perf_counter()
    sent = 0
    while sent < total:
        conn.sendall(chunk)
        sent += len(chunk)
    conn.recv(1)  # the receiver's acknowledgement of the last byte
    print(time.perf_counter() - start)
"""

RECEIVE = """
import socket, sys, threading
host, port, total, connections = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
server = socket.create_server((host, port), backlog=16)
print("listening", flush=True)

def drain(conn):
    buf = bytearray(1 << 20)
    got = 0
    while got < total:
        n = conn.recv_into(buf)
        if not n:
            break
        got += n
    conn.sendall(b"k")
    conn.close()

threads = []
for _ in range(connections):
    conn, _ = server.accept()
    threads.append(threading.Thread(target=drain, args=(conn,)))
    threads[-1].start()
for t in threads:
    t.join()
"""


def socket_copy_gbps(
    receiver: Any, sender: Any, address: str, megabytes: int, *, streams: int = 1, repeats: int = 5
) -> float:
    """GB/s of plain TCP copies of ``megabytes`` MB each from host ``sender`` to ``address`` on host
    ``receiver``, ``streams`` copies at once (each its own process and connection: as many as there are
    trainer ranks sending), their bytes over the slowest one's time; median of ``repeats`` after a warm-up."""
    total = megabytes << 20
    port = 29000
    server = receiver.popen(
        [sys.executable, "-c", RECEIVE, address, str(port), str(total), str((repeats + 1) * streams)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "listening"
        times = []
        for i in range(repeats + 1):
            senders = [
                sender.popen(
                    [sys.executable, "-c", SEND, address, str(port), str(total)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for _ in range(streams)
            ]
            took = []
            for proc in senders:
                out, err = proc.communicate(timeout=600)
                if proc.returncode != 0:
                    raise RuntimeError(f"socket copy failed: {err[-2000:]}")
                took.append(float(out.strip()))
            if i:
                times.append(max(took))
        server.wait(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    return streams * total / median(times) / 1e9


def inner(job_path: str) -> None:
    """Inside host a: wait for the engine on b, then the two trainer ranks push (``weight_sync._rank``)."""
    import httpx
    import torch.multiprocessing as mp

    from benchmarks.weight_sync import _rank

    job = json.loads(Path(job_path).read_text())
    url = job["engine_url"]
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"the engine at {url} did not answer within 600 s")
        time.sleep(0.5)
    mp.spawn(_rank, args=(job, [url]), nprocs=2, join=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--size", default=None, help="one of weight_sync.SIZES (default 83M; --quick 25M)")
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    parser.add_argument("--repeats", type=int, default=None, help="timed pushes per transport (default 5; --quick 2)")
    parser.add_argument("--link-mb", type=int, default=None, help="MB of each socket copy (default 1024; --quick 256)")
    parser.add_argument("--inner", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inner is not None:
        inner(args.inner)
        return {}

    from benchmarks.weight_sync import SIZES, build_model
    from miles.auth import ServiceKeys, new_key
    from miles.testing.hosts import NamespaceHosts, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:  # (run_all on a machine without namespaces: said, not a failure)
        print(f"## Weight sync across two hosts\n\nskipped: {reason}")
        write_result("weight_sync_multinode", {"skipped": reason}, args.results_dir)
        return {"skipped": reason}

    size = args.size or ("25M" if args.quick else "83M")
    if size not in SIZES:
        raise SystemExit(f"--size: unknown size {size!r} (expected one of {', '.join(SIZES)})")
    transports = args.transports.split(",")
    unknown = [t for t in transports if t not in TRANSPORTS]
    if unknown:
        raise SystemExit(f"--transports: unknown {unknown} (expected some of {', '.join(TRANSPORTS)})")
    repeats = args.repeats or (2 if args.quick else 5)
    link_mb = args.link_mb or (256 if args.quick else 1024)
    pin_threads(args.threads)

    with NamespaceHosts(2) as hosts, tempfile.TemporaryDirectory(prefix="miles-bench-mn-") as tmp:
        a, b = hosts
        work = Path(tmp)
        model = work / "model"
        params = build_model(model, SIZES[size])
        model_bytes = params * 4
        link = socket_copy_gbps(b, a, b.address, link_mb)
        link2 = socket_copy_gbps(b, a, b.address, link_mb // 2, streams=2)  # (one per trainer rank, as p2p)
        loopback = socket_copy_gbps(a, a, "127.0.0.1", link_mb)
        # the engine listens on b's address: it needs a key (issue 46), which the pushing rank 0 sends
        keys = ServiceKeys(new_key())
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false", **keys.env()}
        engine_argv = [
            sys.executable, "-m", "miles.engine", "--model", str(model), "--host", b.address,
            "--port", str(ENGINE_PORT), "--threads", str(args.threads), "--device", args.device,
            "--attention-backend", "sdpa", "--allowed-weight-dirs", tmp,
        ]  # fmt: skip
        with open(work / "engine.log", "wb") as log:
            engine = b.popen(engine_argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        job = {
            "work": str(work),
            "model": str(model),
            "engines": [1],
            "transports": transports,
            "repeats": repeats,
            "threads": args.threads,
            "port": 29500,
            "out": str(work / "results.json"),
            "engine_url": f"http://{b.address}:{ENGINE_PORT}",
        }
        (work / "job.json").write_text(json.dumps(job))
        try:
            # MILES_NODE_ADDRESS as the ray launcher sets it: the stores and Mooncake advertise a's address
            out = a.run(
                [sys.executable, "-m", "benchmarks.weight_sync_multinode", "--inner", str(work / "job.json")],
                env={**env, "MILES_NODE_ADDRESS": a.address},
                cwd=Path(__file__).resolve().parents[1],
                timeout=3600,
            )
            if out.returncode != 0:
                tail = (work / "engine.log").read_text(errors="replace")[-2000:]
                raise SystemExit(f"the pushes failed ({out.returncode}); the engine's log ends:\n{tail}")
            results = json.loads((work / "results.json").read_text())
        finally:
            engine.terminate()
            try:
                engine.wait(timeout=30)
            except subprocess.TimeoutExpired:
                engine.kill()
                engine.wait()

    rows = []
    for r in results.values():
        if "failed" in r:
            rows.append((r["transport"], "FAILED", "", "", "", r["failed"][:80]))
            continue
        gbps = model_bytes / r["push_s"] / 1e9
        over = "the shared file system" if r["transport"].startswith("disk") else "the link"
        rows.append(
            (
                r["transport"],
                f"{r['push_s']:.3f}",
                f"{gbps:.2f}",
                f"{100 * gbps / link:.1f}%",
                f"{r['checks_s']:.3f}",
                over,
            )
        )
    info = machine_info(args.device)
    print(
        f"## Weight sync across two hosts\n\n{params / 1e6:.0f}M-parameter Llama, fp32 ({model_bytes / 1e9:.2f} GB); "
        f"2 trainer ranks (FSDP2) on host a, 1 local engine on host b, {args.threads} thread(s) per process; median "
        f"of {repeats} pushes after 1 warm-up. {info['cpu']} ({info['cores']} cores).\n\n"
        f"The link (a plain TCP copy a -> b, {link_mb} MB, median of 5): **{link:.2f} GB/s** with one stream, "
        f"{link2:.2f} GB/s with two at once (one per trainer rank); the same one-stream copy over a's loopback: "
        f"{loopback:.2f} GB/s. Load average {info['loadavg'][0]:.1f} at the end.\n"
    )
    print(markdown_table(["transport", "push s", "GB/s", "of link (1 stream)", "checks s", "bytes cross"], rows))
    payload = {
        "machine": info,
        "versions": versions(["miles-p2p", "mooncake-transfer-engine-non-cuda"]),
        "size": size,
        "params": params,
        "model_bytes": model_bytes,
        "repeats": repeats,
        "link_gbps": link,
        "link_two_streams_gbps": link2,
        "loopback_gbps": loopback,
        "link_mb": link_mb,
        "results": results,
    }
    path = write_result("weight_sync_multinode", payload, args.results_dir)
    print(f"\n(written to {path})")
    return payload


if __name__ == "__main__":
    main()
