"""Hook specifications: the whole contract between Miles and its plugins.

A plugin is a module (or object) with functions decorated by :data:`miles.hookimpl` and named like the
specifications below. Built-in plugins use the same hooks as third-party ones. Plugins are found through
the ``miles.plugins`` entry-point group; the entry point's name is the plugin's name::

    [project.entry-points."miles.plugins"]
    my_reward = "miles_my_reward.plugin"

**Registration hooks** receive a ``register`` callback and call it once per component class::

    @miles.hookimpl
    def miles_register_rewards(register):
        register(MyReward)            # MyReward.name == "my_reward"

Settings select components by that name; a name registered by two plugins is an error naming both.
**Lifecycle hooks** observe a run (all implementations are called; return values are ignored).

Hooks only ever grow by new keyword arguments, which implementations opt into by naming them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from miles.markers import hookspec

if TYPE_CHECKING:
    import typer
    from fastapi import FastAPI

    from miles.components import Register
    from miles.settings.model import MilesSettings
    from miles.types import PushReport, SampleGroup

# ----------------------------------------------------------------------------------------------------
# rollout
# ----------------------------------------------------------------------------------------------------


@hookspec
def miles_register_rollout_engines(register: Register) -> None:
    """Register rollout-engine backends: classes deriving from
    :class:`miles.rollout.backend.RolloutEngine` that say how to start one engine server.

    Selected by ``rollout.engine``. Built in: ``local`` (``miles serve``); miles-sglang adds ``sglang``.

    :param register: call ``register(EngineClass)``; the class's ``name`` is the key.

    .. versionadded:: 0.1
    """


@hookspec
def miles_register_rollout_functions(register: Register) -> None:
    """Register custom rollout functions (:class:`miles.rollout.function.RolloutFunction`): agents,
    tools, multi-turn episodes that replace the default single-turn generate.

    Selected by ``rollout.function``. Register a function with ``register(fn, name="my_agent")``, or a
    :class:`~miles.components.Component` class (``register(MyEnv)``, named by its ``name``) that a
    ``[rollout.function]`` table configures: the run makes one instance with its validated settings. Such a
    class may declare a server the run starts for it (``server()``, see
    :class:`~miles.rollout.function.RolloutFunction`).

    :param register: call ``register(fn, name=...)`` or ``register(cls)``.

    .. versionadded:: 0.1
    """


# ----------------------------------------------------------------------------------------------------
# engine server
# ----------------------------------------------------------------------------------------------------


@hookspec
def miles_engine_routes(app: FastAPI, engine: object) -> None:
    """Add HTTP routes to an engine server as it starts, in the engine's own process: a weight path's
    receiving side (miles-p2p's ``/p2p/*``), adapter loading, a new control call. The local engine's own
    weight, ``disk_delta`` and LoRA routes are added this way too (built-in plugin ``local_engine``).

    Called once per server, after the protocol's shared routes and ``/generate`` are on ``app``. ``engine``
    is the engine being served: the local engine's :class:`miles.engine.state.EngineState` (its scheduler,
    model and weights; see that module for what a route may use), or another engine's
    :class:`miles.engine.protocol_app.ServedEngine` (miles-diffusion's image engine). Extend the engines you
    know (``isinstance``) and return for the others. Answer control calls in SGLang's shape with
    :func:`miles.engine.responses.admin`; touch the model only on the scheduler thread
    (``engine.on_scheduler``). Import heavy modules inside the hook: the engine's plugins load at its
    start-up. A hook that raises, or that adds a route the server already has (same path and method), fails
    its plugin (the engine logs it and serves without that plugin's routes).

    :param app: the engine's FastAPI application; add routes with ``@app.post(path)`` and friends.
    :param engine: the engine the application serves.

    .. versionadded:: 0.1
    """


# ----------------------------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------------------------


@hookspec
def miles_register_trainers(register: Register) -> None:
    """Register trainer backends: classes deriving from :class:`miles.training.trainer.Trainer`.

    Selected by ``train.backend``. miles-fsdp adds ``fsdp``; miles-megatron adds ``megatron``.

    :param register: call ``register(TrainerClass)``.

    .. versionadded:: 0.1
    """


@hookspec
def miles_register_adapters(register: Register) -> None:
    """Register model adapters: classes deriving from :class:`miles.training.adapter.ModelAdapter` that
    wrap the policy with trainable adapters (parameter-efficient fine-tuning).

    Selected by ``train.adapter``. miles-lora adds ``lora``.

    :param register: call ``register(AdapterClass)``.

    .. versionadded:: 0.1
    """


# ----------------------------------------------------------------------------------------------------
# weight transport
# ----------------------------------------------------------------------------------------------------


@hookspec
def miles_register_transports(register: Register) -> None:
    """Register weight transports: classes deriving from :class:`miles.transport.base.WeightTransport`.

    Selected by ``transport``. Built in: ``disk``, ``broadcast``; miles-p2p adds ``p2p``.

    :param register: call ``register(TransportClass)``.

    .. versionadded:: 0.1
    """


# ----------------------------------------------------------------------------------------------------
# precision
# ----------------------------------------------------------------------------------------------------


@hookspec
def miles_register_precisions(register: Register) -> None:
    """Register precision recipes: classes deriving from :class:`miles.precision.base.PrecisionRecipe`.

    Selected by ``precision``. Built in: ``fp32``, ``bf16``, ``fp8``, ``mxfp8``, ``nvfp4``.

    :param register: call ``register(RecipeClass)``.

    .. versionadded:: 0.1
    """


# ----------------------------------------------------------------------------------------------------
# algorithm
# ----------------------------------------------------------------------------------------------------


@hookspec
def miles_register_algorithms(register: Register) -> None:
    """Register RL objectives: classes deriving from :class:`miles.algorithms.base.Algorithm`.

    Selected by ``algorithm``.

    :param register: call ``register(AlgorithmClass)``.

    .. versionadded:: 0.1
    """


# ----------------------------------------------------------------------------------------------------
# reward
# ----------------------------------------------------------------------------------------------------


@hookspec
def miles_register_rewards(register: Register) -> None:
    """Register reward functions: classes deriving from :class:`miles.rewards.base.Reward` (a sample at a
    time) or :class:`miles.rewards.base.GroupReward` (the samples of a group together).

    Selected by the entries of ``reward.functions``.

    :param register: call ``register(RewardClass)``.

    .. versionadded:: 0.1
    """


# ----------------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------------


@hookspec
def miles_register_data_sources(register: Register) -> None:
    """Register prompt sources: classes deriving from :class:`miles.data.base.DataSource`.

    Selected by ``data.source``. Built in: ``jsonl``, ``parquet``.

    :param register: call ``register(SourceClass)``.

    .. versionadded:: 0.1
    """


# ----------------------------------------------------------------------------------------------------
# launch
# ----------------------------------------------------------------------------------------------------


@hookspec
def miles_register_launchers(register: Register) -> None:
    """Register launchers: classes deriving from :class:`miles.launch.base.Launcher`.

    Selected by ``cluster.launcher``. Built in: ``local``; a Ray launcher adds ``ray``.

    :param register: call ``register(LauncherClass)``.

    .. versionadded:: 0.1
    """


# ----------------------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------------------


@hookspec
def miles_register_commands(app: typer.Typer) -> None:
    """Add subcommands to the ``miles`` command line (a backend's conversion tools, a package's viewers).

    Add a command with ``app.command("name")(function)`` or a group with ``app.add_typer(sub_app,
    name="name")``. Import heavy modules inside the commands, not in the hook: it runs on every ``miles``
    invocation. A name another command already has fails the plugin (``miles plugins list`` shows it) and
    leaves its commands out; so does a hook that raises.

    :param app: the ``miles`` typer application.

    .. versionadded:: 0.1
    """


# ----------------------------------------------------------------------------------------------------
# lifecycle and metrics
# ----------------------------------------------------------------------------------------------------


@hookspec
def miles_register_loggers(register: Register) -> None:
    """Register metrics loggers: classes deriving from :class:`miles.metrics.base.MetricsLogger`.

    Selected by ``log.loggers``. Built in: ``jsonl``.

    :param register: call ``register(LoggerClass)``.

    .. versionadded:: 0.1
    """


@hookspec
def miles_on_run_start(settings: MilesSettings, run_dir: str) -> None:
    """Called once on the driver when a run starts, after settings are resolved and before any process
    is launched.

    :param settings: the resolved, validated settings.
    :param run_dir: the run's output directory.

    .. versionadded:: 0.1
    """


@hookspec
def miles_on_rollout_end(step: int, groups: Sequence[SampleGroup], metrics: Mapping[str, float]) -> None:
    """Called on the driver after a rollout's groups are generated, scored and filtered.

    :param step: the training step the rollout feeds.
    :param groups: the kept sample groups (read-only by convention).
    :param metrics: rollout metrics (mean reward, response length, prefix-cache hit rate ...).

    .. versionadded:: 0.1
    """


@hookspec
def miles_on_step_end(step: int, metrics: Mapping[str, float]) -> None:
    """Called on the driver after each training step, with every metric of the step.

    :param step: the step just finished (1-based).
    :param metrics: flat ``{"group/name": value}`` metrics (reward, loss parts, timings, fidelity signals).

    .. versionadded:: 0.1
    """


@hookspec
def miles_on_weights_pushed(step: int, version: str, report: PushReport) -> None:
    """Called on the driver after a weight push was delivered and verified.

    :param step: the training step whose weights were pushed.
    :param version: the weight version the engines now serve.
    :param report: what the transport moved (tensors, bytes, seconds).

    .. versionadded:: 0.1
    """


@hookspec
def miles_on_checkpoint_saved(step: int, path: str) -> None:
    """Called on the driver after a checkpoint is complete on disk.

    :param step: the step the checkpoint resumes after.
    :param path: the checkpoint directory.

    .. versionadded:: 0.1
    """


@hookspec
def miles_on_run_end(run_dir: str, status: str, error: str | None) -> None:
    """Called once on the driver when a run ends, whatever the reason.

    :param run_dir: the run's output directory.
    :param status: ``completed``, ``failed`` or ``interrupted``.
    :param error: the error message when ``status`` is ``failed``.

    .. versionadded:: 0.1
    """


__all__ = ["hookspec"] + [name for name in dir() if name.startswith("miles_")]
