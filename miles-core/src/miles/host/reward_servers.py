"""The servers a run's rewards need (reward models, judges), started through the launcher as processes of
their own (:class:`~miles.rewards.base.RewardServer`).

:func:`declare_servers` tells the launcher what each needs (:meth:`~miles.launch.base.Launcher.place_service`,
before it reserves the run's resources: the ``ray`` launcher gives each a placement group of its own);
:func:`start_reward_servers` starts them before the trainer ranks, and writes each one's URL into its reward's
``url`` setting in the settings the ranks read (``settings.json``), so trainer rank 0's reward talks to it;
:meth:`RewardServers.wait` returns once each answers its health path (before the engines are announced to
rank 0), or raises :class:`~miles.errors.LaunchError` naming the server with its log tail.

Placement on CUDA, with the ``local`` launcher's numbering (every GPU visible to every process): a server takes
the next GPU after the trainer ranks' and the engines' (after the trainer ranks' when the engines are
colocated), one per server; ``colocate = true`` puts it on GPU 0 with trainer rank 0. A launcher that places
the server itself (``ray``) reserves its GPU in its bundle, where its process sees it as device 0.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from miles.components import ComponentKind
from miles.compose import Resolved
from miles.errors import LaunchError, SettingsError

if TYPE_CHECKING:
    from miles.auth import ServiceKeys
    from miles.compose import Run
    from miles.launch.base import Launcher, ProcessHandle, ProcessSpec, ServiceNeeds
    from miles.rewards.base import RewardServer
    from miles.settings.model import MilesSettings

__all__ = ["DeclaredServer", "RewardServers", "declare_servers", "server_device", "start_reward_servers"]

log = logging.getLogger(__name__)


@dataclass
class DeclaredServer:
    """A server the run will start, as :func:`declare_servers` told the launcher."""

    field: str
    """The setting it serves: ``reward.functions[0]``, or ``rollout.function`` (an environment server)."""
    name: str
    """Its process's name (``reward-model``, ``env-<function>``): its log is ``logs/<name>.log``."""
    label: str
    """The reward's name in the metrics (``model``, ``model_2`` ...), or the rollout function's."""
    server: RewardServer
    device: str
    devices: list[int]
    """Its CUDA devices as its process numbers them (empty on CPU)."""


@dataclass
class _Started:
    field: str
    name: str
    url: str
    health: str
    process: ProcessHandle
    timeout: float
    spec: ProcessSpec
    restarts_left: int
    gone: bool = False

    @property
    def what(self) -> str:
        """``reward server``, or ``environment server`` for the rollout function's."""
        return "reward server" if self.field.startswith("reward.") else "environment server"


@dataclass
class RewardServers:
    """The reward servers a run started."""

    keys: ServiceKeys
    started: list[_Started] = field(default_factory=list)
    restarted: int = 0
    """Restarts of dead servers so far."""

    def tick(self, launcher: Launcher) -> None:
        """At every check of the run's processes (the launcher's ``wait_trainers`` tick): a server that exited is
        started again with the same command on the same address while it has restarts left (its samples fail
        meanwhile, with the connection error); then it is said once in the log to be gone."""
        from miles.launch.process import describe_exit

        for server in self.started:
            code = None if server.gone else server.process.exit_status()
            if code is None:
                continue
            tail = server.process.log_tail(10)
            if server.restarts_left > 0:
                server.restarts_left -= 1
                self.restarted += 1
                log.warning(
                    "%s %s (%s) exited (%s); starting it again at %s (%d restart(s) left); its log "
                    "ended with:\n%s",
                    server.what, server.name, server.field, describe_exit(code), server.url, server.restarts_left, tail,
                )  # fmt: skip
                server.process = launcher.start_process(server.spec)
            else:
                server.gone = True
                log.error(
                    "%s %s (%s) exited (%s) with no restart left: the samples it scores fail from now "
                    "on; its log ended with:\n%s",
                    server.what, server.name, server.field, describe_exit(code), tail,
                )  # fmt: skip

    @property
    def urls(self) -> dict[str, str]:
        """``{field: url}`` of every server (``reward.functions[0]``: ``http://127.0.0.1:PORT``)."""
        return {s.field: s.url for s in self.started}

    def wait(self, *, poll_interval: float = 0.25) -> None:
        """Until every server answers its health path; a server that exits first or stays silent past its
        ``startup_timeout`` raises :class:`LaunchError` with its log tail."""
        import httpx

        from miles.launch.process import describe_exit

        with httpx.Client(timeout=5.0, trust_env=False, headers=self.keys.headers()) as client:
            for server in self.started:
                deadline = time.monotonic() + server.timeout
                while True:
                    code = server.process.exit_status()
                    if code is not None:
                        raise LaunchError(
                            f"{server.what} {server.name} ({server.field}) exited before it answered: "
                            f"{describe_exit(code)}; last lines of its log:\n{server.process.log_tail(20)}",
                            process=server.name,
                        )
                    try:
                        if client.get(server.health).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() >= deadline:
                        raise LaunchError(
                            f"{server.what} {server.name} ({server.field}) did not answer {server.health} within "
                            f"{server.timeout:g} s; last lines of its log:\n{server.process.log_tail(20)}",
                            process=server.name,
                        )
                    time.sleep(poll_interval)
                log.info("%s %s (%s) is up at %s", server.what, server.name, server.field, server.url)


def server_device(
    server: RewardServer, settings: MilesSettings, *, gpus_per_engine: int, own: int
) -> tuple[str, list[int]]:
    """Where a reward server runs: its device and, on CUDA, its GPU as the ``local`` launcher numbers them (see
    the module's docstring); ``own``: servers before it that took a GPU of their own."""
    device = settings.cluster.device if server.device == "auto" else server.device
    if device != "cuda":
        return device, []
    if server.colocate:
        return device, [0]
    cluster = settings.cluster
    first = cluster.trainer_ranks + (0 if cluster.colocate else cluster.num_engines * gpus_per_engine)
    return device, [first + own]


def declare_servers(run: Run, launcher: Launcher, settings: MilesSettings) -> list[DeclaredServer]:
    """The servers of ``run``'s rewards (their :meth:`~miles.rewards.base.Reward.server`) and of its rollout
    function, each told to the launcher (:meth:`~miles.launch.base.Launcher.place_service`: its CPUs, memory,
    custom resources and, on CUDA, one GPU) before anything is reserved or started.

    Raises :class:`SettingsError` naming the field when a server asks to share the run's first GPU
    (``colocate``) with a launcher that places it in resources of its own."""
    from miles.settings.model import PluginSpec

    out: list[DeclaredServer] = []
    own = 0
    seen: dict[str, int] = {}
    for i, function in enumerate(settings.reward.functions):
        seen[function.name] = seen.get(function.name, 0) + 1  # (the names Run.rewards gives: model, model_2 ...)
        label = function.name if seen[function.name] == 1 else f"{function.name}_{seen[function.name]}"
        where = f"reward.functions[{i}]"
        if where not in run.resolved:  # (a run resolved without its rewards)
            continue
        server = run[where].create().server()
        if server is None:
            continue
        engines = settings.cluster.num_engines and "rollout.engine" in run.resolved
        gpus_per_engine = run.rollout_engine().gpus_per_engine if engines and settings.cluster.device == "cuda" else 1
        device = settings.cluster.device if server.device == "auto" else server.device
        needs = _needs(server, f"the reward server of {where} ({label})", device)
        devices = launcher.place_service(f"reward-{label}", needs)
        if devices is None:
            device, devices = server_device(server, settings, gpus_per_engine=gpus_per_engine, own=own)
            own += bool(devices) and not server.colocate
        elif device == "cuda" and server.colocate:
            raise SettingsError(
                f"{where}: reward {label!r} asks to share the run's first GPU (colocate), which the "
                f"{settings.cluster.launcher.name!r} launcher does not give: it places each reward server with a GPU "
                "of its own (drop colocate)"
            )
        out.append(DeclaredServer(where, f"reward-{label}", label, server, device, devices))
    rollout_function: Any = run.rollout_function
    declare = getattr(rollout_function, "server", None)
    server = declare() if declare is not None else None
    if server is not None and settings.rollout.function is not None:
        where, label = "rollout.function", PluginSpec.model_validate(settings.rollout.function).name
        if server.module is None:
            raise SettingsError(f"{where}: rollout function {label!r} asks for a server without a module")
        device = "cpu" if server.device == "auto" else server.device
        needs = _needs(server, f"the environment server of {where} ({label})", device)
        devices = launcher.place_service(f"env-{label}", needs)
        out.append(DeclaredServer(where, f"env-{label}", label, server, device, devices or []))
    return out


def _needs(server: RewardServer, purpose: str, device: str) -> ServiceNeeds:
    from miles.launch.base import ServiceNeeds

    gpus = 1 if device == "cuda" and not server.colocate else 0
    return ServiceNeeds(purpose, server.cpus, gpus, server.memory, dict(server.resources))


def start_reward_servers(
    run: Run,
    launcher: Launcher,
    settings: MilesSettings,
    *,
    keys: ServiceKeys,
    env: dict[str, str],
    declared: list[DeclaredServer] | None = None,
) -> RewardServers:
    """Start the servers ``declared`` (default: :func:`declare_servers` now) without waiting for them; set each
    one's ``url`` in ``settings`` (which the caller writes for the trainer ranks) and in ``run``'s resolution.
    ``env`` is the environment of each (threads, keys).

    Raises :class:`SettingsError` naming the field when a judge's ``engine`` is not a valid rollout engine.
    """
    from miles.auth import check_bind
    from miles.launch.base import ProcessSpec
    from miles.settings.model import PluginSpec

    out = RewardServers(keys)
    for d in declare_servers(run, launcher, settings) if declared is None else declared:
        server, where = d.server, d.field
        host, (port,) = launcher.service_address(d.name, settings.cluster.host)
        what = "reward" if where.startswith("reward.") else "environment"
        check_bind(host, keys, service=f"the {what} server of {where}", setting="cluster.api_key")
        url = f"http://{host}:{port}"
        if server.engine is not None:
            entry, options = run.plugins.resolve(
                ComponentKind.ROLLOUT_ENGINE, PluginSpec.model_validate(server.engine), field=f"{where}.engine"
            )
            engine = entry.component(options)
            launch = engine.launch(
                model_path=server.model_path,
                host=host,
                port=port,
                device=d.device,
                dtype=server.dtype,
                devices=d.devices,
                seed=settings.train.seed,
            )
            argv, extra, url, health = launch.argv, launch.env, launch.url, launch.health_path
        elif server.module is not None:
            argv = [sys.executable, "-m", server.module, "--model", server.model_path, "--host", host]
            argv += ["--port", str(port), "--device", d.device, "--dtype", server.dtype, *server.args]
            extra = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, d.devices))} if d.devices else {}  # (its cuda:0)
            health = server.health_path
        else:
            raise SettingsError(f"{where}: reward {d.label!r} asks for a server with neither an engine nor a module")
        spec = ProcessSpec(name=d.name, argv=argv, env={**env, **extra})
        process = launcher.start_process(spec)
        health_url = url.rstrip("/") + health
        out.started.append(
            _Started(where, spec.name, url, health_url, process, server.startup_timeout, spec, server.restarts)
        )
        _set_url(run, settings, where, url)
        log.info("%s (%s): starting its server %s at %s on %s", d.label, where, server.model_path, url, d.device)
    return out


def _set_url(run: Run, settings: MilesSettings, where: str, url: str) -> None:
    """The server's URL as the ``url`` setting of what it serves, in ``settings`` and in ``run``'s resolution."""
    from miles.settings.model import PluginSpec, RewardFunctionSpec

    if where == "rollout.function":
        function: Any = run.rollout_function
        settings.rollout.function = PluginSpec.model_validate(
            {**PluginSpec.model_validate(settings.rollout.function).model_dump(), "url": url}
        )
        run.set_rollout_function(type(function)(function.settings.model_copy(update={"url": url})))
        return
    i = int(where[len("reward.functions[") : -1])
    chosen = settings.reward.functions[i]
    settings.reward.functions[i] = RewardFunctionSpec.model_validate({**chosen.model_dump(), "url": url})
    resolved = run.resolved[where]
    run.resolved[where] = Resolved(where, resolved.registration, resolved.options.model_copy(update={"url": url}))
