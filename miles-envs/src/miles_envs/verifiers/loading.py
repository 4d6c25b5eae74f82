"""Loading a verifiers environment by name or by file, once per process.

A run names its environment in ``data.path``:

- an installed environment module (``vf-eval``'s id: ``my-env`` imports ``my_env``; ``owner/my-env`` too,
  as verifiers reads hub ids) — verifiers' own :func:`verifiers.load_environment` loads it;
- a Python file (``envs/my_env.py``) that defines ``load_environment(**args)`` the way an environment
  module does: imported from its path, then called with ``args``.

The environment must be one of verifiers' classic environments (``vf.Environment``: ``SingleTurnEnv``,
``MultiTurnEnv``, ``ToolEnv`` ...), whose ``rollout`` talks to an OpenAI-compatible client. Its rubric's
group-level reward functions (:func:`group_reward_functions`) score the rollouts of a GRPO group together
(:mod:`miles_envs.verifiers.groups`).

Building a ``vf.Environment`` installs verifiers' own SIGINT / SIGTERM handlers (they tear the environment
down and exit); Miles' launcher owns those signals (it stops the run's processes first), so the handlers
that were in place are put back after loading.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from miles.components import Requirement
from miles.errors import SettingsError

__all__ = [
    "VERIFIERS",
    "EnvSpec",
    "VerifiersEnvError",
    "group_reward_functions",
    "load_env",
]

log = logging.getLogger(__name__)

VERIFIERS = Requirement("verifiers", extra="verifiers", distribution="miles-envs")
"""What the ``verifiers`` data source, rollout function and reward import."""

_LOADED: dict[tuple[str, str], Any] = {}
_LOCK = threading.Lock()


class VerifiersEnvError(SettingsError):
    """A verifiers environment that cannot be loaded or served (the message names it and why)."""


@dataclass(frozen=True)
class EnvSpec:
    """Which environment a sample belongs to: what ``data.path`` named and the ``load_environment``
    arguments (``data.source.args``). Every prompt of the ``verifiers`` data source carries it in its
    metadata (``verifiers_env``), so the rollout function and the reward find the same environment."""

    id: str
    args: Mapping[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "args": dict(self.args)}

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], where: str) -> EnvSpec:
        """The spec a sample's metadata holds; an error names ``where`` and the data source to use."""
        spec = metadata.get("verifiers_env")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("id"), str):
            raise VerifiersEnvError(
                f"{where}: the sample names no verifiers environment (metadata 'verifiers_env'); its prompts must "
                "come from data.source = 'verifiers'"
            )
        args = spec.get("args") or {}
        if not isinstance(args, Mapping):
            raise VerifiersEnvError(f"{where}: metadata 'verifiers_env.args' must be a table, got {args!r}")
        return cls(spec["id"], dict(args))

    @property
    def key(self) -> tuple[str, str]:
        return self.id, json.dumps(self.args, sort_keys=True, default=str)


def is_env_file(env_id: str) -> bool:
    """Whether ``env_id`` names a Python file (it ends with ``.py``) rather than an installed module."""
    return env_id.endswith(".py")


def _module_from_file(path: str) -> ModuleType:
    """Import the file ``path`` as a module of its own (registered in ``sys.modules``, so that the
    environment's classes and functions pickle and introspect like an installed module's)."""
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise VerifiersEnvError(f"verifiers environment file {path!r}: no such file")
    stem = os.path.splitext(os.path.basename(full))[0]
    name = f"_miles_verifiers_env_{stem}_{hashlib.sha1(full.encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, full)
    if spec is None or spec.loader is None:
        raise VerifiersEnvError(f"verifiers environment file {path!r}: not importable as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise VerifiersEnvError(
            f"verifiers environment file {path!r} failed to import: {type(exc).__name__}: {exc}"
        ) from exc
    return module


@contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """Put back the SIGINT / SIGTERM handlers that were in place (see the module docstring)."""
    main = threading.current_thread() is threading.main_thread()
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None and signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)


def _load(spec: EnvSpec) -> Any:
    vf = VERIFIERS.load("the verifiers environment connector")
    from verifiers.legacy.envs.environment import Environment

    what = f"verifiers environment {spec.id!r}"
    with _signal_handlers_kept():
        if is_env_file(spec.id):
            module = _module_from_file(spec.id)
            factory = getattr(module, "load_environment", None)
            if not callable(factory):
                raise VerifiersEnvError(f"{what}: the file defines no load_environment(**args) function")
            try:
                env = factory(**spec.args)
            except Exception as exc:
                raise VerifiersEnvError(
                    f"{what}: load_environment({_args_text(spec.args)}) raised {type(exc).__name__}: {exc}"
                ) from exc
        else:
            try:
                env = vf.load_environment(spec.id, **spec.args)
            except ValueError as exc:  # verifiers' message for a module it cannot import
                raise VerifiersEnvError(
                    f"{what}: cannot import module {spec.id.replace('-', '_').split('/')[-1]!r} ({exc.__cause__ or exc}); "
                    "install the environment's package, or name a .py file that defines load_environment"
                ) from exc
            except Exception as exc:
                raise VerifiersEnvError(f"{what}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(env, Environment):
        raise VerifiersEnvError(
            f"{what}: load_environment returned {type(env).__name__}, not a verifiers Environment (Miles connects "
            "verifiers' classic API: vf.SingleTurnEnv, vf.MultiTurnEnv, vf.ToolEnv and their subclasses)"
        )
    grouped = group_reward_functions(env)
    if grouped:
        log.info("%s: group-level reward functions %s score each group's episodes together", what, ", ".join(grouped))
    return env


def _args_text(args: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in args.items())


def group_reward_functions(env: Any) -> list[str]:
    """Names of the reward functions of ``env``'s rubric that score a group of rollouts together (verifiers
    tells them by their signature: plural arguments such as ``completions``, or a list returned)."""
    rubric = env.rubric
    return [getattr(f, "__name__", repr(f)) for f in rubric._get_reward_funcs() if rubric._is_group_func(f)]


def load_env(spec: EnvSpec) -> Any:
    """The environment ``spec`` names, loaded once per process (later calls return the same object).

    :raises VerifiersEnvError: it cannot be imported or built, or is not a classic verifiers environment.
    :raises MissingExtraError: verifiers is not installed (``pip install "miles-envs[verifiers]"``).
    """
    key = spec.key
    with _LOCK:
        env = _LOADED.get(key)
        if env is None:
            env = _load(spec)
            _LOADED[key] = env
            log.info("verifiers environment %s loaded (%s)", spec.id, type(env).__name__)
        return env


def forget_envs() -> None:
    """Drop the loaded environments (tests)."""
    with _LOCK:
        _LOADED.clear()
