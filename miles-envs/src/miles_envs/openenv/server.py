"""An OpenEnv environment server as a process of a run: ``python -m miles_envs.openenv.server``.

``miles train`` starts it for the ``openenv`` rollout function's ``env`` (:meth:`~miles_envs.openenv.OpenEnvRollout.server`)::

    python -m miles_envs.openenv.server --model my_env.server:MyEnvironment --host 127.0.0.1 --port P \\
        --device cpu --dtype auto --max-concurrent-envs 64

``--model`` names an OpenEnv ``Environment`` subclass (served with ``create_app`` and the action and observation
types it is parametrised with) or an app ``create_app`` made (served as it is). The routes are OpenEnv's
(``/health``, ``/schema``, ``/reset``, ``/step``, ``/state``, the ``/ws`` sessions). With ``MILES_API_KEY`` in its
environment every route but ``/health`` needs the key, the ``/ws`` sessions too; beyond loopback it refuses to
start without one. ``--device`` and ``--dtype`` are accepted for the launcher's sake and unused.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any, get_args, get_origin

from miles.errors import SettingsError

__all__ = ["build_app", "environment_types", "main"]

log = logging.getLogger("miles_envs.openenv.server")


def environment_types(cls: type, *, field: str = "--model") -> tuple[type, type]:
    """The action and observation types an ``Environment`` subclass is parametrised with
    (``class MyEnv(Environment[MyAction, MyObservation, State])``), searched along its bases."""
    from openenv.core.env_server import Action, Environment, Observation

    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            origin = get_origin(base)
            if isinstance(origin, type) and issubclass(origin, Environment):
                args = [a for a in get_args(base) if isinstance(a, type)]
                action = next((a for a in args if issubclass(a, Action)), None)
                observation = next((a for a in args if issubclass(a, Observation)), None)
                if action is not None and observation is not None:
                    return action, observation
    raise SettingsError(
        f"{field}: {cls.__qualname__} does not declare its types: write it as "
        "Environment[MyAction, MyObservation, State], or name the app create_app made for it"
    )


def _reject_websocket_without_key(app: Any, keys: Any) -> Any:
    """An ASGI wrapper refusing a WebSocket session without the run's key (``install_auth`` checks HTTP only)."""

    async def guarded(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            header = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"authorization"), None)
            if not keys.allows(header, control=False):
                await send({"type": "websocket.close", "code": 1008, "reason": "missing or wrong key"})
                return
        await app(scope, receive, send)

    return guarded


def build_app(target: Any, *, max_concurrent_envs: int, keys: Any = None) -> Any:
    """The ASGI app serving ``target`` (an ``Environment`` subclass or a ``create_app`` app), behind ``keys``."""
    from openenv.core.env_server import Environment, create_app

    from miles.auth import ServiceKeys, install_auth

    if isinstance(target, type) and issubclass(target, Environment):
        action, observation = environment_types(target)
        app = create_app(target, action, observation, env_name=target.__name__, max_concurrent_envs=max_concurrent_envs)
    else:
        app = target
    keys = keys if keys is not None else ServiceKeys()
    if not keys.enabled:
        return app
    install_auth(app, keys, error=lambda message: {"error": message})
    return _reject_websocket_without_key(app, keys)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m miles_envs.openenv.server", description=__doc__)
    parser.add_argument("--model", required=True, help="package.module:attribute of the environment or its app")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-concurrent-envs", type=int, default=64)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("MILES_LOG_LEVEL", "INFO"), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import uvicorn

    from miles.auth import ServiceKeys, check_bind
    from miles_envs.gym_text.episode import load_object

    keys = ServiceKeys.from_env()
    check_bind(args.host, keys, service="the OpenEnv environment server", setting="cluster.api_key")
    target = load_object(args.model, field="--model")
    app = build_app(target, max_concurrent_envs=args.max_concurrent_envs, keys=keys)
    log.info("OpenEnv environment %s serving on %s:%d", args.model, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
