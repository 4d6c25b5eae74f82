"""Ports for the services of a run (miles.net): outside the ephemeral range, bound before they are told."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from miles import net
from miles.net import ADDRESS_IN_USE_EXIT, address_in_use, bind_socket, ephemeral_range, free_port, port_candidates


def test_free_port_is_outside_the_ephemeral_range_and_bindable() -> None:
    low, high = ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50  # never handed out twice
    for port in ports:
        assert not low <= port <= high and port >= 20000
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[0]))


def test_ephemeral_range_is_read_from_the_kernel_file(tmp_path: Path) -> None:
    path = tmp_path / "range"
    path.write_text("40000\t50000\n")
    assert ephemeral_range(str(path)) == (40000, 50000)
    assert ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)
    assert port_candidates((40000, 50000)) == [range(20000, 40000), range(50001, 65536)]
    assert port_candidates((1024, 65535)) == []


def test_free_port_skips_a_taken_port(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        monkeypatch.setattr(net, "port_candidates", lambda: [range(taken, taken + 1), range(taken + 1, taken + 2)])
        net._handed_out.discard(("127.0.0.1", taken + 1))
        assert free_port() != taken


def test_free_port_falls_back_to_the_kernel_when_the_range_leaves_no_room(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(net, "port_candidates", list)
    port = free_port()
    assert 0 < port < 65536


def test_address_in_use_reads_exit_codes_and_logs() -> None:
    assert address_in_use(ADDRESS_IN_USE_EXIT)
    assert not address_in_use(None, "address already in use")  # still running
    uvicorn = (
        "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 38519): address already in use"
    )
    assert address_in_use(1, uvicorn)
    assert address_in_use(1, "Error: Address already in use (os error 98)")  # Rust (smg)
    assert not address_in_use(1, "ValueError: no model")


def test_a_service_exits_with_the_address_in_use_code_when_its_port_is_taken() -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(OSError):
            bind_socket("127.0.0.1", port)
        code = f"from miles.net import bind_or_exit; bind_or_exit('127.0.0.1', {port}, 'probe')"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == ADDRESS_IN_USE_EXIT
    assert f"probe: cannot bind 127.0.0.1:{port}" in out.stderr


def test_a_server_on_a_bound_socket_answers_without_nagles_delay() -> None:
    """asyncio turns Nagle's algorithm off (``TCP_NODELAY``) only on sockets whose protocol says TCP; a
    socket made as ``socket(AF_INET, SOCK_STREAM)`` says 0, and then every answer written in two pieces
    (uvicorn writes the headers and the body apart) waited for the client's delayed ACK: 40 ms for each
    control call to a local engine. The connections a server accepts on :func:`bind_socket` have it off."""
    import asyncio

    async def main() -> int:
        sock = bind_socket("127.0.0.1", 0)
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            conn = writer.get_extra_info("socket")
            accepted.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
            try:
                return await asyncio.wait_for(accepted, 10)
            finally:
                writer.close()

    assert asyncio.run(main()) != 0
