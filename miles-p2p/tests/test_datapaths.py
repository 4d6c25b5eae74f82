"""The shared-memory data path's sending side on a real ``/dev/shm`` file: each chunk cast into the buffer
where the plan puts it, and, with ``checksum_written``, each chunk's checksum taken as it was written, equal to
the checksum of the source cast to the wire dtype and to that of the bytes the engine reads back."""

from __future__ import annotations

import os
import uuid

import torch

from miles.transport.verify import tensor_checksum
from miles_p2p.datapaths import ShmSender
from miles_p2p.plan import Route


def _route(rid: int, name: str, shape: tuple[int, ...], offset: int, engine: int = 0) -> Route:
    nbytes = 2 * int(torch.Size(shape).numel())
    zeros = (0,) * len(shape)
    return Route(rid, engine, 0, name, name, zeros, shape, zeros, zeros, offset, nbytes, "bfloat16")


def test_a_shm_send_checksums_each_chunk_as_written() -> None:
    routes = [_route(0, "a", (3, 5), 0), _route(1, "b", (7,), 64)]
    sources = [torch.randn(3, 5), torch.randn(7)]
    path = f"/dev/shm/miles-test-{uuid.uuid4().hex}"
    with open(path, "wb") as f:
        f.truncate(4096)
    try:
        sender = ShmSender()
        sender.prepare(routes, [{"buffer_path": path, "buffer_bytes": 4096}])
        quiet = sender.send(routes, sources)
        assert quiet.checksums == {}  # not asked: nothing checksummed
        sender.checksum_written = True
        outcome = sender.send(routes, sources)
        assert outcome.written == {0: [0, 1]}
        with open(path, "rb") as f:
            data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
        for route, source in zip(routes, sources, strict=True):
            served = data[route.offset : route.offset + route.nbytes].view(torch.bfloat16).view(route.shape)
            assert torch.equal(served, source.to(torch.bfloat16))
            assert outcome.checksums[route.content] == tensor_checksum(source, torch.bfloat16)
            assert outcome.checksums[route.content] == tensor_checksum(served)
        sender.close()
    finally:
        os.unlink(path)


def test_shares_of_a_shm_send_on_two_threads_write_and_checksum_what_one_send_does() -> None:
    """The transport splits a concurrent sender's routes over its torch threads (``P2PTransport._send_all``):
    the shares sent at once leave the same bytes and, merged, the same outcome as one send."""
    from concurrent.futures import ThreadPoolExecutor

    from miles_p2p.datapaths import Outcome

    routes = [_route(i, f"t{i}", (4, 16 + i), 256 * i) for i in range(8)]
    sources = [torch.randn(*r.shape) for r in routes]
    contents = []
    for split in (False, True):
        path = f"/dev/shm/miles-test-{uuid.uuid4().hex}"
        with open(path, "wb") as f:
            f.truncate(4096)
        try:
            sender = ShmSender()
            assert sender.concurrent
            sender.checksum_written = True
            sender.prepare(routes, [{"buffer_path": path, "buffer_bytes": 4096}])
            if split:
                with ThreadPoolExecutor(2) as pool:
                    halves = [list(range(0, 8, 2)), list(range(1, 8, 2))]
                    futures = [
                        pool.submit(sender.send, [routes[i] for i in b], [sources[i] for i in b]) for b in halves
                    ]
                    parts = [f.result() for f in futures]
                outcome = Outcome.merged(parts)
            else:
                outcome = sender.send(routes, sources)
            sender.close()
            with open(path, "rb") as f:
                contents.append((f.read(), sorted(outcome.written[0]), outcome.checksums, outcome.errors))
        finally:
            os.unlink(path)
    assert contents[0] == contents[1]
    assert contents[0][1] == list(range(8)) and len(contents[0][2]) == 8
