"""What ``miles train`` does on the launching host: start engines and trainer ranks, follow progress,
tear everything down on exit, Ctrl-C or failure."""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from miles.driver.colocate import LOADED_FILE
from miles.host.progress import follow_metrics
from miles.host.reward_servers import declare_servers, start_reward_servers
from miles.host.rundir import prepare_run_dir, remove_scratch, rewind_metrics, write_resolved_settings
from miles.rollout.router import FLEET_FILE, flush_caches

if TYPE_CHECKING:
    from rich.console import Console

    from miles.auth import ServiceKeys
    from miles.compose import Run
    from miles.launch.base import Launcher, ProcessHandle
    from miles.launch.contention import ContentionWatch
    from miles.launch.engine_restarts import EngineDeathPolicy
    from miles.rollout.backend import EngineLaunch, RolloutEngine
    from miles.rollout.router import EngineFleet
    from miles.settings.model import MilesSettings

__all__ = ["finish_fleet", "launch_engines", "launch_fleet", "run_keys", "run_training", "start_router"]

log = logging.getLogger(__name__)


KEEP_MALLOC_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=18446744073709551615"
"""``cluster.trainer_malloc`` / ``engine_malloc = "keep"``: no block mapped on its own, freed memory never returned (glibc ignores
tunables it does not know, and other C libraries ignore the variable)."""


def _child_env(settings: MilesSettings, *, role: str = "trainer") -> dict[str, str]:
    """Environment of a child process, with its torch thread count and OpenMP's wait policy on CPU.

    The threads are :func:`miles.defaults.split_threads`' (in ``sync`` mode each side may use every core, the
    trainer ranks and the engines each splitting them; in the async modes every process gets its own share)
    of the cores other processes left free when the run started (:func:`miles.launch.contention.free_cores`).
    OpenMP threads spin briefly at barriers where the threads that compute at once fit in those cores and the
    machine was not busy, and wait passively (``OMP_WAIT_POLICY=PASSIVE``) otherwise
    (:meth:`~miles.defaults.ThreadSplit.wait_env`). ``OMP_NUM_THREADS`` / ``MILES_TORCH_THREADS`` /
    ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT`` set by the user win.
    """
    from miles.defaults import split_threads, usable_cores
    from miles.launch.contention import free_cores

    cores = usable_cores()
    free = free_cores()  # what other processes left when the run started (None: not measured)
    busy = free is not None and round(free) < cores
    if free is not None:
        cores = max(1, min(cores, round(free)))
    split = split_threads(
        mode=settings.rollout.mode,
        cores=cores,
        trainer_ranks=settings.cluster.trainer_ranks,
        num_engines=settings.cluster.num_engines,
        environ=os.environ,
    )
    threads = str(split.engine if role == "engine" else split.trainer)
    env = {
        "MILES_DEVICE": settings.cluster.device,
        "MILES_LOG_LEVEL": settings.log.level,
        "TOKENIZERS_PARALLELISM": "false",
    }
    if settings.cluster.device == "cpu":
        env.update(
            OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", threads),
            MILES_TORCH_THREADS=threads,  # (the user's MILES_TORCH_THREADS, where set: the split takes it)
        )
        env.update(split.wait_env(os.environ, busy=busy))
        user_malloc = any(k == "GLIBC_TUNABLES" or k.startswith("MALLOC_") for k in os.environ)
        malloc = settings.cluster.engine_malloc if role == "engine" else settings.cluster.trainer_malloc
        if malloc == "keep" and not user_malloc:
            env["GLIBC_TUNABLES"] = KEEP_MALLOC_TUNABLES
    return env


def _weight_dirs_env(run: Run) -> dict[str, str]:
    """``MILES_ALLOWED_WEIGHT_DIRS`` for the run's engines: the run directory and the transport's ``dir``
    (the local engine loads weights from nowhere else; see :mod:`miles.engine.weight_paths`)."""
    return {"MILES_ALLOWED_WEIGHT_DIRS": os.pathsep.join(allowed_weight_dirs(run))}


def allowed_weight_dirs(run: Run) -> list[str]:
    """Where the run's engines may load weights from: the run directory and the transport's ``dir`` (a run
    without a transport, such as ``miles generate``: the run directory)."""
    from miles.transport.base import weight_dirs

    try:
        options = run["transport"].options
    except KeyError:  # no transport in this run
        options = None
    return weight_dirs(run.settings.log.run_dir, options)


def services_leave_loopback(settings: MilesSettings, launcher: Launcher) -> bool:
    """Whether a service of the run listens beyond loopback: ``cluster.host`` or ``rollout.sessions.host`` is
    not loopback, or the launcher places engines on other hosts (they listen on their node's address)."""
    from miles.auth import is_loopback

    hosts = (settings.cluster.host, settings.rollout.sessions.host)
    return launcher.spans_hosts or not all(is_loopback(h) for h in hosts)


def run_keys(settings: MilesSettings, launcher: Launcher) -> ServiceKeys:
    """The run's keys, decided once per launcher (:attr:`Launcher.keys`): ``cluster.api_key`` /
    ``cluster.admin_api_key`` or their environment variables; without an API key, a new random one when a
    service leaves loopback (:func:`services_leave_loopback`), none on loopback."""
    from miles.auth import ServiceKeys, new_key

    if launcher.keys is None:
        keys = ServiceKeys.of_cluster(settings.cluster)
        if keys.api_key is None and services_leave_loopback(settings, launcher):
            keys = keys.with_api_key(new_key())
            log.info(
                "services of this run listen beyond loopback: they require a key made for this run "
                "(set cluster.api_key or MILES_API_KEY to choose it)"
            )
        launcher.keys = keys
    return launcher.keys


def launch_engines(run: Run, launcher: Launcher, *, model_path: str | None = None, wait: bool = True) -> list[str]:
    """Start ``cluster.num_engines`` engine servers serving the policy; return their URLs. With ``wait`` (the
    default) their prefix caches are flushed once they are up; ``wait=False`` returns without waiting for
    them (see :meth:`Launcher.wait_engines`).

    On CUDA engine ``i`` gets ``gpus_per_engine`` GPUs as the launcher numbers them for its process
    (:meth:`~miles.launch.base.Launcher.engine_devices`): on one host from ``first + i x gpus_per_engine``,
    ``first`` being 0 when colocated (engines share the trainer ranks' GPUs) and ``cluster.trainer_ranks``
    otherwise (trainer rank ``r`` uses GPU ``r``); with the ``ray`` launcher ``0 .. gpus_per_engine - 1``, the
    actor's own GPUs."""
    settings = run.settings
    if settings.cluster.num_engines == 0:
        return []
    engine = run.rollout_engine()
    path = model_path or settings.train.model_path
    if path is None:
        from miles.errors import SettingsError

        raise SettingsError("train.model_path: not set (the engines and the trainer load it)")
    launch_at = functools.partial(engine_launch, run, launcher, engine, path)
    launches = [
        launch_at(i, *launcher.engine_address(i, settings.cluster.host)) for i in range(settings.cluster.num_engines)
    ]
    urls = launcher.start_engines(launches, timeout=settings.cluster.engine_startup_timeout, wait=wait)
    if wait:
        flush_caches(urls, run_keys(settings, launcher))
    return urls


def engine_launch(
    run: Run, launcher: Launcher, engine: RolloutEngine, model_path: str, index: int, host: str, port: int
) -> EngineLaunch:
    """Engine ``index``'s launch, listening on ``host:port`` (see :func:`launch_engines`); its ``rebind`` is the
    same engine on another address."""
    settings = run.settings
    # colocated engines share the trainer's GPUs; the others take the GPUs after the trainer ranks'
    first = 0 if settings.cluster.colocate else settings.cluster.trainer_ranks
    gpus = engine.gpus_per_engine
    launch = engine.launch(
        model_path=model_path,
        host=host,
        port=port,
        device=settings.cluster.device,
        dtype=run.engine_dtype,
        devices=launcher.engine_devices(index, first=first, gpus=gpus) if settings.cluster.device == "cuda" else [],
        rank=index,
        seed=settings.train.seed,
        colocate=settings.cluster.colocate,
    )
    keys = run_keys(settings, launcher)
    launch.env = {**_child_env(settings, role="engine"), **_weight_dirs_env(run), **keys.env(), **launch.env}
    launch.rebind = functools.partial(engine_launch, run, launcher, engine, model_path, index)
    return launch


ROUTER_BIND_ATTEMPTS = 3
"""Starts of the router on new ports when another program took its ports before it bound them."""


def start_router(run: Run, launcher: Launcher, engine_urls: list[str]) -> str:
    """Start the ``rollout.router`` (smg) in front of ``engine_urls`` through the launcher, which owns it and
    says where it listens (:meth:`~miles.launch.base.Launcher.service_address`: ``cluster.host`` on this
    machine, or a node of the cluster); return its URL once it reports every engine healthy and registered.
    A router whose ports were taken before it bound them is started again on others (said once in the log)."""
    from miles.auth import check_bind
    from miles.errors import LaunchError
    from miles.launch.base import ProcessSpec
    from miles.launch.process import describe_exit
    from miles.net import address_in_use
    from miles.rollout.router import smg_argv, smg_command, wait_for_router

    settings = run.settings
    keys = run_keys(settings, launcher)
    for attempt in range(1, ROUTER_BIND_ATTEMPTS + 1):
        # (the metrics port: free on the router's node, where smg serves its metrics on loopback)
        host, (port, metrics_port) = launcher.service_address("router", settings.cluster.host, ports=2)
        check_bind(host, keys, service="the router (smg)", setting="cluster.api_key")
        argv = smg_argv(settings.rollout.router, engine_urls, host=host, port=port, prometheus_port=metrics_port)
        spec = ProcessSpec(name="router", argv=smg_command(argv, keys), env=keys.env())
        process = launcher.start_process(spec)
        url = f"http://{host}:{port}"

        def exited(process: ProcessHandle = process) -> str | None:
            code = process.exit_status()
            return None if code is None else f"{describe_exit(code)}; last lines of its log:\n{process.log_tail(20)}"

        try:
            wait_for_router(
                url,
                engine_urls,
                timeout=settings.rollout.router.startup_timeout,
                exited=exited,
                headers=keys.headers(control=True),
            )
            break
        except LaunchError:
            code = process.exit_status()
            if attempt == ROUTER_BIND_ATTEMPTS or not address_in_use(code, process.log_tail(20)):
                raise
            log.warning("router: port %d or %d was taken before it could bind; starting it again", port, metrics_port)
    log.info(
        "router (smg, policy %s) is up at %s in front of %d engines",
        settings.rollout.router.policy,
        url,
        len(engine_urls),
    )
    return url


def launch_fleet(run: Run, launcher: Launcher, *, model_path: str | None = None) -> EngineFleet:
    """The engines (:func:`launch_engines`) and, with ``rollout.router = "smg"``, the router in front of them,
    once every one answers; and the servers of the run's reward models (their URLs then in ``run.settings``)."""
    settings = run.settings
    declared = declare_servers(run, launcher, settings)  # (before the reservation: its room counts them)
    engines = settings.cluster.num_engines
    launcher.reserve(
        trainer_ranks=0,
        num_engines=engines,
        colocate=False,
        device=settings.cluster.device,
        gpus_per_engine=run.rollout_engine().gpus_per_engine if engines else 0,
    )
    keys = run_keys(settings, launcher)
    env = {**_child_env(settings, role="engine"), **keys.env()}
    reward_servers = start_reward_servers(run, launcher, settings, keys=keys, env=env, declared=declared)
    launch_engines(run, launcher, model_path=model_path, wait=False)
    reward_servers.wait()
    return finish_fleet(run, launcher)


def finish_fleet(run: Run, launcher: Launcher) -> EngineFleet:
    """Wait for the engines started with ``wait=False`` (an engine whose port was taken meanwhile is started on
    another: the URLs are final only now), then start the router in front of them; return the fleet."""
    from miles.rollout.router import EngineFleet

    settings = run.settings
    router = settings.rollout.router
    keys = run_keys(settings, launcher)
    urls = launcher.wait_engines(timeout=settings.cluster.engine_startup_timeout)
    if urls:
        flush_caches(urls, keys)
    router_url = start_router(run, launcher, urls) if urls and router.name == "smg" else None
    return EngineFleet(urls, router_url=router_url, routing_key_header=router.routing_key_header, keys=keys)


def _engine_death_policy(settings: MilesSettings) -> EngineDeathPolicy:
    """``rollout.engine_restarts``, unless a router sits in front of the engines (it would send traffic to a
    restarted engine before the weight push has reached it: dead engines are then left out, not restarted)."""
    from miles.launch.engine_restarts import EngineDeathPolicy

    restarts = settings.rollout.engine_restarts
    if restarts and settings.rollout.router.name == "smg":
        log.warning(
            "rollout.engine_restarts = %d is ignored with rollout.router = smg: dead engines are left out", restarts
        )
        restarts = 0
    return EngineDeathPolicy(restarts)


def refuse_unplaceable_engines(run: Run, launcher: Launcher) -> None:
    """On a cluster (:meth:`~miles.launch.base.Launcher.nodes`), the rollout engine's own check of its
    placement (:meth:`~miles.rollout.backend.RolloutEngine.placement_problems`: SGLang's GPUs per node), before
    anything is reserved. Raises :class:`~miles.errors.SettingsError` with every problem."""
    from miles.errors import SettingsError

    nodes = launcher.nodes()
    if nodes is None:
        return
    problems = run.rollout_engine().placement_problems(nodes, run.settings)
    if problems:
        raise SettingsError("\n".join(problems))


def refuse_unshared_dirs(run: Run, launcher: Launcher, run_dir: Path, *, engines: bool) -> None:
    """Refuse, before anything starts, a run whose processes would not see the directories they share: the
    run directory (the driver writes the settings, every trainer rank reads them, rank 0 writes the metrics
    the driver follows) and the transport's :meth:`~miles.transport.base.WeightTransport.shared_dirs` (rank 0
    writes, every engine reads). The launcher tells (:meth:`~miles.launch.base.Launcher.unshared`: on one
    host every path is shared). Raises :class:`~miles.errors.SettingsError` naming each field."""
    from miles.errors import SettingsError

    checks: list[tuple[str, str, tuple[str, ...]]] = [("log.run_dir", str(run_dir), ("driver", "trainer"))]
    if engines and "transport" in run.resolved:
        entry = run["transport"]
        shared_dirs = getattr(entry.registration.component, "shared_dirs", None)
        if shared_dirs is not None:
            for field, path in shared_dirs(entry.options, run_dir=str(run_dir)).items():
                checks.append((field, path, ("engine",)))
    problems = []
    for field, path, roles in checks:
        missing = launcher.unshared(path, roles=roles)
        if missing:
            problems.append(
                f"{field}: {path} is not a directory every node of the run shares: {'; '.join(missing)} "
                "do(es) not see what trainer rank 0 writes there. Use a path on a file system every node mounts at "
                "the same place (NFS, Lustre ...)"
                + (
                    ", or a transport that moves weights over the network (broadcast, p2p)"
                    if field != "log.run_dir"
                    else ""
                )
            )
    if problems:
        raise SettingsError("\n".join(problems))


def run_training(
    run: Run, *, resume: str | None = None, overwrite: bool = False, console: Console | None = None
) -> int:
    """Launch and supervise a training run; returns the exit code (0 on success).

    :param resume: continue from this checkpoint (a run directory that holds a run may be continued).
    :param overwrite: replace what an earlier run left in ``log.run_dir``; without it (or ``resume``) a
        run directory that holds a run is refused, so nothing an earlier run produced is lost.
    """
    from miles.host.fleet import FleetController
    from miles.launch.rendezvous import trainer_specs

    run_dir = prepare_run_dir(run.settings, resume=resume, overwrite=overwrite)
    resumed_at = _resume_step(run_dir, resume, console)
    model_path = run.materialize_model()
    watch = _contention_watch(run.settings)
    settings = run.settings.model_copy(deep=True)
    settings.log.run_dir = str(run_dir)
    write_resolved_settings(settings, run_dir / "settings.json")
    with run.launcher(run_dir=str(run_dir)) as launcher:
        cluster = settings.cluster
        engines = run.algorithm.needs.rollout and cluster.num_engines > 0
        if engines:
            refuse_unplaceable_engines(run, launcher)
        # reward models and judges (and an environment server): told to the launcher before it reserves
        declared = declare_servers(run, launcher, settings) if run.algorithm.needs.rollout else []
        launcher.reserve(
            trainer_ranks=cluster.trainer_ranks,
            num_engines=cluster.num_engines if run.algorithm.needs.rollout else 0,
            colocate=cluster.colocate,
            device=cluster.device,
            gpus_per_engine=run.rollout_engine().gpus_per_engine if run.algorithm.needs.rollout else 0,
        )
        launcher.engine_deaths = _engine_death_policy(settings)
        refuse_unshared_dirs(run, launcher, run_dir, engines=engines)
        keys = run_keys(settings, launcher)  # (before anything starts: every process of the run gets them)
        # reward models and judges: their own processes, their URLs in the settings the ranks read
        reward_servers = None
        if run.algorithm.needs.rollout:
            reward_servers = start_reward_servers(
                run,
                launcher,
                settings,
                keys=keys,
                env={**_child_env(settings, role="engine"), **keys.env()},
                declared=declared,
            )
            if reward_servers.started:
                write_resolved_settings(settings, run_dir / "settings.json")
        # the engines start (load weights, build the CPU kernels) while the trainer ranks load their models;
        # rank 0 waits for the fleet (fleet.json, written here once every engine and the router answer).
        # Colocated, they share the trainer's devices: they start once every rank has loaded and offloaded
        # (rank 0 writes LOADED_FILE), so an engine's memory profile never races the trainer's load
        after_trainers = engines and cluster.colocate
        (run_dir / FLEET_FILE).unlink(missing_ok=True)  # a resumed run's old engines are gone
        (run_dir / LOADED_FILE).unlink(missing_ok=True)
        if engines and not after_trainers:
            launch_engines(run, launcher, wait=False)
        (run_dir / "launch.json").write_text(json.dumps({"engines": engines, "resume": resume}))
        env = {**_child_env(settings), **keys.env()}
        specs = trainer_specs(
            [sys.executable, "-m", "miles.driver.worker", str(run_dir)], settings.cluster.trainer_ranks, env=env
        )
        launcher.start_trainers(specs)
        controller = None
        if after_trainers:
            loaded = run_dir / LOADED_FILE
            launcher.wait_until(
                loaded.exists,
                timeout=cluster.trainer_startup_timeout,
                waiting_for="colocated: trainer ranks not loaded",
            )
            log.info("colocated: the trainer ranks have loaded and offloaded; starting the engines")
            launch_engines(run, launcher, wait=False)
        if reward_servers is not None:
            reward_servers.wait()  # (before the fleet is announced: rank 0 scores once it has the engines)
        if engines:
            # fleet.json, announced now; from here on engines may join and leave (``miles fleet add|remove``)
            controller = FleetController(
                run,
                launcher,
                run_dir,
                finish_fleet(run, launcher),
                launch=functools.partial(engine_launch, run, launcher, run.rollout_engine(), model_path),
                host=cluster.host,
            )
        try:
            with follow_metrics(
                console,
                run_dir / "metrics.jsonl",
                settings.train.num_rollouts,
                after_step=resumed_at,
                on_step=watch.step if watch is not None else None,
            ):
                ticks: list[Callable[[], None]] = [] if controller is None else [controller.tick]
                if reward_servers is not None and reward_servers.started:  # (dead ones started again)
                    ticks.append(functools.partial(reward_servers.tick, launcher))
                return launcher.wait_trainers(tick=(lambda: _tick_all(ticks)) if ticks else None)
        finally:
            if controller is not None:
                controller.close()
            launcher.shutdown()  # (every process reaped before its files go)
            transport = run.resolved.get("transport")
            if transport is None or not getattr(transport.options, "keep_after_run", False):
                remove_scratch(run_dir)


def _tick_all(ticks: list[Callable[[], None]]) -> None:
    for tick in ticks:
        tick()


def _contention_watch(settings: MilesSettings) -> ContentionWatch | None:
    """On CPU with the ``local`` launcher: measure the machine before the children start (the cores left
    free set their thread counts) and follow the run's share of it every few steps."""
    from miles.launch.contention import ContentionWatch, check_start

    if settings.cluster.device != "cpu" or settings.cluster.launcher.name != "local":
        return None
    start = check_start()
    return ContentionWatch(warned=start is not None and start.starved)


def _resume_step(run_dir: Path, resume: str | None, console: Console | None) -> int:
    """The checkpoint step a resumed run continues after (0 for a new run), said once; the earlier run's rows
    of later steps leave ``metrics.jsonl``."""
    if resume is None:
        return 0
    from miles.driver.checkpoint import find_checkpoint, read_driver_state

    checkpoint = find_checkpoint(resume)
    step = read_driver_state(checkpoint).step
    dropped = rewind_metrics(run_dir, step)
    note = f"resumed from step {step} ({checkpoint})" + (f"; {dropped} later step(s) will run again" if dropped else "")
    log.info("%s", note)
    if console is not None:
        console.print(note, highlight=False)
    return step
