"""The Ray actor that owns one trainer rank or engine server on its node, and the driver's handle to it.

The actor starts its process with the ``local`` launcher's :class:`~miles.launch.process.LocalProcess` (its
own session, its log file, ``PR_SET_PDEATHSIG``) from a thread that lives as long as the actor, so a
killed actor takes its process down with it; a live one signals and reaps its process group on request.
Imported only when the ``ray`` launcher runs (it imports ``ray``).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from miles.launch.base import ProcessSpec
from miles.launch.process import LocalProcess, SupervisedProcess
from miles.launch.rendezvous import RendezvousStore
from miles.net import free_port

__all__ = ["ProcessOwner", "RayProcess"]


class ProcessOwner:
    """Actor body: owns at most one process at a time, started from a long-lived thread of the actor."""

    def __init__(self, log_dir: str, die_with_parent: bool) -> None:
        self.log_dir = log_dir
        self.die_with_parent = die_with_parent
        self.process: LocalProcess | None = None
        self.rendezvous: RendezvousStore | None = None
        # PR_SET_PDEATHSIG fires when the *thread* that forked the child ends: fork from one that lives on
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-owner")

    def node(self) -> dict[str, Any]:
        """Where this actor runs: Ray node id, node IP, host name, actor pid, assigned GPU ids, the resources Ray
        assigned it and its placement group's id."""
        context = ray.get_runtime_context()
        return {
            "node_id": context.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
            "resources": {str(k): float(v) for k, v in context.get_assigned_resources().items()},
            "placement_group": context.get_placement_group_id(),
        }

    def free_port(self, host: str) -> int:
        """A port for a service on this node (:func:`miles.net.free_port`)."""
        return free_port(host)

    def host_rendezvous(self, host: str) -> dict[str, str]:
        """Host the trainer ranks' ``torch.distributed`` store on this node, for as long as this actor lives;
        return the ranks' rendezvous variables."""
        self.rendezvous = RendezvousStore(host)
        return self.rendezvous.env()

    def write_marker(self, directory: str, token: str) -> str:
        """Create ``directory`` (with parents) and a marker file holding ``token`` in it; return its path, or
        ``error: ...`` when this node cannot write there."""
        try:
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, f".miles-shared-{token}")
            with open(path, "w") as fh:
                fh.write(token)
        except OSError as exc:
            return f"error: {exc}"
        return path

    def read_marker(self, path: str) -> str | None:
        """What the marker file at ``path`` holds as this node sees it (``None``: it is not there)."""
        try:
            with open(path) as fh:
                return fh.read()
        except OSError:
            return None

    def remove_marker(self, path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass

    def start(self, spec: ProcessSpec, driver_python: str) -> int:
        """Start ``spec`` here (the driver's Python replaced by this node's; this actor's GPUs visible)."""
        if self.process is not None and not self.process.reaped:
            raise RuntimeError(f"{self.process.name} is still running in this actor")
        argv = list(spec.argv)
        if argv and argv[0] == driver_python:
            argv[0] = sys.executable
        env = dict(spec.env)
        gpus = [str(g) for g in ray.get_gpu_ids()]
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        local = ProcessSpec(name=spec.name, argv=argv, env=env, cwd=spec.cwd)
        os.makedirs(self.log_dir, exist_ok=True)
        self.process = self._spawner.submit(
            LocalProcess, local, self.log_dir, die_with_parent=self.die_with_parent
        ).result()
        return self.process.pid

    def exit_status(self) -> int | None:
        return None if self.process is None else self.process.exit_status()

    def log_tail(self, lines: int) -> str:
        return "" if self.process is None else self.process.log_tail(lines)

    def signal_group(self, sig: int) -> None:
        if self.process is not None:
            self.process.signal_group(sig)

    def reap(self, timeout: float | None) -> int | None:
        return None if self.process is None else self.process.reap(timeout=timeout)


class RayProcess(SupervisedProcess):
    """The driver's handle to a process owned by a :class:`ProcessOwner` actor on some node.

    A dead actor (killed, its node lost) reads as a process killed by SIGKILL; :attr:`died` says why."""

    def __init__(
        self, spec: ProcessSpec, actor: Any, node: dict[str, Any], actor_name: str, log_dir: str, call_timeout: float
    ) -> None:
        self.name = spec.name
        self.spec = spec
        self.actor = actor
        self.actor_name = actor_name
        self.node = node
        """What :meth:`ProcessOwner.node` said (node id, IP, host name, actor pid)."""
        self.log_path = os.path.join(log_dir, f"{spec.name}.log")
        self.call_timeout = call_timeout
        self.died: str | None = None
        """Why the actor is gone, once it is (Ray's error, first line)."""
        self._code: int | None = None
        self._last_tail = ""
        self.pid = int(self._call(actor.start.remote(spec, sys.executable)) or 0)
        self.started_at = time.monotonic()

    def where(self) -> str:
        """``Ray actor engine-0 (node 10.0.0.2, id 3f2a...) `` for messages."""
        return (
            f"Ray actor {self.actor_name!r} on node {self.node.get('ip')} "
            f"({self.node.get('hostname')}, node id {str(self.node.get('node_id'))[:16]})"
        )

    def _call(self, ref: Any, timeout: float | None = None) -> Any:
        """``ray.get`` one call; a dead actor marks this process killed (SIGKILL) and returns ``None``."""
        try:
            return ray.get(ref, timeout=self.call_timeout if timeout is None else timeout)
        except RayActorError as exc:
            if self.died is None:
                self.died = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
                self._code = -int(signal.SIGKILL)
            return None

    @property
    def reaped(self) -> bool:
        return self.actor is None  # released: its process reaped (or its actor found dead) and the actor ended

    def exit_status(self) -> int | None:
        if self._code is not None:
            return self._code
        try:
            code = self._call(self.actor.exit_status.remote())
        except GetTimeoutError:
            return None
        return self._code if self.died is not None else code

    def log_tail(self, lines: int = 40) -> str:
        if self.died is None and self.actor is not None:
            try:
                tail = self._call(self.actor.log_tail.remote(lines))
            except GetTimeoutError:
                tail = None
            if tail is not None:
                self._last_tail = tail
                return str(tail)
        try:  # the actor is gone: its log, where this host sees it (one host, or a shared run directory)
            with open(self.log_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - 256 * lines))
                return "\n".join(fh.read().decode("utf-8", errors="replace").splitlines()[-lines:])
        except OSError:
            return self._last_tail or f"(its log {self.log_path} is on node {self.node.get('ip')})"

    def signal_group(self, sig: int) -> None:
        if self.died is None and self.actor is not None:
            self.actor.signal_group.remote(sig)

    def reap(self, timeout: float | None = None) -> int | None:
        if self._code is None:
            wait = None if timeout is None else timeout + self.call_timeout
            try:
                code = self._call(self.actor.reap.remote(timeout), timeout=wait)
            except GetTimeoutError:
                return None
            if code is None and self.died is None:
                return None
            if self.died is None:
                self._code = int(code)
        self.release()
        return self._code

    def release(self) -> None:
        """End the actor (its process is reaped, or the actor is already dead)."""
        if self.actor is not None:
            try:
                ray.kill(self.actor, no_restart=True)
            except (RayActorError, ValueError):
                pass
            self.actor = None
        if self._code is None:
            self._code = -int(signal.SIGKILL)
