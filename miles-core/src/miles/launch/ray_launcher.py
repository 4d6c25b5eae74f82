"""The ``ray`` launcher: trainer ranks and engine servers on the nodes of a Ray cluster.

It joins the cluster at ``address`` (or starts a one-node cluster on 127.0.0.1 when unset) and reserves one
placement group: a bundle per trainer rank and, disaggregated, a bundle per engine (colocated, engine ``i``
shares trainer rank ``i``'s bundle). Each trainer rank and each engine is a :class:`ProcessOwner` actor
in its bundle that starts the same command line the ``local`` launcher would, on its node, and reaps it;
trainer rank 0's actor hosts the ``torch.distributed`` store (its node IP, a port bound there), and
each engine listens on its own node's IP. Every process gets its node's IP in ``MILES_NODE_ADDRESS``
(:mod:`miles.node_address`): trainer rank 0 hosts the ``broadcast`` transport's store there. The driver
(rollout manager included, in trainer rank 0) is the same code as with ``local``; helpers such as the
router run on the driver's host unless ``router_resources`` places the router on a node of the cluster
(:meth:`RayLauncher.service_address`). Each reward server (and environment server) the run declares
(:meth:`RayLauncher.place_service`) gets a placement group of its own, one bundle of the CPUs, memory and
GPUs it asks for, on a node Ray picks, and listens on that node's IP. Supervision, error messages and the
stop order are the ``local`` launcher's, with the actor and its node named; a dead actor reads as a process
killed by SIGKILL. Shutdown reaps every process through its actor, ends the actors, removes the placement
groups and leaves the cluster (stopping it when this launcher started it).

``ray`` is an optional dependency (``pip install "miles-core[ray]"``), imported only when this launcher runs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import socket
import sys
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field

from miles.components import Requirement
from miles.errors import LaunchError
from miles.launch.base import ProcessSpec, ServiceNeeds
from miles.launch.local import LocalLauncher, LocalLauncherSettings
from miles.launch.process import SupervisedProcess
from miles.node_address import NODE_ADDRESS_ENV

__all__ = ["RayLauncher", "RayLauncherSettings"]

log = logging.getLogger(__name__)


class RayLauncherSettings(LocalLauncherSettings):
    """Settings of the ``ray`` launcher (``[cluster.launcher] name = "ray"``); the ``local`` launcher's apply too."""

    address: str | None = None
    """Ray cluster to join (``auto``, ``10.0.0.1:6379``, ``ray://head:10001``); unset: start a one-node
    cluster on 127.0.0.1 for this run and stop it afterwards."""
    namespace: str = "miles"
    """Ray namespace of the run's actors (named ``<run>-<id>/<process>``)."""
    num_cpus: int | None = Field(None, ge=1)
    """CPUs of the cluster this launcher starts (unset: what the bundles need); ignored with ``address``."""
    temp_dir: str | None = None
    """Ray's session files of the cluster this launcher starts (unset: Ray's default, ``/tmp/ray``)."""
    trainer_cpus: float = Field(1.0, gt=0)
    """CPUs in each trainer rank's bundle."""
    engine_cpus: float = Field(1.0, gt=0)
    """CPUs in each engine's bundle."""
    trainer_resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources in each trainer bundle (``{trainer_node = 1}`` pins ranks to nodes offering it)."""
    engine_resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources in each engine bundle."""
    router_resources: dict[str, float] | None = None
    """Custom Ray resources of the router's bundle (``rollout.router = "smg"``): it then runs on a node that
    offers them (``{router_node = 1}``: a node of its own), listening on that node's IP. Unset: on the
    driver's host, listening on ``cluster.host`` — or, when that is loopback and the run joined a cluster
    (``address``), on the driver's node IP, so that trainer rank 0 reaches it from any node."""
    router_cpus: float = Field(0.5, gt=0)
    """CPUs in the router's bundle (with ``router_resources``)."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Placement-group strategy across nodes."""
    placement_timeout: float = Field(120.0, gt=0)
    """Seconds to wait for the cluster to grant the placement group (then the error says what was asked)."""
    call_timeout: float = Field(30.0, gt=0)
    """Seconds one call to an actor may take before it counts as not answering."""
    poll_interval: float = Field(0.5, gt=0)
    """Seconds between checks of the actors' processes and of engine health URLs."""


class RayLauncher(LocalLauncher):
    """Runs trainer ranks and engine servers as processes owned by Ray actors, placed by one placement group."""

    name = "ray"
    Settings = RayLauncherSettings
    requires = (Requirement("ray", extra="ray"),)

    def __init__(self, settings: RayLauncherSettings | None = None, *, run_dir: str | None = None) -> None:
        settings = settings if settings is not None else RayLauncherSettings()
        super().__init__(settings, run_dir=run_dir)
        self.ray_settings = settings
        if settings.address is None and "ray" not in sys.modules:
            # the one-node cluster binds 127.0.0.1: without this Ray swaps a loopback address for the host's
            # IP (read once, when ray is imported; it also keeps ray from joining other hosts' clusters)
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        assert self.run_dir is not None
        self.run_id = f"{os.path.basename(os.path.normpath(self.run_dir))}-{uuid.uuid4().hex[:8]}"
        """Prefix of this run's actor names."""
        self._started_ray = False
        self._connected = False
        """Whether this launcher called ``ray.init`` (then it calls ``ray.shutdown``)."""
        self._groups: list[Any] = []
        self._slots: dict[tuple[str, int], tuple[Any, int, dict[str, float]]] = {}
        """(role, index) -> (placement group, bundle index, actor resources)."""
        self._owners: dict[tuple[str, int], tuple[Any, dict[str, Any], str]] = {}
        """(role, index) -> (actor, its node, its name), created on first use."""
        self._services: dict[str, tuple[dict[str, float], str]] = {}
        """Service name -> (its bundle, who asks for it), from :meth:`place_service`."""
        self._device = "cpu"
        self._gpus_per_engine = 1
        self.placement: dict[str, dict[str, Any]] = {}
        """Process name -> its actor's node (also written to ``<run_dir>/logs/placement.json``)."""

    @classmethod
    def may_span_hosts(cls, settings: LocalLauncherSettings) -> bool:
        """Joining a cluster (``address``): processes may land on its other nodes, whose services listen on
        their IPs."""
        return isinstance(settings, RayLauncherSettings) and settings.address is not None

    # -- the cluster -------------------------------------------------------------------------------
    def _connect(self, cpus: float, resources: dict[str, float]) -> None:
        import ray

        if self._connected or ray.is_initialized():
            return
        s = self.ray_settings
        self._connected = True
        if s.address is not None:
            ray.init(address=s.address, namespace=s.namespace, log_to_driver=False)
            log.info("joined the Ray cluster at %s (%s)", s.address, ray.cluster_resources())
            return
        ray.init(
            num_cpus=s.num_cpus if s.num_cpus is not None else max(1, int(-(-cpus // 1))),
            resources={k: float(v) for k, v in resources.items()} or None,
            include_dashboard=False,
            namespace=s.namespace,
            log_to_driver=False,
            _node_ip_address="127.0.0.1",
            _temp_dir=s.temp_dir,
        )
        self._started_ray = True
        log.info("started a one-node Ray cluster on 127.0.0.1 (%s)", ray.cluster_resources())

    def reserve(
        self, *, trainer_ranks: int, num_engines: int, colocate: bool, device: str, gpus_per_engine: int
    ) -> None:
        """One placement group: a bundle per trainer rank, then (disaggregated) one per engine."""
        s = self.ray_settings
        self._device = device
        self._gpus_per_engine = gpus_per_engine
        cuda = device == "cuda"
        trainer = {"CPU": s.trainer_cpus, **s.trainer_resources, **({"GPU": 1.0} if cuda else {})}
        engine = {"CPU": s.engine_cpus, **s.engine_resources, **({"GPU": float(gpus_per_engine)} if cuda else {})}
        bundles: list[dict[str, float]] = []
        slots: dict[tuple[str, int], tuple[int, dict[str, float]]] = {}
        if colocate and trainer_ranks and num_engines:
            if num_engines > trainer_ranks or (cuda and gpus_per_engine != 1):
                raise LaunchError(
                    f"cluster.colocate with the ray launcher: engine i shares trainer rank i's bundle, so "
                    f"cluster.num_engines ({num_engines}) must be <= cluster.trainer_ranks ({trainer_ranks})"
                    + (f" and each engine must use 1 GPU (it uses {gpus_per_engine})" if cuda else "")
                )
            for rank in range(trainer_ranks):
                shared = dict(trainer)
                if rank < num_engines:
                    for key, value in engine.items():
                        shared[key] = value if key == "GPU" else shared.get(key, 0.0) + value
                bundles.append(shared)
                # the trainer rank and its engine each take half of the bundle's GPU: the same device
                slots["trainer", rank] = (rank, {**trainer, **({"GPU": 0.5} if cuda and rank < num_engines else {})})
                if rank < num_engines:
                    slots["engine", rank] = (rank, {**engine, **({"GPU": 0.5} if cuda else {})})
        else:
            for rank in range(trainer_ranks):
                slots["trainer", rank] = (len(bundles), trainer)
                bundles.append(dict(trainer))
            for i in range(num_engines):
                slots["engine", i] = (len(bundles), engine)
                bundles.append(dict(engine))
        self._place(bundles, slots)

    def _place(
        self,
        bundles: list[dict[str, float]],
        slots: dict[tuple[str, int], tuple[int, dict[str, float]]],
        *,
        purpose: str | None = None,
    ) -> None:
        """Connect to the cluster and wait for one placement group of ``bundles``; record each slot's bundle.
        ``purpose``: the one bundle of a declared service, refused at once (naming ``purpose``) when no node of
        the cluster offers it."""
        import ray
        from ray.exceptions import GetTimeoutError
        from ray.util.placement_group import placement_group, remove_placement_group

        if not bundles:
            return
        s = self.ray_settings
        custom: dict[str, float] = {}
        # a cluster this launcher starts has room for the services declared but not placed yet, too
        pending = [b for n, (b, _) in self._services.items() if (n, 0) not in slots and (n, 0) not in self._slots]
        for b in [*bundles, *pending]:
            for key, value in b.items():
                if key not in ("CPU", "GPU", "memory"):
                    custom[key] = custom.get(key, 0.0) + value
        self._connect(sum(b.get("CPU", 0.0) for b in [*bundles, *pending]), custom)
        if purpose is not None:
            _refuse_infeasible(bundles[0], purpose)
        group = placement_group(bundles, strategy=s.strategy, name=f"{self.run_id}/placement-{len(self._groups)}")
        try:
            ray.get(group.ready(), timeout=s.placement_timeout)
        except GetTimeoutError:
            remove_placement_group(group)
            if purpose is not None:
                raise LaunchError(
                    f"{purpose}: the Ray cluster did not grant the bundle it asks for ({_describe(bundles[0])}) "
                    f"within {s.placement_timeout:g} s (cluster.launcher.placement_timeout); it has "
                    f"{_describe(ray.available_resources())} available"
                ) from None
            raise LaunchError(
                f"the Ray cluster did not grant {len(bundles)} bundles {bundles} (strategy {s.strategy}) within "
                f"{s.placement_timeout:g} s; it has {ray.available_resources()} available "
                "(see cluster.launcher.trainer_cpus / engine_cpus / trainer_resources / engine_resources)"
            ) from None
        self._groups.append(group)
        for slot, (index, resources) in slots.items():
            self._slots[slot] = (group, index, resources)
        log.info("placement group %s: %d bundles %s", group.id.hex()[:12], len(bundles), bundles)

    def _owner(self, role: str, index: int) -> tuple[Any, dict[str, Any], str]:
        """The actor of engine / trainer rank ``index``, created in its bundle on first use."""
        if (role, index) in self._owners:
            return self._owners[role, index]
        if (role, index) not in self._slots:  # not reserved (``miles generate`` starts engines only): one bundle
            alone = self._service_bundle(role) or self._alone_bundle(role)
            purpose = self._services[role][1] if role in self._services else None
            self._place([alone], {(role, index): (0, alone)}, purpose=purpose)
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from miles.launch.ray_owner import ProcessOwner

        group, bundle, resources = self._slots[role, index]
        name = f"{self.run_id}/{role}-{index}"
        custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU", "memory")}
        actor = (
            ray.remote(ProcessOwner)
            .options(
                name=name,
                num_cpus=resources.get("CPU", 0.0),
                num_gpus=resources.get("GPU", 0.0),
                memory=resources.get("memory"),
                resources=custom or None,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=bundle
                ),
            )
            .remote(self.log_dir, self.settings.die_with_parent)
        )
        try:
            node = ray.get(actor.node.remote(), timeout=self.ray_settings.placement_timeout)
        except Exception as exc:
            ray.kill(actor, no_restart=True)
            raise LaunchError(f"Ray actor {name!r} did not start: {exc}") from exc
        self._owners[role, index] = (actor, node, name)
        return self._owners[role, index]

    def _place_engine(self, index: int, resources: dict[str, float] | None) -> None:
        """Engine ``index``, one more while the run goes on, in a placement group of its own: ``engine_cpus``
        (and its GPUs) with ``resources`` in place of ``engine_resources`` (a node that joined the cluster for
        it); its group goes when the engine is retired."""
        if resources is None or ("engine", index) in self._slots:
            return
        s = self.ray_settings
        bundle = {
            "CPU": s.engine_cpus,
            **resources,
            **({"GPU": float(self._gpus_per_engine)} if self._device == "cuda" else {}),
        }
        self._place([bundle], {("engine", index): (0, bundle)})

    def retire_engine(self, url: str) -> None:
        """Stop the engine (through its actor), then give its placement group back when it held only that
        engine (one added while the run went on)."""
        from ray.util.placement_group import remove_placement_group

        index = self.engine_urls.index(url.rstrip("/"))
        super().retire_engine(url)
        slot = self._slots.get(("engine", index))
        if slot is not None and sum(1 for g, _, _ in self._slots.values() if g is slot[0]) == 1:
            remove_placement_group(slot[0])
            self._groups.remove(slot[0])
            del self._slots["engine", index]

    def _alone_bundle(self, role: str) -> dict[str, float]:
        """The bundle of one engine or trainer rank placed on its own (not in the run's placement group)."""
        s = self.ray_settings
        if role == "engine":
            gpus = {"GPU": float(self._gpus_per_engine)} if self._device == "cuda" else {}
            return {"CPU": s.engine_cpus, **s.engine_resources, **gpus}
        return {"CPU": s.trainer_cpus, **s.trainer_resources, **({"GPU": 1.0} if self._device == "cuda" else {})}

    def _service_bundle(self, name: str) -> dict[str, float] | None:
        """The bundle of helper service ``name`` when it is placed on a node (the router with
        ``router_resources``, a service declared with :meth:`place_service`), else ``None`` (it runs on the
        driver's host)."""
        s = self.ray_settings
        if name == "router" and s.router_resources is not None:
            return {"CPU": s.router_cpus, **s.router_resources}
        if name in self._services:
            return self._services[name][0]
        return None

    def place_service(self, name: str, needs: ServiceNeeds) -> list[int] | None:
        """Service ``name`` gets a placement group of its own: one bundle of ``needs.cpus`` CPUs, its memory and
        GPUs when it asks for them, and its custom resources, placed when its address is asked
        (:meth:`service_address`: refused at once, naming ``needs.purpose``, when no node of the cluster offers
        it; after ``placement_timeout`` when the cluster stays too busy); its process then starts in an actor
        there. Its GPUs are the only ones its process sees: ``0 .. gpus - 1``."""
        bundle = {"CPU": float(needs.cpus), **{k: float(v) for k, v in needs.resources.items()}}
        if needs.memory is not None:
            bundle["memory"] = float(needs.memory)
        if needs.gpus:
            bundle["GPU"] = float(needs.gpus)
        self._services[name] = (bundle, needs.purpose)
        return list(range(needs.gpus))

    def _driver_address(self, host: str) -> str:
        """Where a service on the driver's host listens: ``host``, unless it is loopback while the run joined a
        cluster (``address``): then the driver's node IP, which the other nodes reach."""
        import ray

        if self.ray_settings.address is None or not host.startswith("127."):
            return host
        self._connect(0.0, {})
        ip = str(ray.util.get_node_ip_address())
        if ip != host:
            log.info("services on the driver's host listen on its node IP %s (cluster.host is %s)", ip, host)
        return ip

    # -- what the nodes offer and share -------------------------------------------------------------
    def nodes(self) -> list[dict[str, float]] | None:
        """The alive nodes' resources, of a cluster this run joined (``address``); ``None`` for the one-node
        cluster this launcher starts on this host."""
        import ray

        if self.ray_settings.address is None:
            return None
        self._connect(0.0, {})
        return [
            {str(k): float(v) for k, v in node.get("Resources", {}).items()}
            for node in ray.nodes()
            if node.get("Alive")
        ]

    def engine_devices(self, index: int, *, first: int, gpus: int) -> list[int]:
        """Each engine's process sees only its actor's GPUs (Ray sets ``CUDA_VISIBLE_DEVICES``): ``0 .. gpus - 1``,
        wherever the engine lands."""
        return list(range(gpus))

    def unshared(self, directory: str, *, roles: Sequence[str]) -> list[str]:
        """Trainer rank 0's actor writes a marker file under ``directory``; the driver (role ``driver``) and
        the actor of every other reserved process of ``roles`` read it where they run. A one-node cluster this
        launcher started (no ``address``) shares every path."""
        import ray

        if self.ray_settings.address is None or ("trainer", 0) not in self._slots:
            return []
        timeout = self.ray_settings.call_timeout
        writer, node0, _ = self._owner("trainer", 0)
        token = secrets.token_hex(8)
        marker = str(ray.get(writer.write_marker.remote(os.path.abspath(directory), token), timeout=timeout))
        if marker.startswith("error: "):
            return [f"trainer rank 0 (node {node0['ip']}) cannot write there ({marker[7:]})"]
        missing: list[str] = []
        try:
            if "driver" in roles:
                try:
                    with open(marker) as fh:
                        seen: str | None = fh.read()
                except OSError:
                    seen = None
                if seen != token:
                    missing.append(f"the driver (miles train, on {socket.gethostname()})")
            for role, index in sorted(self._slots):
                if role not in roles or (role, index) == ("trainer", 0):
                    continue
                actor, node, _ = self._owner(role, index)
                if ray.get(actor.read_marker.remote(marker), timeout=timeout) != token:
                    who = f"trainer rank {index}" if role == "trainer" else f"{role}-{index}"
                    missing.append(f"{who} (node {node['ip']}, {node['hostname']})")
        finally:
            ray.get(writer.remove_marker.remote(marker), timeout=timeout)
        return missing

    # -- starting ----------------------------------------------------------------------------------
    def service_address(self, name: str, host: str, *, ports: int = 1) -> tuple[str, list[int]]:
        """A service placed on a node (:meth:`_service_bundle`) listens on that node's IP; others on the
        driver's host (:meth:`_driver_address`). A process of that name that exited (its port was taken) is
        released first, so its actor gives the bundle back."""
        import ray

        from miles.net import free_port

        for process in self.processes:
            if process.name == name and not process.reaped and process.exit_status() is not None:
                process.reap()
        if self._service_bundle(name) is None:
            address = self._driver_address(host)
            return address, [free_port(address) for _ in range(ports)]
        actor, node, _ = self._owner(name, 0)
        ip = str(node["ip"])
        timeout = self.ray_settings.call_timeout
        return ip, [int(ray.get(actor.free_port.remote(ip), timeout=timeout)) for _ in range(ports)]

    def start_process(self, spec: ProcessSpec) -> SupervisedProcess:
        """A service placed on a node (:meth:`service_address`) starts in an actor in its bundle there (one that
        exited, started again, is reaped first so that its actor gives the bundle back); others on this host."""
        if self._service_bundle(spec.name) is not None and (spec.name, 0) in self._slots:
            for process in self.processes:
                if process.name == spec.name and not process.reaped and process.exit_status() is not None:
                    process.reap()
            return self._start_member(spec, spec.name, 0)
        return super().start_process(spec)

    def engine_address(self, index: int, host: str) -> tuple[str, int]:
        """Engine ``index`` listens on its actor's node IP, on a port free there."""
        import ray

        actor, node, _ = self._owner("engine", index)
        ip = str(node["ip"])
        return ip, int(ray.get(actor.free_port.remote(ip), timeout=self.ray_settings.call_timeout))

    def start_trainers(self, specs: list[ProcessSpec]) -> None:
        """Rank 0's actor hosts the rendezvous store on its node; ranks count per node for ``LOCAL_RANK``."""
        import ray

        if not specs:
            raise LaunchError("start_trainers: no trainer ranks")
        owners = [self._owner("trainer", rank) for rank in range(len(specs))]
        actor0, node0, _ = owners[0]
        addr = str(node0["ip"])
        rendezvous = dict(ray.get(actor0.host_rendezvous.remote(addr), timeout=self.ray_settings.call_timeout))
        per_node: dict[str, int] = {}
        local_ranks = []
        for _, node, _ in owners:
            local_ranks.append(per_node.get(node["node_id"], 0))
            per_node[node["node_id"]] = local_ranks[-1] + 1
        for rank, spec in enumerate(specs):
            node = owners[rank][1]
            spec.env.update(rendezvous)
            if self._device == "cuda":  # the actor's one GPU is the only one its process sees
                spec.env.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
            else:
                spec.env.update(LOCAL_RANK=str(local_ranks[rank]), LOCAL_WORLD_SIZE=str(per_node[node["node_id"]]))
        log.info("trainer rendezvous at %s:%s (rank 0's node)", addr, rendezvous["MASTER_PORT"])
        super().start_trainers(specs)

    def _start_member(self, spec: ProcessSpec, role: str, index: int) -> SupervisedProcess:
        from miles.launch import cleanup
        from miles.launch.ray_owner import RayProcess

        if self._closed:
            raise LaunchError(f"cannot start {spec.name!r}: the launcher was shut down")
        actor, node, name = self._owner(role, index)
        # where other nodes reach what the process serves (broadcast's store in trainer rank 0 ...): its node's IP
        spec = dataclasses.replace(spec, env={**spec.env, NODE_ADDRESS_ENV: str(node["ip"])})
        os.makedirs(self.log_dir, exist_ok=True)
        cleanup.track(self, handle_signals=self.settings.handle_signals)
        process = RayProcess(spec, actor, node, name, self.log_dir, self.ray_settings.call_timeout)
        del self._owners[role, index]  # the process owns the actor now (a restart gets a fresh one)
        if process.died is not None:
            raise LaunchError(f"{process.where()} died before starting {spec.name}: {process.died}")
        self.processes.append(process)
        self.placement[spec.name] = {**node, "actor": name, "process_pid": process.pid}
        with open(os.path.join(self.log_dir, "placement.json"), "w") as fh:
            json.dump(self.placement, fh, indent=1)
        log.info("started %s (pid %d) in %s", spec.name, process.pid, process.where())
        return process

    # -- errors and stopping -----------------------------------------------------------------------
    def _failure(self, process: SupervisedProcess | None, what: str, code: int | None) -> LaunchError:
        from miles.launch.ray_owner import RayProcess

        if isinstance(process, RayProcess):
            # "<what>: its Ray actor ... on node ... died (...)[; after it, ...; all other processes were terminated]"
            head, sep, tail = what.partition("; ")
            tail = sep + tail
            where = process.where()
            head = f"{head}: its {where} died ({process.died})" if process.died is not None else f"{head} (in {where})"
            what = head + tail
        return super()._failure(process, what, code)

    def shutdown(self) -> None:
        if self._stopped or self._stopping:
            return
        try:
            super().shutdown()
        finally:
            self._release_cluster()

    def _release_cluster(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            return
        for actor, _, _ in self._owners.values():
            ray.kill(actor, no_restart=True)
        self._owners.clear()
        for process in self.processes:
            release = getattr(process, "release", None)
            if release is not None:
                release()
        for group in self._groups:
            remove_placement_group(group)
        self._groups.clear()
        self._slots.clear()
        if not self._connected:  # the caller's Ray session: left as it was
            return
        ray.shutdown()
        self._connected = False
        if self._started_ray:
            log.info("stopped the Ray cluster this run started")


def _describe(resources: dict[str, float]) -> str:
    """``CPU 1, memory 512 MiB, GPU 1, reward_node 1`` (memory in MiB, or GiB from 10 GiB)."""
    parts = []
    for key, value in resources.items():
        if key == "memory":
            mib = value / 2**20
            parts.append(f"memory {mib / 1024:.0f} GiB" if mib >= 10240 else f"memory {mib:.0f} MiB")
        elif not key.startswith(("node:", "accelerator_type:")) and not key.endswith("object_store_memory"):
            parts.append(f"{key} {value:g}")
    return ", ".join(parts) or "nothing"


def _refuse_infeasible(bundle: dict[str, float], purpose: str) -> None:
    """Raise :class:`LaunchError` naming ``purpose`` when no alive node of the cluster offers ``bundle`` (Ray
    would wait forever)."""
    import ray

    nodes = [node for node in ray.nodes() if node.get("Alive")]
    if any(all(float(node.get("Resources", {}).get(k, 0.0)) >= v for k, v in bundle.items()) for node in nodes):
        return
    offer = "; ".join(f"node {n.get('NodeManagerAddress')}: {_describe(n.get('Resources', {}))}" for n in nodes)
    raise LaunchError(
        f"{purpose}: no node of the Ray cluster offers the bundle it asks for ({_describe(bundle)}); {offer}"
    )
