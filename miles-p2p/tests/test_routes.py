"""The local engine's ``/p2p/*`` routes (this package's plugin adds them), driven by this test process as the
only trainer rank: a plan is checked against the served parameters, chunks written into a shared-memory
buffer or sent over a gloo group are committed (and only then served), a chunk that never arrives or was
never written is named."""

from __future__ import annotations

import itertools
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from miles.testing.engine import EngineProcess
from miles.transport.verify import tensor_checksum

pytestmark = pytest.mark.slow  # one engine process


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    from miles.testing.models import build_tiny_model

    torch.set_num_threads(1)
    model = build_tiny_model(tmp_path_factory.mktemp("engine-models") / "qwen2", "qwen2", seed=0)
    log = tmp_path_factory.mktemp("logs") / "p2p.log"
    extra = ["--dtype", "bfloat16", "--enable-debug-endpoints", "--attention-backend", "sdpa"]
    with EngineProcess(model, extra_args=extra, log_path=log) as engine:
        yield engine


def post(engine: EngineProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(engine.url + path, json=body, timeout=120)


def chunks_for(tensors: list[dict[str, Any]], split: int = 2) -> list[dict[str, Any]]:
    """Every tensor cut into ``split`` row blocks (as two FSDP ranks would hold them), all from rank 0."""
    out, offset = [], 0
    for t in tensors:
        rows = t["shape"][0]
        bounds = [rows * i // split for i in range(split + 1)]
        for lo, hi in itertools.pairwise(bounds):
            if hi == lo:
                continue
            shape = [hi - lo, *t["shape"][1:]]
            nbytes = 2 * int(torch.tensor(shape).prod())
            offset = -(-offset // 64) * 64
            out.append(
                {"id": len(out), "name": t["name"], "offsets": [lo] + [0] * (len(shape) - 1), "shape": shape, "src": 0,
                 "offset": offset, "nbytes": nbytes}
            )  # fmt: skip
            offset += nbytes
    return out


def new_weights(tensors: list[dict[str, Any]], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {t["name"]: torch.randn(t["shape"], generator=g).to(torch.bfloat16) for t in tensors}


def box(chunk: dict[str, Any]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(chunk["offsets"], chunk["shape"], strict=True))


def test_shared_memory_session_commits_only_complete_versions(engine: EngineProcess) -> None:
    sid = f"t-{uuid.uuid4().hex[:8]}"
    opened = post(engine, "/p2p/open_session", {"session_id": sid, "datapath": "shm"}).json()
    assert opened["success"] and opened["datapath"] == "shm" and opened["host_id"]
    tensors = opened["tensors"]
    chunks = chunks_for(tensors)
    size = chunks[-1]["offset"] + chunks[-1]["nbytes"]
    path = Path(f"/dev/shm/miles-p2p-test-{sid}")
    path.write_bytes(b"\0" * size)
    try:
        # plans that do not match the served model are refused, naming the tensor
        first = tensors[0]["name"]
        bad = [c for c in chunks if not (c["name"] == first and c["offsets"][0] == 0)]
        resp = post(engine, "/p2p/plan", {"session_id": sid, "plan_id": "p", "chunks": bad, "buffer_path": str(path)})
        assert resp.status_code == 400 and f"no chunk updates (all of) parameter {first!r}" in resp.json()["message"]
        twice = [*chunks, {**chunks[0], "id": 999, "offset": size + 64 - size % 64}]
        resp = post(engine, "/p2p/plan", {"session_id": sid, "plan_id": "p", "chunks": twice, "buffer_path": str(path)})
        assert resp.status_code == 400 and "overlap" in resp.json()["message"]
        resp = post(engine, "/p2p/plan", {"session_id": sid, "plan_id": "p", "chunks": chunks})
        assert resp.status_code == 400 and "buffer_path is required" in resp.json()["message"]
        plan = post(
            engine, "/p2p/plan", {"session_id": sid, "plan_id": "p", "chunks": chunks, "buffer_path": str(path)}
        )
        assert plan.json()["buffer_bytes"] == size

        weights = new_weights(tensors, seed=1)
        import mmap

        with open(path, "r+b") as f:
            mapped = mmap.mmap(f.fileno(), size)
        buffer = torch.frombuffer(mapped, dtype=torch.uint8)
        for c in chunks:
            part = weights[c["name"]][box(c)].contiguous()
            buffer[c["offset"] : c["offset"] + c["nbytes"]].copy_(part.reshape(-1).view(torch.uint8))
        before = post(engine, "/weights_checksum", {}).json()
        commit = {"session_id": sid, "plan_id": "p", "version": "7", "written": [c["id"] for c in chunks]}
        resp = post(engine, "/p2p/commit", commit)
        assert resp.status_code == 400 and "has not been received" in resp.json()["message"]
        assert post(engine, "/p2p/receive", {"session_id": sid, "plan_id": "p", "version": "7"}).json()["success"]
        short = {**commit, "written": [c["id"] for c in chunks[1:]]}
        resp = post(engine, "/p2p/commit", short)
        assert (
            resp.status_code == 400 and f"not sent in this push, e.g. {chunks[0]['name']!r}" in resp.json()["message"]
        )
        assert post(engine, "/weights_checksum", {}).json() == before  # nothing changed
        resp = post(engine, "/p2p/commit", commit).json()
        assert resp["success"] and resp["weight_version"] == "7" and resp["chunks"] == len(chunks)
        served = post(engine, "/weights_checksum", {}).json()
        assert served["weight_version"] == "7"
        assert served["checksums"] == {n: tensor_checksum(t) for n, t in weights.items()}
        sums = post(engine, "/p2p/checksums", {"session_id": sid, "full": True}).json()
        assert sums["full"] == served["checksums"]
        assert sums["chunks"] == {str(c["id"]): tensor_checksum(weights[c["name"]][box(c)]) for c in chunks}
        # the random-fill test mode overwrites the receive buffer too
        post(engine, "/debug/randomize_weights", {"seed": 5})
        expected = weights[chunks[0]["name"]][box(chunks[0])].contiguous().reshape(-1).view(torch.uint8)
        assert not torch.equal(buffer[: chunks[0]["nbytes"]], expected)
        del buffer
        assert post(engine, "/p2p/close_session", {"session_id": sid}).json()["success"]
        assert post(engine, "/p2p/abort", {"session_id": sid}).status_code == 400
    finally:
        path.unlink(missing_ok=True)


def test_torch_session_receives_over_a_gloo_group_and_names_a_missing_chunk(engine: EngineProcess) -> None:
    from miles.net import free_port
    from miles.transport.broadcast import make_process_group

    port = free_port()
    sid = f"t-{uuid.uuid4().hex[:8]}"
    body = {"session_id": sid, "datapath": "torch", "master_address": "127.0.0.1", "master_port": port,
            "world_size": 2, "rank": 1, "backend": "gloo", "timeout": 5}  # fmt: skip
    answer: dict[str, Any] = {}
    opener = threading.Thread(target=lambda: answer.update(post(engine, "/p2p/open_session", body).json()))
    opener.start()
    group, _store = make_process_group(
        "gloo", host="127.0.0.1", port=port, rank=0, world_size=2, timeout=5, is_master=True
    )
    opener.join()
    tensors = answer["tensors"]
    chunks = chunks_for(tensors, split=3)
    assert post(engine, "/p2p/plan", {"session_id": sid, "plan_id": "q", "chunks": chunks}).json()["success"]
    weights = new_weights(tensors, seed=2)

    def send(skip: int | None) -> None:
        works = []
        for c in chunks:
            if c["id"] != skip:
                data = weights[c["name"]][box(c)].contiguous().reshape(-1).view(torch.uint8)
                works.append((group.send([data], 1, c["id"]), data))
        for work, _ in works:
            work.wait()

    sender = threading.Thread(target=send, args=(None,))
    sender.start()
    assert post(engine, "/p2p/receive", {"session_id": sid, "plan_id": "q", "version": "a"}).json()["success"]
    sender.join()
    resp = post(engine, "/p2p/commit", {"session_id": sid, "plan_id": "q", "version": "a"}).json()
    assert resp["success"]
    served = post(engine, "/weights_checksum", {}).json()["checksums"]
    assert served == {n: tensor_checksum(t) for n, t in weights.items()}
    # a chunk never sent: the receive times out naming it, and the session is unusable afterwards
    skipped = chunks[len(chunks) // 2]
    sender = threading.Thread(target=send, args=(skipped["id"],))
    sender.start()
    resp = post(engine, "/p2p/receive", {"session_id": sid, "plan_id": "q", "version": "b"})
    sender.join()
    message = resp.json()["message"]
    assert resp.status_code == 400 and "1 chunk(s) never arrived" in message and repr(skipped["name"]) in message
    resp = post(engine, "/p2p/commit", {"session_id": sid, "plan_id": "q", "version": "b"})
    assert resp.status_code == 400 and "unusable" in resp.json()["message"]
    assert post(engine, "/weights_checksum", {}).json()["checksums"] == served  # still version a
    assert post(engine, "/p2p/close_session", {"session_id": sid}).json()["success"]
