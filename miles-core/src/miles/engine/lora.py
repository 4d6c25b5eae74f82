"""LoRA adapters in the local engine: many adapters over one base model, applied per batch row.

SGLang's protocol: ``/load_lora_adapter {lora_name, lora_path}`` loads a PEFT adapter directory
(``adapter_config.json`` + ``adapter_model.safetensors``), ``/unload_lora_adapter {lora_name}`` drops it,
and ``/generate`` requests pick one with ``lora_path`` (the adapter's name; a list gives one per prompt).
Miles adds ``/lora_adapters`` (the routes: :mod:`miles.engine.lora_routes`): the loaded adapters with a checksum of each tensor, which the ``lora``
transport's verification compares with what the trainer pushed.

Requests of different adapters (and of the base model) share a forward: after each projection the model
runner adds ``scaling * (x A^T) B^T`` of each row's own adapter, for the rows that have one. Requests with
an adapter bypass the prefix cache (their KV depends on the adapter).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from miles.transport.verify import tensor_checksum

__all__ = ["ADAPTER_FILE", "CONFIG_FILE", "EngineLoras", "LoraWeights"]

log = logging.getLogger(__name__)

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


class ServedModel(Protocol):
    """What the adapters need of the model runner (:class:`~miles.engine.model_runner.ModelRunner`)."""

    layers: list[Any]
    device: torch.device
    dtype: torch.dtype
    _fused_mlp: list[torch.Tensor | None]


@dataclass
class LoraWeights:
    """One adapter: ``(layer, module) -> (A [r, in], B [out, r])`` and its scale ``alpha / r``."""

    name: str
    path: str
    scaling: float
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    checksums: dict[str, str] = field(default_factory=dict)
    """PEFT tensor name -> :func:`~miles.transport.verify.tensor_checksum` of the tensor as served."""


class EngineLoras:
    """The adapters a model runner serves, and the adapter of each row of the next forward."""

    def __init__(self, runner: ServedModel) -> None:
        self.runner = runner
        self.adapters: dict[str, LoraWeights] = {}
        self._rows: list[str | None] = []

    @property
    def active(self) -> bool:
        """Whether a row of the next forward has an adapter."""
        return any(name is not None for name in self._rows)

    def set_rows(self, names: Sequence[str | None]) -> None:
        """The adapter of each batch row of the next forward (``None``: the base model)."""
        missing = sorted({n for n in names if n is not None and n not in self.adapters})
        if missing:
            raise ValueError(f"LoRA adapter {', '.join(map(repr, missing))} is not loaded")
        self._rows = list(names)

    def _out_features(self, layer: int, module: str) -> int:
        block = self.runner.layers[layer]
        parent = block.self_attn if module in (*QKV, "o_proj") else block.mlp
        return int(getattr(parent, module).weight.shape[0])

    def delta(self, layer: int, modules: tuple[str, ...], x: torch.Tensor) -> torch.Tensor | None:
        """The adapters' addition to the (fused) output of ``modules`` at ``x`` ``[B, T, in]``, or ``None``."""
        if not self.active:
            return None
        sizes = [self._out_features(layer, m) for m in modules]
        out: torch.Tensor | None = None
        for name in {n for n in self._rows if n is not None}:
            adapter = self.adapters[name]
            pairs = [adapter.modules.get((layer, m)) for m in modules]
            if all(p is None for p in pairs):
                continue
            rows = torch.tensor([i for i, n in enumerate(self._rows) if n == name], device=x.device)
            xs = x.index_select(0, rows)
            parts = [
                xs.new_zeros(*xs.shape[:-1], size) if p is None else F_lora(xs, p[0], p[1], adapter.scaling)
                for p, size in zip(pairs, sizes, strict=True)
            ]
            if out is None:
                out = x.new_zeros(*x.shape[:-1], sum(sizes))
            out.index_copy_(0, rows, torch.cat(parts, dim=-1))
        return out

    # ------------------------------------------------------------------------------------ loading
    def load(self, name: str, path: str | Path) -> LoraWeights:
        """Load the PEFT adapter directory ``path`` as ``name`` (replacing an adapter of that name).

        Errors name the file and tensor; nothing changes on an error.
        """
        from safetensors.torch import load_file

        folder = Path(path)
        config_file, weights_file = folder / CONFIG_FILE, folder / ADAPTER_FILE
        if not config_file.is_file() or not weights_file.is_file():
            raise ValueError(f"{folder}: a LoRA adapter needs {CONFIG_FILE} and {ADAPTER_FILE}")
        config = json.loads(config_file.read_text())
        return self.load_tensors(name, load_file(str(weights_file)), config, source=str(folder))

    def load_tensors(
        self, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any], *, source: str
    ) -> LoraWeights:
        """:meth:`load` from tensors in PEFT naming and the adapter's config (``r``, ``lora_alpha``)."""
        if not name:
            raise ValueError("lora_name is required")
        r, alpha = int(config.get("r", 0)), float(config.get("lora_alpha", 0))
        if r <= 0 or alpha <= 0:
            raise ValueError(f"{source}: {CONFIG_FILE} needs r > 0 and lora_alpha > 0")
        if config.get("use_rslora") or config.get("use_dora"):
            raise ValueError(f"{source}: rsLoRA / DoRA adapters are not supported by the local engine")
        adapter = LoraWeights(name, source, alpha / r)
        halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        device, dtype = self.runner.device, self.runner.dtype
        for tensor_name, tensor in tensors.items():
            match = _NAME.search(tensor_name)
            if match is None:
                raise ValueError(f"{source}: tensor {tensor_name!r} is not a LoRA weight the local engine serves")
            layer, module, half = int(match.group(1)), match.group(2), match.group(3)
            if layer >= len(self.runner.layers) or module not in (*QKV, "o_proj", *GATE_UP, "down_proj"):
                raise ValueError(f"{source}: tensor {tensor_name!r}: no such projection in the served model")
            runner = self.runner  # (a dense MLP: fused, or projection by projection with the invariant ops)
            dense = runner._fused_mlp[layer] is not None or (
                getattr(runner, "invariant", False) and hasattr(runner.layers[layer].mlp, "gate_proj")
            )
            if module in (*GATE_UP, "down_proj") and not dense:
                # (an MoE MLP, or projections holding low-precision weights: the adapter could not apply)
                raise ValueError(f"{source}: tensor {tensor_name!r}: the layer's MLP is not a dense gate/up MLP")
            served = tensor.to(device=device, dtype=dtype)
            halves.setdefault((layer, module), {})[half] = served
            adapter.checksums[tensor_name] = tensor_checksum(served)
        for (layer, module), pair in sorted(halves.items()):
            where = f"{source}: layer {layer} {module}"
            if set(pair) != {"A", "B"}:
                raise ValueError(f"{where}: needs both lora_A and lora_B")
            a, b = pair["A"], pair["B"]
            block = self.runner.layers[layer]
            weight = getattr(block.self_attn if module in (*QKV, "o_proj") else block.mlp, module).weight
            if a.shape != (r, weight.shape[1]) or b.shape != (weight.shape[0], r):
                raise ValueError(
                    f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the weight "
                    f"{tuple(weight.shape)} at r={r}"
                )
            adapter.modules[(layer, module)] = (a, b)
        if not adapter.modules:
            raise ValueError(f"{source}: the adapter holds no LoRA tensors")
        self.adapters[name] = adapter
        log.info("loaded LoRA adapter %r (%d projections, r=%d) from %s", name, len(adapter.modules), r, source)
        return adapter

    def unload(self, name: str) -> None:
        if name not in self.adapters:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        del self.adapters[name]

    def describe(self) -> list[dict[str, Any]]:
        return [
            {"lora_name": a.name, "lora_path": a.path, "scaling": a.scaling, "checksums": dict(a.checksums)}
            for a in self.adapters.values()
        ]


def F_lora(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """PEFT's ``lora_B(lora_A(x)) * scaling``, in the same order of operations."""
    return torch.nn.functional.linear(torch.nn.functional.linear(x, a), b) * scaling
