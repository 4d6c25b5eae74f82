"""Several hosts on one machine, for multi-node tests: Linux network namespaces joined by a bridge.

:class:`NamespaceHosts` makes two or more network namespaces ("hosts" ``a``, ``b``, ``c`` ...), each with
its own loopback and one interface, ``eth0``, with an address on a private /24 (``10.213.0.1``,
``10.213.0.2`` ...). A bridge joins them; it lives in a namespace of its own, so the machine's own network
is not touched: the hosts reach each other and nothing else, and nothing outside reaches them. Each host
has its own ports and its own ``127.0.0.1``: a process on host ``b`` cannot reach a server of host ``a``
through loopback, only through ``a``'s address, as on separate machines. What the hosts share is the file
system (every path is "a path every node sees") and the PID space.

``ip netns exec`` bind-mounts ``/etc/netns/<namespace>/hosts`` over ``/etc/hosts``: each host gets one
that resolves the machine's host name to the host's own address (and ``miles-host-<name>`` to each host),
as a real machine's does. gloo, for one, binds the address the host name resolves to; with the machine's
``/etc/hosts`` (host name -> 127.0.0.1) a gloo group across two hosts could not connect.

Processes run in a host through ``ip netns exec`` (:meth:`Host.popen`, :meth:`Host.run`,
:meth:`Host.command`); every process that ends up inside a host's namespace, daemons included, belongs to
the test bed, and :meth:`NamespaceHosts.close` (the context manager, the pytest fixture) ends them all
(SIGTERM, then SIGKILL), by PID, then deletes the namespaces, which takes the bridge and the veth pairs with
them, their ``/etc/netns`` entries and the set's temp dir. Names carry the owner's PID
(``mnh<pid>-<set>-<host>``): a janitor process, started with the set in a session of its own, tears the
set down when the owner dies without closing it (SIGKILL), and every new set first sweeps the sets whose
owner is gone (:func:`sweep_stale`).

Needs Linux, root and iproute2's ``ip``; :class:`NamespacesUnavailable` says which is missing (the fixture
skips with that reason). Stdlib only: the janitor runs this file as a script.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

__all__ = [
    "Host",
    "NamespaceHosts",
    "NamespacesUnavailable",
    "namespace_hosts",
    "sweep_stale",
    "unavailable_reason",
]

log = logging.getLogger(__name__)

PREFIX = "mnh"
"""First letters of every namespace, ``/etc/netns`` entry and temp dir of the test bed."""
_NAME = re.compile(rf"^{PREFIX}(?P<pid>\d+)-(?P<set>\d+)-(?P<host>[a-z0-9]+)$")
_SETS = itertools.count()
NETNS_ETC = Path("/etc/netns")
TEMP_ROOT = Path("/tmp")
"""Where each set's temp dir goes (short paths: Ray's unix sockets live under it)."""
SUBNETS = tuple(ipaddress.IPv4Network(f"10.213.{third}.0/24") for third in range(0, 256, 8))
"""Candidate networks of the hosts, the first one not routed on this machine is taken."""
INTERFACE = "eth0"
"""The hosts' interface on the bridge."""


class NamespacesUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not Linux, not root, no ``ip``, or ``ip netns add``
    refused); the message says which."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS``; raise with its error output when it fails and ``check`` is set."""
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=60)
    if check and out.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({out.returncode}): {out.stderr.strip()}")
    return out


def _netns_names() -> list[str]:
    """The machine's named network namespaces."""
    out = _ip("netns", "list", check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def _netns_pids(netns: str) -> list[int]:
    """PIDs of the live processes in ``netns``."""
    out = _ip("netns", "pids", netns, check=False)
    return [int(p) for p in out.stdout.split() if p.isdigit()]


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def stop_processes(namespaces: Sequence[str], grace: float = 5.0) -> list[int]:
    """End every process inside ``namespaces``: SIGTERM, ``grace`` seconds, SIGKILL. Returns their PIDs.

    Only processes whose network namespace is one of the test bed's are signalled (by PID): all of them were
    started there by the test bed's owner (or are daemons those started)."""
    seen: set[int] = set()

    def current() -> list[int]:
        return [pid for ns in namespaces for pid in _netns_pids(ns)]

    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        pids = current()
        if not pids:
            break
        seen.update(pids)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_alive(pid) for pid in current()):
            time.sleep(0.05)
    left = [pid for pid in current() if _alive(pid)]
    if left:
        log.warning("processes still alive in %s after SIGKILL: %s", ", ".join(namespaces), left)
    return sorted(seen)


def teardown(prefix: str, grace: float = 5.0) -> list[str]:
    """Tear down the set named ``prefix`` (``mnh<pid>-<set>``): its processes, namespaces (the bridge and
    veth pairs go with them), ``/etc/netns`` entries and temp dir. Returns the namespaces deleted."""
    names = [n for n in _netns_names() if n.startswith(prefix + "-")]
    stop_processes(names, grace)
    for name in names:
        _ip("netns", "del", name, check=False)
    for entry in [*NETNS_ETC.glob(prefix + "-*"), TEMP_ROOT / prefix]:
        shutil.rmtree(entry, ignore_errors=True)
    return names


def _owner(prefix: str) -> int:
    match = re.fullmatch(rf"{PREFIX}(\d+)-\d+", prefix)
    assert match is not None, prefix
    return int(match.group(1))


def sweep_stale(grace: float = 2.0) -> list[str]:
    """Tear down every test-bed set whose owner process is gone (killed before it could clean up, and its
    janitor killed too). Returns the sets swept."""
    prefixes: set[str] = set()
    for name in _netns_names():
        match = _NAME.match(name)
        if match:
            prefixes.add(f"{PREFIX}{match['pid']}-{match['set']}")
    for entry in [*NETNS_ETC.glob(PREFIX + "*"), *TEMP_ROOT.glob(PREFIX + "*")]:
        if re.fullmatch(rf"{PREFIX}\d+-\d+(-[a-z0-9]+)?", entry.name):
            prefixes.add("-".join(entry.name.split("-")[:2]))
    swept = sorted(p for p in prefixes if not _alive(_owner(p)))
    for prefix in swept:
        log.warning("sweeping the test-bed hosts %s-* (owner pid %d is gone)", prefix, _owner(prefix))
        teardown(prefix, grace)
    return swept


def _routed_networks() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks this machine's own namespace has routes or addresses on (the default route aside)."""
    found: list[ipaddress.IPv4Network] = []
    for args in (("-4", "route", "show", "table", "all"), ("-4", "-o", "addr", "show")):
        for line in _ip(*args, check=False).stdout.splitlines():
            for word in line.split():
                try:
                    net = ipaddress.ip_network(word, strict=False)
                except ValueError:
                    continue
                if isinstance(net, ipaddress.IPv4Network) and net.prefixlen > 0:
                    found.append(net)
    return found


def pick_subnet() -> ipaddress.IPv4Network:
    """The first of :data:`SUBNETS` that no route or address of this machine overlaps."""
    taken = _routed_networks()
    for net in SUBNETS:
        if not any(net.overlaps(t) for t in taken):
            return net
    raise RuntimeError(f"every candidate network of the test bed ({SUBNETS[0]} ...) is routed on this machine")


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (not Linux, not root, no ``ip``), or ``None``."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (`ip netns add`)"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed: apt-get install iproute2"
    return None


class Host:
    """One host of the test bed: a network namespace with its own loopback and :attr:`address`."""

    def __init__(self, name: str, netns: str, address: str, temp_dir: Path) -> None:
        self.name = name
        """Short name (``a``, ``b`` ...)."""
        self.netns = netns
        """Its network namespace (``mnh<pid>-<set>-<name>``)."""
        self.address = address
        """Its address on the bridge (e.g. ``10.213.0.1``)."""
        self.temp_dir = temp_dir
        """The set's temp dir (:attr:`NamespaceHosts.temp_dir`: every host sees it; gone with the set)."""
        self.processes: list[subprocess.Popen[Any]] = []
        """What :meth:`popen` started (reaped by :meth:`stop`)."""

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.address})"

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host (``ip netns exec NETNS argv``; ``ip`` execs it: same PID)."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside this host (``subprocess.Popen`` keywords apply); reaped when the set closes.
        Returns once the process is in the host (``ip netns exec`` enters it a moment after it starts), so
        :meth:`pids` lists it, or once it has ended."""
        process = subprocess.Popen(self.command(argv), **kwargs)
        self.processes.append(process)
        deadline = time.monotonic() + 30
        while process.poll() is None and process.pid not in _netns_pids(self.netns):
            if time.monotonic() > deadline:
                raise RuntimeError(f"host {self.name}: pid {process.pid} did not enter {self.netns} in 30 s")
            time.sleep(0.005)
        return process

    def run(self, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` inside this host to its end (``subprocess.run`` keywords apply)."""
        return subprocess.run(self.command(argv), **kwargs)

    def python(self, code: str, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """Run ``python -c code args`` (this interpreter) inside this host; output captured as text."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("timeout", 120)
        return self.run([sys.executable, "-c", code, *args], **kwargs)

    def pids(self) -> list[int]:
        """PIDs of every live process inside this host."""
        return [pid for pid in _netns_pids(self.netns) if _alive(pid)]

    def stop(self, grace: float = 5.0) -> list[int]:
        """End every process inside this host (SIGTERM, ``grace`` seconds, SIGKILL) and reap those
        :meth:`popen` started. Returns the PIDs signalled."""
        pids = stop_processes([self.netns], grace)
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()
        return pids


class NamespaceHosts:
    """Network-namespace hosts joined by a bridge, torn down on :meth:`close` (or when the owner dies).

    ::

        with NamespaceHosts(2) as hosts:
            a, b = hosts
            server = a.popen([sys.executable, "-m", "http.server", "8000", "--bind", a.address])
            b.run(["curl", f"http://{a.address}:8000/"])

    :param count: number of hosts (2 to 26).
    :param subnet: their /24 (default: the first of :data:`SUBNETS` not routed on this machine; the bridge
        is in a namespace of its own, so sets of different processes may use the same one).
    :param janitor: start the janitor that tears the set down if this process dies first.
    """

    def __init__(self, count: int = 2, *, subnet: str | None = None, janitor: bool = True) -> None:
        if not 2 <= count <= 26:
            raise ValueError(f"count must be 2 to 26, got {count}")
        self.count = count
        self.subnet = subnet
        self.use_janitor = janitor
        self.prefix = f"{PREFIX}{os.getpid()}-{next(_SETS)}"
        """``mnh<pid>-<set>``: the start of every name of this set."""
        self.hosts: list[Host] = []
        self.temp_dir = TEMP_ROOT / self.prefix
        """A directory of this set (short path) that every host sees; removed on :meth:`close`."""
        self._janitor: subprocess.Popen[bytes] | None = None
        self._opened = False
        self._closed = False

    # -- creation ----------------------------------------------------------------------------------
    def open(self) -> NamespaceHosts:
        """Create the hosts (first sweeping stale sets). Raises :class:`NamespacesUnavailable` when
        namespaces cannot be created here; any later failure tears down what was made and raises."""
        if self._opened:
            raise RuntimeError(f"{self.prefix}: the hosts are already open")
        self._opened = True
        reason = unavailable_reason()
        if reason is not None:
            raise NamespacesUnavailable(reason)
        sweep_stale()
        if self.use_janitor:
            self._janitor = subprocess.Popen(
                [sys.executable, "-I", os.path.abspath(__file__), "janitor", self.prefix],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # a kill of the owner's process group spares it
            )
        switch = f"{self.prefix}-sw"
        made = _ip("netns", "add", switch, check=False)
        if made.returncode != 0:
            self._stop_janitor()
            raise NamespacesUnavailable(f"`ip netns add` failed: {made.stderr.strip()}")
        try:
            self._build(switch)
        except BaseException:
            self.close()
            raise
        return self

    def _build(self, switch: str) -> None:
        net = ipaddress.IPv4Network(self.subnet) if self.subnet is not None else pick_subnet()
        addresses = list(net.hosts())
        self.temp_dir.mkdir(mode=0o755, exist_ok=True)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        names = [chr(ord("a") + i) for i in range(self.count)]
        hostname = socket.gethostname()
        for i, name in enumerate(names):
            host = Host(name, f"{self.prefix}-{name}", str(addresses[i]), self.temp_dir)
            _ip("netns", "add", host.netns)
            self.hosts.append(host)
            _ip("link", "add", INTERFACE, "netns", host.netns, "type", "veth", "peer", "name", f"port-{name}",
                "netns", switch)  # fmt: skip
            _ip("-n", switch, "link", "set", f"port-{name}", "master", "br0")
            _ip("-n", switch, "link", "set", f"port-{name}", "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/{net.prefixlen}", "dev", INTERFACE)
            _ip("-n", host.netns, "link", "set", INTERFACE, "up")
        for host in self.hosts:
            etc = NETNS_ETC / host.netns
            etc.mkdir(parents=True, exist_ok=True)
            lines = ["127.0.0.1 localhost", f"{host.address} {hostname} miles-host-{host.name}"]
            lines += [f"{h.address} miles-host-{h.name}" for h in self.hosts if h is not host]
            (etc / "hosts").write_text("\n".join(lines) + "\n")
        log.info("test-bed hosts %s on %s", ", ".join(f"{h.name}={h.address}" for h in self.hosts), net)

    # -- access ------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __len__(self) -> int:
        return len(self.hosts)

    def namespaces(self) -> list[str]:
        """Every namespace of the set that exists now (the hosts' and the bridge's)."""
        return [n for n in _netns_names() if n.startswith(self.prefix + "-")]

    # -- teardown ----------------------------------------------------------------------------------
    def close(self, grace: float = 5.0) -> None:
        """End every process inside the hosts, reap the ones started here, delete the namespaces (bridge and
        veth pairs with them), their ``/etc/netns`` entries and :attr:`temp_dir`. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            stop_processes([h.netns for h in self.hosts], grace)
            for host in self.hosts:
                host.stop(grace)
            teardown(self.prefix, grace)
        finally:
            self._stop_janitor()

    def _stop_janitor(self) -> None:
        if self._janitor is None:
            return
        assert self._janitor.stdin is not None
        self._janitor.stdin.close()  # EOF: it tears down what is left (nothing) and exits
        try:
            self._janitor.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._janitor.kill()
            self._janitor.wait()
        self._janitor = None

    def __enter__(self) -> NamespaceHosts:
        return self.open()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@pytest.fixture(scope="module")
def namespace_hosts() -> Iterator[NamespaceHosts]:
    """Four hosts (``a`` to ``d``) for the module's tests, torn down after its last test; skips the tests where
    network namespaces cannot be created (with the reason)."""
    hosts = NamespaceHosts(4)
    try:
        hosts.open()
    except NamespacesUnavailable as exc:
        pytest.skip(f"no namespace hosts: {exc}")
    try:
        yield hosts
    finally:
        hosts.close()


def _janitor(prefix: str) -> None:
    """Wait for the owner to close stdin (or die), then tear down what is left of its set."""
    sys.stdin.buffer.read()
    teardown(prefix)


if __name__ == "__main__":  # the janitor: python -I hosts.py janitor PREFIX
    if len(sys.argv) == 3 and sys.argv[1] == "janitor":
        _janitor(sys.argv[2])
    else:
        sys.exit(f"usage: {sys.argv[0]} janitor PREFIX")
