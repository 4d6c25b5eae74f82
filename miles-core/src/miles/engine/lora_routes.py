"""HTTP routes of LoRA adapters (see :mod:`miles.engine.lora`): SGLang's ``/load_lora_adapter {lora_name,
lora_path}``, ``/unload_lora_adapter {lora_name}`` and ``GET /v1/models`` (the base model and each adapter,
``root`` the path it came from); ``/load_lora_adapter_from_tensors {lora_name, config_dict,
serialized_tensors, load_format, lora_id}``, SGLang's route with a body of the local engine's own
(``serialized_tensors`` is base64 of a safetensors file and ``load_format`` must be ``safetensors``: no
pickles; SGLang 0.5.23 takes ``serialized_named_tensors``, its pickled payload per TP rank); and Miles'
``/lora_adapters`` (names, paths or ids, and per-tensor checksums, for push verification). The built-in
plugin ``local_engine`` adds them (``miles_engine_routes``)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest

from miles.engine.responses import admin

if TYPE_CHECKING:
    from miles.engine.lora import EngineLoras
    from miles.engine.state import EngineState

__all__ = ["add_lora_routes"]


def add_lora_routes(app: FastAPI, state: EngineState) -> None:
    """Mount ``/load_lora_adapter``, ``/load_lora_adapter_from_tensors``, ``/unload_lora_adapter``,
    ``/lora_adapters`` and SGLang's ``GET /v1/models`` (the base model and each adapter) on ``app``."""

    sched = state.scheduler
    loras: EngineLoras = sched.runner.lora

    on_scheduler = state.on_scheduler

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            name, path = body.get("lora_name"), body.get("lora_path")
            if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
                raise ValueError("lora_name and lora_path are required (strings)")
            path = state.weight_path(path, field="lora_path")
            adapter = await on_scheduler(loras.load, name, path)
            return {"success": True, "message": f"loaded LoRA adapter {name!r}", "num_tensors": len(adapter.checksums)}

        return await admin(request, run)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            name = body.get("lora_name")
            if not isinstance(name, str) or not name:
                raise ValueError("lora_name is required (a string)")
            await on_scheduler(loras.unload, name)
            return {"success": True, "message": f"unloaded LoRA adapter {name!r}"}

        return await admin(request, run)

    @app.post("/load_lora_adapter_from_tensors")
    async def load_lora_adapter_from_tensors(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            import base64

            from safetensors.torch import load as load_safetensors

            name, config, data = body.get("lora_name"), body.get("config_dict"), body.get("serialized_tensors")
            if not isinstance(name, str) or not name or not isinstance(config, dict) or not isinstance(data, str):
                raise ValueError(
                    "lora_name (string), config_dict (object) and serialized_tensors (string) are required"
                )
            if body.get("load_format", "safetensors") != "safetensors":
                raise ValueError("load_format: only 'safetensors' (base64 of a safetensors file; never pickles)")
            try:
                tensors = load_safetensors(base64.b64decode(data, validate=True))
            except Exception as exc:
                raise ValueError(f"serialized_tensors: not base64 of a safetensors file ({exc})") from None
            source = str(body.get("lora_id") or "/load_lora_adapter_from_tensors")
            adapter = await on_scheduler(functools.partial(loras.load_tensors, source=source), name, tensors, config)
            return {"success": True, "message": f"loaded LoRA adapter {name!r}", "num_tensors": len(adapter.checksums)}

        return await admin(request, run)

    async def describe() -> Any:
        return {"adapters": await on_scheduler(loras.describe)}

    @app.get("/v1/models")
    async def models() -> Any:
        # SGLang's (OpenAI's) model list: the base model, then each adapter with the path it came from
        base = str(state.model_path)
        cards = [{"id": base, "object": "model", "root": base, "parent": None}]
        for adapter in await on_scheduler(loras.describe):
            cards.append({"id": adapter["lora_name"], "object": "model", "root": adapter["lora_path"], "parent": base})
        return {"object": "list", "data": cards}

    app.get("/lora_adapters")(describe)
    app.post("/lora_adapters", operation_id="lora_adapters_post")(describe)
