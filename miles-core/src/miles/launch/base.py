"""The launcher interface: start trainer ranks, engine servers and helper processes; own and reap them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType

from miles.auth import ServiceKeys
from miles.components import Component, SettingsT
from miles.errors import LaunchError
from miles.launch.engine_restarts import EngineDeathPolicy
from miles.rollout.backend import EngineLaunch

__all__ = ["Launcher", "ProcessHandle", "ProcessSpec", "ServiceNeeds"]


@dataclass
class ProcessSpec:
    """One process to start."""

    name: str
    """Shown in logs and errors (``trainer-0``, ``engine-1``); also the name of its log file."""
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables, on top of the launcher's own environment."""
    cwd: str | None = None


@dataclass(frozen=True)
class ServiceNeeds:
    """What a helper service (a reward server) asks of the machine it runs on, for a launcher that reserves
    resources (:meth:`Launcher.place_service`).

    .. versionadded:: 0.1
    """

    purpose: str
    """Who asks, as errors name it: ``the reward server of reward.functions[0] (model)``."""
    cpus: float = 1.0
    gpus: int = 0
    memory: int | None = None
    """Bytes of memory it reserves; ``None``: none reserved."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom resources its node must offer (``{reward_node = 1}``)."""


class ProcessHandle(ABC):
    """A process a launcher started (on this host or elsewhere)."""

    name: str
    """The :attr:`ProcessSpec.name` it was started with."""

    @abstractmethod
    def exit_status(self) -> int | None:
        """``None`` while it runs; then its exit code (negative: killed by that signal)."""

    @abstractmethod
    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of its output (stdout and stderr together)."""


class Launcher(Component[SettingsT], ABC):
    """Starts processes on some set of machines. Registered with ``miles_register_launchers``.

    A launcher owns every process it starts: :meth:`shutdown` terminates and reaps them all (never by
    name), and it is called on normal exit, on Ctrl-C and on failure. Use it as a context manager::

        with manager.create("launcher", settings.cluster.launcher, field="cluster.launcher", run_dir=d) as launcher:
            urls = launcher.start_engines(launches, timeout=300)
            launcher.start_trainers(trainer_specs(argv, 2))
            launcher.wait_trainers()

    :param run_dir: the run's output directory; process logs go to ``<run_dir>/logs/<name>.log``
        (default: a fresh temporary directory).
    """

    def __init__(self, settings: SettingsT, *, run_dir: str | None = None) -> None:
        super().__init__(settings)
        self.run_dir = run_dir
        self.engine_deaths = EngineDeathPolicy()
        """What :meth:`wait_trainers` does when an engine dies (the driver sets ``rollout.engine_restarts``)."""
        self.keys: ServiceKeys | None = None
        """The run's keys once the driver decided them (:func:`miles.host.train.run_keys`): handed to the
        processes started through their environment, sent by the launcher's own health checks."""

    @classmethod
    def may_span_hosts(cls, settings: SettingsT) -> bool:
        """Whether a launcher of this kind with ``settings`` may place processes on other hosts than this one
        (known before it starts: ``transport = "auto"`` asks it). Default: no."""
        return False

    @property
    def spans_hosts(self) -> bool:
        """Whether this launcher may place processes on other hosts, where their services listen on routable
        addresses (the run then needs a key, :mod:`miles.auth`): :meth:`may_span_hosts` of its settings."""
        return self.may_span_hosts(self.settings)

    def reserve(
        self, *, trainer_ranks: int, num_engines: int, colocate: bool, device: str, gpus_per_engine: int
    ) -> None:
        """The run's shape, told before anything starts: a launcher that places processes on a cluster
        reserves their resources here (the ``ray`` launcher makes its placement group). Default: nothing."""

    def nodes(self) -> list[dict[str, float]] | None:
        """The machines this launcher places processes on, each as the resources it offers (``GPU``, ``CPU``,
        custom ones), for the checks a rollout engine makes before the run starts
        (:meth:`~miles.rollout.backend.RolloutEngine.placement_problems`); ``None``: this host only (the
        engine checks what this host has).

        .. versionadded:: 0.1
        """
        return None

    def engine_devices(self, index: int, *, first: int, gpus: int) -> list[int]:
        """The CUDA device ids engine ``index`` uses, as its process numbers them. Default (every GPU of this
        host visible to every process): ``gpus`` from ``first + index x gpus``, ``first`` being where the
        engines' GPUs start (after the trainer ranks', or 0 when colocated). A launcher that shows each
        process only its own GPUs (``CUDA_VISIBLE_DEVICES``) answers ``0 .. gpus - 1``.

        .. versionadded:: 0.1
        """
        start = first + index * gpus
        return list(range(start, start + gpus))

    def engine_address(self, index: int, host: str) -> tuple[str, int]:
        """Host and port engine ``index`` will listen on (default: :func:`miles.net.free_port` on ``host``,
        this machine).

        A launcher that runs engines elsewhere answers with an address on the engine's own machine."""
        from miles.net import free_port

        return host, free_port(host)

    def unshared(self, directory: str, *, roles: Sequence[str]) -> list[str]:
        """The run's processes that would not see what trainer rank 0 writes under ``directory`` (created if
        missing), among ``roles`` (``driver``: this process; ``trainer``; ``engine``), each named with where it
        runs. Called after :meth:`reserve`, before anything starts.

        A launcher that places processes on several machines checks it (the ``ray`` launcher: a marker file
        written on rank 0's node, read on each other node); the default, every process on this host, sees
        every path.

        .. versionadded:: 0.1
        """
        return []

    def service_address(self, name: str, host: str, *, ports: int = 1) -> tuple[str, list[int]]:
        """Where helper service ``name`` (the ``router``) will listen: a host and ``ports`` free ports there
        (default: ``host`` on this machine, :func:`miles.net.free_port`). :meth:`start_process` then starts a
        process of that name where the address is.

        A launcher that places services on a cluster answers with an address on the service's node, one that
        every node reaches.

        .. versionadded:: 0.1
        """
        from miles.net import free_port

        return host, [free_port(host) for _ in range(ports)]

    def place_service(self, name: str, needs: ServiceNeeds) -> list[int] | None:
        """Reserve what helper service ``name`` (a reward server) needs before it starts, told before
        :meth:`reserve`. A launcher that places processes on a cluster gives it resources of its own (the ``ray``
        launcher: a placement group of one bundle, on a node the cluster picks, where :meth:`service_address`
        and :meth:`start_process` of that name then put it) and raises :class:`~miles.errors.LaunchError` naming
        ``needs.purpose`` and what it asked when the cluster cannot give them.

        Returns the CUDA device ids its process uses, as it numbers them (``0 .. gpus - 1``: it sees only its
        own), or ``None`` (the default): it runs on this host with every GPU visible, and the caller numbers its
        GPU (:func:`miles.host.reward_servers.server_device`).

        .. versionadded:: 0.1
        """
        return None

    @abstractmethod
    def start_process(self, spec: ProcessSpec) -> ProcessHandle:
        """Start one process (a router, a reward server ...) that the launcher then owns; a service placed by
        :meth:`service_address` under ``spec.name`` starts where its address is."""

    @abstractmethod
    def start_engines(self, launches: list[EngineLaunch], *, timeout: float, wait: bool = True) -> list[str]:
        """Start engine servers and (``wait``) wait until each answers its health path; return their base URLs.

        An engine whose port was taken before it could bind is started again on another address (its
        :attr:`~miles.rollout.backend.EngineLaunch.rebind`), so a URL is final only once it answers.
        Raises :class:`~miles.errors.LaunchError` (naming the engine, with its log tail) when one exits
        or does not answer within ``timeout`` seconds; the engines of this call are then terminated. With
        ``wait=False`` the caller starts other work (the trainer ranks load their models meanwhile) and
        calls :meth:`wait_engines`, which returns the final URLs.
        """

    @abstractmethod
    def wait_engines(self, *, timeout: float) -> list[str]:
        """Wait for the engines started with ``wait=False`` (as :meth:`start_engines` would); return the base
        URLs of every engine this launcher runs, in order."""

    @abstractmethod
    def start_trainers(self, specs: list[ProcessSpec]) -> None:
        """Start the trainer ranks (``specs[i]`` is rank ``i``, with ``RANK`` and ``WORLD_SIZE`` in ``env``).

        The launcher sets the rendezvous (``MASTER_ADDR``, ``MASTER_PORT``): a ``torch.distributed`` store it
        hosts on rank 0's host (:func:`miles.net.host_store`, bound before the ranks are told its port), which
        the ranks join as clients (``TORCHELASTIC_USE_AGENT_STORE``)."""

    def add_engine(
        self, make: Callable[[int, str, int], EngineLaunch], *, host: str, resources: dict[str, float] | None = None
    ) -> str:
        """Start one more engine while the run goes on (``miles fleet add``), without waiting for it: ``make(index,
        host, port)`` builds its launch for the address this launcher gives engine ``index`` (the next one);
        ``resources`` are custom resources its node must offer, in place of the launcher's engine defaults (a
        node that joined the cluster for it). Returns its URL; :meth:`engines_up` says when it answers.

        .. versionadded:: 0.1
        """
        raise LaunchError(f"the {type(self).__name__} launcher cannot add engines while a run goes on")

    def engines_up(self) -> bool:
        """Whether the engines started without waiting (:meth:`add_engine`) all answer, without blocking; raises
        :class:`~miles.errors.LaunchError` as :meth:`wait_engines` would when one exits first. Default: waits
        (:meth:`wait_engines`, five minutes at most).

        .. versionadded:: 0.1
        """
        self.wait_engines(timeout=300.0)
        return True

    def retire_engine(self, url: str) -> None:
        """Stop the engine at ``url`` for good (``miles fleet remove``, once no traffic goes to it): terminated
        and reaped, and not an engine death (nothing restarts it).

        .. versionadded:: 0.1
        """
        raise LaunchError(f"the {type(self).__name__} launcher cannot remove engines while a run goes on")

    @abstractmethod
    def wait_trainers(self, *, timeout: float | None = None, tick: Callable[[], None] | None = None) -> int:
        """Block until every trainer rank exits successfully; return 0.

        When a rank fails (or ``timeout`` passes), everything is shut down and
        :class:`~miles.errors.LaunchError` names the process, its exit code and its log tail. An engine that
        dies is restarted, left out or ends the run as :attr:`engine_deaths` decides.

        :param tick: called on the launcher's thread at every check of the processes (the fleet's changes:
            :class:`~miles.host.fleet.FleetController`); it must not block for long.
        """

    @abstractmethod
    def wait_until(self, condition: Callable[[], bool], *, timeout: float, waiting_for: str) -> None:
        """Supervise the trainer ranks (as :meth:`wait_trainers`) until ``condition()`` holds or every rank
        finished: a colocated run starts its engines once the ranks have loaded. A rank that fails, or
        ``timeout`` passing (:class:`~miles.errors.LaunchError` says ``waiting_for``), shuts everything down.

        .. versionadded:: 0.1
        """

    @abstractmethod
    def shutdown(self) -> None:
        """Terminate and reap everything started (idempotent)."""

    def __enter__(self) -> Launcher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()
