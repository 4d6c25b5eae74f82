"""The ``local`` rollout-engine backend: starts ``miles serve`` (built-in plugin ``local_engine``), and the
local engine's own route groups (weights, ``disk_delta``, LoRA), added through ``miles_engine_routes`` as any
plugin's are.

Imports cheaply: nothing here touches torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.components import Register
from miles.engine.options import EngineOptions, ServeOptions, to_argv
from miles.markers import hookimpl
from miles.rollout.backend import EngineCapabilities, EngineLaunch, RolloutEngine

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["LocalEngine", "LocalEngineSettings"]

LocalEngineSettings = EngineOptions
"""The ``[rollout.engine]`` table of the local engine (:class:`~miles.engine.options.EngineOptions`)."""


class LocalEngine(RolloutEngine[EngineOptions]):
    """Miles' own torch engine, ``miles serve``: CPU or GPU, continuous batching, radix cache."""

    name = "local"
    capabilities = EngineCapabilities(
        update_weights_from_disk=True, update_weights_from_tensor=True, routed_experts=True, in_process=True
    )

    def launch(
        self,
        *,
        model_path: str,
        host: str,
        port: int,
        device: str,
        dtype: str,
        devices: list[int],
        rank: int = 0,
        seed: int = 0,
        colocate: bool = False,
    ) -> EngineLaunch:
        """``python -m miles.engine`` flags from the settings (``rank``, ``seed`` and ``colocate`` change
        nothing: requests carry their sampling seeds; memory release works with or without colocation)."""
        where: dict[str, Any] = {"model": Path(model_path), "host": host, "port": port, "device": device}
        where["dtype"] = "auto" if dtype in ("", "auto") else dtype
        serve = ServeOptions.model_construct(**self.settings.model_dump(), **where)
        env = {}
        if device == "cuda" and devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
        return EngineLaunch(
            argv=[sys.executable, "-m", "miles.engine", *to_argv(serve)], url=f"http://{host}:{port}", env=env
        )

    def start_in_process(
        self, *, model_path: str, host: str, device: str, dtype: str, allowed_weight_dirs: Sequence[str] = ()
    ) -> AbstractContextManager[str]:
        """The local engine on background threads of this process (:class:`~miles.engine.launch.InProcessEngine`:
        its scheduler and HTTP server), on a port the OS picks, with the keys of this process's environment
        (:data:`~miles.auth.API_KEY_ENV`: beyond loopback it needs one)."""
        from miles.auth import ServiceKeys
        from miles.engine.weight_paths import parse_weight_dirs

        options = self.settings
        keys = ServiceKeys.from_env()
        serve = ServeOptions(
            **options.model_dump(exclude={"allowed_weight_dirs"}),
            model=model_path,
            host=host,
            port=0,  # the in-process engine binds a port the OS picks
            device=device,
            dtype=dtype,
            allowed_weight_dirs=os.pathsep.join(
                [*map(str, parse_weight_dirs(options.allowed_weight_dirs)), *allowed_weight_dirs]
            ),
            api_key=keys.api_key,
            admin_api_key=keys.admin_api_key,
        )
        return _serving(serve)


@contextmanager
def _serving(serve: ServeOptions) -> Iterator[str]:
    from miles.engine.launch import InProcessEngine

    with InProcessEngine(serve) as engine:
        yield engine.url


@hookimpl
def miles_register_rollout_engines(register: Register) -> None:
    register(LocalEngine)


@hookimpl
def miles_engine_routes(app: FastAPI, engine: object) -> None:
    """The local engine's built-in route groups: distributed weight updates, memory release and sampled
    weights (:mod:`~miles.engine.weight_routes`), ``/update_weights_from_delta``
    (:mod:`~miles.engine.weight_delta`) and LoRA adapters (:mod:`~miles.engine.lora_routes`)."""
    from miles.engine.state import EngineState

    if not isinstance(engine, EngineState):
        return
    from miles.engine.lora_routes import add_lora_routes
    from miles.engine.weight_delta import add_delta_routes
    from miles.engine.weight_routes import add_weight_routes

    add_weight_routes(app, engine)
    add_delta_routes(app, engine)
    add_lora_routes(app, engine)
