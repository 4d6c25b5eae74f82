"""A Ray cluster across namespace hosts (:mod:`miles.testing.hosts`): a real multi-node Ray cluster on one
machine, each node with its own address.

:class:`RayCluster` runs ``ray start --head`` inside the first host and ``ray start --address HEAD`` inside
each other one, every node with ``--node-ip-address`` set to its host's address, its own ``--temp-dir``
under the hosts' temp dir (not ``/tmp/ray``), no dashboard, a small object store, and token
authentication with a token of its own, given to every node and driver through the environment
(:attr:`RayCluster.env`; nothing is written to ``~/.ray``). A driver (``miles train``, or a script through
:meth:`RayCluster.driver`) runs inside the head's host, where it reaches the head (the test process itself
sits outside every host, so it cannot). Since each host has its own ports, the head uses Ray's default
port, whatever else runs on the machine.

:meth:`RayCluster.stop` ends every process inside the cluster's hosts (nodes, workers, and whatever the
test started there), by PID, and removes the temp dirs. Nothing here imports ``ray``: the nodes are
started with the ``ray`` CLI of this interpreter (``python -m ray.scripts.scripts``, from
``miles-core[ray]``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType

import pytest

from miles.testing.hosts import Host, NamespaceHosts

__all__ = ["RayCluster", "ray_cluster"]

log = logging.getLogger(__name__)

NODES = """
import json, sys, time, ray
want = int(sys.argv[1])
ray.init(address=sys.argv[2], log_to_driver=False)
deadline = time.monotonic() + float(sys.argv[3])
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) >= want or time.monotonic() > deadline:
        break
    time.sleep(0.2)
print(json.dumps({n["NodeManagerAddress"]: n["NodeID"] for n in alive}))
ray.shutdown()
"""


class RayCluster:
    """A Ray cluster with one node per host: the head on ``hosts[0]``, a worker node on each other host.

    ::

        with NamespaceHosts(2) as hosts, RayCluster(hosts, resources=[{"trainer_node": 2}, {"engine_node": 1}]) as c:
            a = hosts[0]
            a.run([sys.executable, "-m", "miles", "train", "run.toml"], env={**os.environ, **c.env})

    :param hosts: the nodes' hosts, head first.
    :param num_cpus: logical CPUs of each node (one number for all, or one per host).
    :param resources: custom Ray resources of each node, one mapping per host.
    :param port: the head's GCS port (on the head's own address; hosts do not share ports).
    :param object_store_memory: bytes of each node's object store (Ray's minimum is 75 MiB).
    :param temp_dir: root of the nodes' session dirs (default: a new one in the hosts' temp dir).
    :param start_timeout: seconds each ``ray start`` and the wait for every node may take.
    :param node_local: mount a file system of its own (a small tmpfs) at :attr:`node_local_dir` in every node,
        as a machine's local scratch disk: what one node writes there, no other node sees (the rest of the
        file system stays shared by every host).
    """

    def __init__(
        self,
        hosts: Sequence[Host],
        *,
        num_cpus: float | Sequence[float] = 2,
        resources: Sequence[Mapping[str, float]] | None = None,
        port: int = 6379,
        object_store_memory: int = 100 * 2**20,
        temp_dir: str | os.PathLike[str] | None = None,
        start_timeout: float = 120.0,
        node_local: bool = False,
    ) -> None:
        if not hosts:
            raise ValueError("a Ray cluster needs at least one host")
        self.hosts = list(hosts)
        self.num_cpus = [float(num_cpus)] * len(self.hosts) if isinstance(num_cpus, int | float) else list(num_cpus)
        self.resources = [dict(r) for r in resources] if resources is not None else [{} for _ in self.hosts]
        if len(self.num_cpus) != len(self.hosts) or len(self.resources) != len(self.hosts):
            raise ValueError("num_cpus and resources need one entry per host")
        self.port = port
        self.object_store_memory = object_store_memory
        self.start_timeout = start_timeout
        self.temp_dir = Path(temp_dir) if temp_dir is not None else self.head.temp_dir / f"ray-{uuid.uuid4().hex[:6]}"
        """Root of the nodes' session dirs (one per node: ``<temp_dir>/<host>``; default: in the hosts' temp dir,
        which goes with them); short, for unix sockets."""
        self.env: dict[str, str] = {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": uuid.uuid4().hex,
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_TMPDIR": str(self.temp_dir),
            "RAY_ADDRESS": self.address,
        }
        """What a driver of this cluster needs in its environment: the auth token, ``RAY_ADDRESS`` (the nodes
        get the same without ``RAY_ADDRESS``)."""
        self.node_local = node_local
        self.node_local_dir = self.temp_dir / "node-local"
        """With ``node_local``: a path each node sees as its own (a tmpfs mounted there in the node's mount
        namespace; the driver's host and the test process see the plain, shared directory)."""
        self.node_ids: dict[str, str] = {}
        """Host name -> Ray node id, once started."""
        self.start_seconds = 0.0
        """Wall time of :meth:`start` (every ``ray start`` and the wait for every node)."""
        self._started = False

    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def address(self) -> str:
        """``HEAD_ADDRESS:PORT``: ``cluster.launcher.address`` of a run on this cluster."""
        return f"{self.head.address}:{self.port}"

    def environ(self) -> dict[str, str]:
        """This process's environment plus :attr:`env`: for a driver or a node."""
        return {**os.environ, **self.env}

    # -- start and stop ----------------------------------------------------------------------------
    def start(self) -> RayCluster:
        """Start the head, then the workers, then wait until Ray lists every node alive."""
        begin = time.monotonic()
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        self._started = True
        try:
            for i, host in enumerate(self.hosts):
                self._start_node(i, host)
            self.node_ids = self._wait_for_nodes()
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - begin
        log.info(
            "Ray cluster at %s: %s in %.1f s",
            self.address,
            ", ".join(f"{h.name}={h.address}" for h in self.hosts),
            self.start_seconds,
        )
        return self

    def _start_node(self, index: int, host: Host) -> None:
        argv = [sys.executable, "-m", "ray.scripts.scripts", "start", "--node-ip-address", host.address]
        if index == 0:
            argv += ["--head", "--port", str(self.port), "--include-dashboard=false", "--disable-usage-stats"]
        else:
            argv += ["--address", self.address]
        argv += [
            "--num-cpus",
            f"{self.num_cpus[index]:g}",
            "--resources",
            json.dumps(self.resources[index]),
            "--temp-dir",
            str(self.temp_dir / host.name),
            "--object-store-memory",
            str(self.object_store_memory),
        ]
        if self.node_local:  # `ip netns exec` gives the command a mount namespace of its own: the mount stays there
            mount = 'mkdir -p "$0" && mount -t tmpfs -o size=64m miles-node-local "$0" && exec "$@"'
            argv = ["sh", "-c", mount, str(self.node_local_dir), *argv]
        log_path = self.temp_dir / f"ray-start-{host.name}.log"
        # a file, not a pipe: the node's daemons inherit the output of `ray start`, which returns before they end
        with open(log_path, "w") as out:
            env = {k: v for k, v in self.environ().items() if k != "RAY_ADDRESS"}
            code = host.run(argv, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=self.start_timeout).returncode
        if code != 0:
            raise RuntimeError(
                f"`ray start` on host {host.name} ({host.address}) exited with {code}: "
                + log_path.read_text(errors="replace")[-3000:]
            )

    def add_node(self, host: Host, *, num_cpus: float = 2, resources: Mapping[str, float] | None = None) -> str:
        """Start a worker node on ``host`` now (a node that joins the running cluster); return its node id once
        Ray lists it alive. :meth:`stop` ends it with the others."""
        if not self._started:
            raise RuntimeError("add_node: the cluster is not running")
        self.hosts.append(host)
        self.num_cpus.append(float(num_cpus))
        self.resources.append(dict(resources or {}))
        self._start_node(len(self.hosts) - 1, host)
        self.node_ids = self._wait_for_nodes()
        return self.node_ids[host.name]

    def _wait_for_nodes(self) -> dict[str, str]:
        out = self.driver(NODES, str(len(self.hosts)), self.address, str(self.start_timeout))
        if out.returncode != 0:
            raise RuntimeError(f"could not list the Ray cluster's nodes: {out.stderr[-3000:]}")
        by_ip: dict[str, str] = json.loads(out.stdout.strip().splitlines()[-1])
        missing = [h.name for h in self.hosts if h.address not in by_ip]
        if missing:
            raise RuntimeError(f"Ray nodes of hosts {missing} did not join within {self.start_timeout:g} s: {by_ip}")
        return {h.name: by_ip[h.address] for h in self.hosts}

    def driver(self, code: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """Run ``python -c code args`` as a Ray driver inside the head's host (with :attr:`env`)."""
        return self.head.python(code, *args, env=self.environ(), timeout=timeout)

    def stop(self, grace: float = 3.0) -> None:
        """End every process inside the cluster's hosts (workers' hosts first, SIGTERM then SIGKILL) and
        remove the temp dirs. Idempotent."""
        if not self._started:
            return
        self._started = False
        for host in reversed(self.hosts):
            host.stop(grace)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """What is left of the cluster: live processes in its hosts, or anywhere whose command line names its
        temp dir (every Ray daemon's does), and the temp dir itself. Empty once :meth:`stop` is done."""
        found = [f"pid {pid} in host {h.name}" for h in self.hosts for pid in h.pids()]
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                try:
                    cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                if str(self.temp_dir) in cmdline:
                    found.append(f"pid {entry.name}: {cmdline[:200]}")
        if self.temp_dir.exists():
            found.append(f"directory {self.temp_dir}")
        return found

    def __enter__(self) -> RayCluster:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


@pytest.fixture(scope="module")
def ray_cluster(namespace_hosts: NamespaceHosts) -> Iterator[RayCluster]:
    """A three-node Ray cluster for the module's tests: the head on host ``a`` (2 CPUs, ``trainer_node: 2``),
    a worker node on host ``b`` (2 CPUs, ``engine_node: 2``) and one on host ``c`` (1 CPU, ``router_node:
    1``); host ``d`` has no node (a test may add one: :meth:`RayCluster.add_node`). Each node has its own
    :attr:`~RayCluster.node_local_dir`. Stopped (every process in the nodes' hosts ended) after the module's
    last test, which fails if anything of it is left."""
    cluster = RayCluster(
        namespace_hosts.hosts[:3],
        num_cpus=[2, 2, 1],
        resources=[{"trainer_node": 2}, {"engine_node": 2}, {"router_node": 1}],
        node_local=True,
    )
    with cluster:
        yield cluster
    left = cluster.leftovers()
    assert not left, f"the Ray cluster left {left}"
