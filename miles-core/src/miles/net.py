"""TCP ports for the services of a run, chosen so that nothing else on the machine takes them first.

The kernel hands every outgoing connection a local port from its *ephemeral range*
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 on Linux by default): a port picked from that
range and released (bind to port 0, read it, close) can be taken by any connection on the machine before
the service binds it. Miles avoids the window in two ways, one per kind of service:

- a service Miles hosts itself binds first and reports what it bound: the trainers' rendezvous store and
  the weight-update groups' stores bind port 0 (:func:`host_store`); the local engine binds its socket
  before it loads the model and exits with :data:`ADDRESS_IN_USE_EXIT` at once when the port is taken;
- a port another program must be told up front (an SGLang engine, the ``smg`` router) comes from
  :func:`free_port`: outside the ephemeral range, where no outgoing connection takes ports, checked, and
  never handed out twice by this process. A service whose bind still fails (another program chose the
  same number in between) is started again on another port (:func:`address_in_use` tells the failure),
  and the launcher says so once in its log.
"""

from __future__ import annotations

import errno
import logging
import secrets
import socket
import threading
from datetime import timedelta
from typing import Any

__all__ = [
    "ADDRESS_IN_USE_EXIT",
    "address_in_use",
    "bind_or_exit",
    "bind_socket",
    "ephemeral_range",
    "free_port",
    "host_store",
    "port_candidates",
]

log = logging.getLogger(__name__)

ADDRESS_IN_USE_EXIT = 98
"""Exit code of a Miles service whose port was taken (``errno.EADDRINUSE`` on Linux): the launcher starts it
again on another port."""

_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_DEFAULT_EPHEMERAL = (32768, 60999)
_LOWEST = 20000
"""Ports below this are left alone: well-known services, and Ray's worker ports (10002-19999 by default)."""
_IN_USE_MARKERS = ("address already in use", "eaddrinuse", "errno 98", "os error 98")

_handed_out: set[tuple[str, int]] = set()
_lock = threading.Lock()


def ephemeral_range(path: str = _RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (lowest, highest); Linux's default where it cannot be read."""
    try:
        with open(path, encoding="ascii") as f:
            low, high = (int(x) for x in f.read().split()[:2])
        return low, high
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL


def port_candidates(ephemeral: tuple[int, int] | None = None) -> list[range]:
    """The port ranges :func:`free_port` picks from: 20000-65535 without the ephemeral range (empty when the
    ephemeral range covers them all)."""
    low, high = ephemeral or ephemeral_range()
    blocks = [range(_LOWEST, min(low, 65536)), range(max(high + 1, _LOWEST), 65536)]
    return [b for b in blocks if len(b)]


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no obstacle
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1", *, attempts: int = 200) -> int:
    """A TCP port for a service that will bind ``host``: random, outside the kernel's ephemeral range, free
    now, and not handed out before by this process.

    Where the ephemeral range leaves no room (it spans 20000-65535), the kernel picks one (bind port 0):
    that one can be taken again before the service binds it, so callers start the service again on
    another port when its bind fails (:func:`address_in_use`)."""
    blocks = port_candidates()
    total = sum(len(b) for b in blocks)
    with _lock:
        for _ in range(attempts if total else 0):
            index = secrets.randbelow(total)
            for block in blocks:
                if index < len(block):
                    port = block[index]
                    break
                index -= len(block)
            if (host, port) not in _handed_out and _bindable(host, port):
                _handed_out.add((host, port))
                return port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        _handed_out.add((host, port))
        return port


def address_in_use(exit_code: int | None, log_tail: str = "") -> bool:
    """Whether a service exited because its port was taken: :data:`ADDRESS_IN_USE_EXIT` (a Miles service),
    or ``EADDRINUSE`` in the last lines of its log (uvicorn in SGLang, ``smg``, torch's store)."""
    if exit_code == ADDRESS_IN_USE_EXIT:
        return True
    if exit_code is None:
        return False
    text = log_tail.lower()
    return any(marker in text for marker in _IN_USE_MARKERS)


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not listening yet: a connection is refused, not queued, until the
    server listens), as uvicorn would bind it. Raises ``OSError`` (``errno.EADDRINUSE`` when taken).

    The protocol is named (``IPPROTO_TCP``): asyncio turns Nagle's algorithm off on the connections a server
    accepts only where it does, and without that an answer written in two pieces (uvicorn's headers, then its
    body) waits for the client's delayed ACK, 40 ms a call."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def bind_or_exit(host: str, port: int, service: str) -> socket.socket:
    """:func:`bind_socket` for a service's ``main``: a taken port ends the process with
    :data:`ADDRESS_IN_USE_EXIT` (its launcher starts it again on another port), any other bind error with 1,
    each with one line naming the address."""
    try:
        return bind_socket(host, port)
    except OSError as exc:
        log.error("%s: cannot bind %s:%d: %s", service, host, port, exc.strerror or exc)
        raise SystemExit(ADDRESS_IN_USE_EXIT if exc.errno == errno.EADDRINUSE else 1) from None


def host_store(host: str, port: int = 0, *, timeout: float = 600.0) -> tuple[Any, int]:
    """A ``torch.distributed.TCPStore`` server this process hosts on ``host`` (``port`` 0: the OS picks one as
    it binds, so no other process can take it first); returns the store and the port it listens on.

    Clients join with ``TCPStore(host, port, is_master=False)``: the trainer ranks through ``env://`` with
    ``TORCHELASTIC_USE_AGENT_STORE`` set, the weight-update groups' members through the port they are told."""
    import torch.distributed as dist

    store = dist.TCPStore(
        host, port, None, True, timeout=timedelta(seconds=timeout), wait_for_workers=False, use_libuv=True
    )
    return store, int(store.port)
