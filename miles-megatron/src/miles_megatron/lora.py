"""LoRA on Megatron-Core's tensor-parallel projections, given as HF/PEFT-named adapter tensors.

PEFT's own Megatron path (``LoraConfig(megatron_config=...)``, ``peft.tuners.lora.tp_layer``) does not run
with peft 0.21.2 and megatron-core 0.16.1: ``dispatch_megatron`` reads ``kwargs["fan_in_fan_out"]``, which
PEFT no longer passes (``KeyError`` in ``get_peft_model``), and ``LoraParallelLinear.forward`` multiplies
the ``(output, bias)`` tuple that Megatron's parallel linears return by the scale (``TypeError``). Past
those, its layers give every adapter parameter the default (replicated) checkpoint sharding, leave the
gradients of the replicated halves unreduced under sequence parallelism, and initialise per shard (a
TP=2 adapter is not the TP=1 one). So this module adds the adapters itself, to the projections Megatron
builds:

- ``linear_qkv`` (HF ``q_proj``, ``k_proj``, ``v_proj`` fused) and ``linear_fc1`` (``gate_proj``,
  ``up_proj``) are column parallel: ``A`` ``[r, in]`` is whole on every rank, ``B`` holds this rank's
  output rows. One ``A`` serves the fused projection, so each HF projection gets that ``A`` and its rows
  of ``B`` — the same function, which the engines load as three (two) ordinary LoRA pairs.
- ``linear_proj`` (``o_proj``) and ``linear_fc2`` (``down_proj``) are row parallel: ``A`` holds this
  rank's input columns, ``B`` ``[out, r]`` is whole.

The adapted layer stays the Megatron module it was (its class is swapped for a subclass that adds the
adapter's output, as FSDP2's ``fully_shard`` does), so names, checkpoint keys and Megatron's code that
reads ``linear_qkv.weight`` are unchanged; ``A`` and ``B`` are its parameters ``lora_A`` / ``lora_B``.
Initial values are drawn whole in HF layout from a generator seeded by the projection's name and cut
into shards, so every parallel layout starts from the same adapter.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from miles.errors import SettingsError
from miles_megatron.modules import unwrap

if TYPE_CHECKING:
    from miles.training.adapter import LowRankSpec

__all__ = [
    "FUSED",
    "LoraLinear",
    "QkvLayout",
    "adapters_off",
    "apply_lora",
    "gather_adapter",
    "lora_modules",
    "megatron_targets",
    "without_adapters",
]

FUSED: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
"""Megatron's projections of a transformer layer and the HF projections each holds (in its row order)."""
_COLUMN = ("linear_qkv", "linear_fc1")
_ATTENTION = ("linear_qkv", "linear_proj")


def megatron_targets(spec: LowRankSpec, hf_config: Any) -> tuple[str, ...]:
    """The Megatron projections that get adapters for ``spec.target_modules`` (HF names).

    Raises :class:`~miles.errors.SettingsError` naming ``train.adapter.target_modules`` for a name the trainer cannot adapt, a
    fused group targeted in part (``q_proj`` without ``k_proj`` ...), or MLP projections of a
    mixture-of-experts model.
    """
    field = "train.adapter.target_modules"
    known = [hf for names in FUSED.values() for hf in names]
    unknown = [t for t in spec.target_modules if t not in known]
    if unknown:
        raise SettingsError(
            f"{field}: {', '.join(unknown)} cannot be adapted by the megatron trainer (it adapts {', '.join(known)})"
        )
    targets: list[str] = []
    for megatron, names in FUSED.items():
        chosen = [n for n in names if n in spec.target_modules]
        if chosen and len(chosen) < len(names):
            raise SettingsError(
                f"{field}: the megatron trainer fuses {', '.join(names)} into one projection ({megatron}) with "
                f"one adapter; target all of them or none (got {', '.join(chosen)})"
            )
        if chosen:
            targets.append(megatron)
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    mlp = [t for t in targets if t not in _ATTENTION]
    if experts and mlp:
        adapted = [n for t in mlp for n in FUSED[t]]
        raise SettingsError(
            f"{field}: {', '.join(adapted)} of a mixture-of-experts model: the megatron trainer adapts its attention "
            "projections only (q_proj, k_proj, v_proj, o_proj)"
        )
    if not targets:
        raise SettingsError(f"{field}: empty; name the projections that get adapters")
    return tuple(targets)


@dataclass(frozen=True)
class QkvLayout:
    """Megatron's row order of the fused QKV projection: per query group, its query heads, then its key
    head, then its value head (the groups split over tensor parallel ranks)."""

    heads: int
    groups: int
    head_dim: int

    def to_megatron(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """HF ``q``, ``k``, ``v`` rows (any trailing width) in Megatron's fused order."""
        per_group = self.heads // self.groups * self.head_dim
        parts = [
            t.reshape(self.groups, rows, -1) for t, rows in ((q, per_group), (k, self.head_dim), (v, self.head_dim))
        ]
        return torch.cat(parts, dim=1).reshape(-1, q.shape[-1])

    def to_hf(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Megatron's fused rows back to HF ``q``, ``k``, ``v``."""
        per_group = self.heads // self.groups * self.head_dim
        grouped = rows.reshape(self.groups, per_group + 2 * self.head_dim, -1)
        width = rows.shape[-1]
        q = grouped[:, :per_group].reshape(-1, width)
        k = grouped[:, per_group : per_group + self.head_dim].reshape(-1, width)
        v = grouped[:, per_group + self.head_dim :].reshape(-1, width)
        return q, k, v


class LoraLinear(nn.Module):
    """The adapter half of an adapted Megatron projection (mixed in before its own class).

    ``forward`` returns the projection's ``(output, bias)`` with ``scaling * B A dropout(x)`` added to
    ``output`` while :attr:`lora_enabled`; the collectives follow the projection's: the column-parallel
    adapter gathers ``x A^T`` over the tensor-parallel group (all-gathers the sequence under sequence
    parallelism), the row-parallel one reduces it (reduce-scatters the sequence).
    """

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    lora_kind: Literal["column", "row"]
    lora_scaling: float
    lora_dropout: float
    lora_enabled: bool
    lora_modules: tuple[str, ...]
    """The HF modules this projection holds (``model.layers.0.self_attn.q_proj`` ...), in row order."""
    lora_gated: bool
    """A ``linear_fc1`` whose rows are this rank's gate rows, then its up rows."""
    sequence_parallel: bool
    tp_group: Any
    _classes: ClassVar[dict[type, type]] = {}

    def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        output, bias = super().forward(input_, *args, **kwargs)
        if not self.lora_enabled:
            return output, bias
        return output + self.lora_delta(input_).to(output.dtype), bias

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        """``scaling * B A dropout(x)`` in this rank's layout of the projection's output."""
        from megatron.core.tensor_parallel import mappings

        if self.training and self.lora_dropout > 0:
            x = F.dropout(x, p=self.lora_dropout, training=True)
        h = F.linear(x.to(self.lora_A.dtype), self.lora_A)
        if self.lora_kind == "column":
            if self.sequence_parallel:
                h = mappings.gather_from_sequence_parallel_region(h, group=self.tp_group)
            else:
                h = mappings.copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        elif self.sequence_parallel:
            h = mappings.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
        else:
            h = mappings.reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        return F.linear(h, self.lora_B) * self.lora_scaling

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple[Any, ...] = (), metadata: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The projection's own entries (unchanged keys) and ``lora_A`` / ``lora_B`` sharded as they are
        held: ``B`` of a column-parallel projection over its rows (gate and up apart, as Megatron shards
        ``linear_fc1``), ``A`` of a row-parallel one over its columns, the whole halves replicated."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        out: dict[str, Any] = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        for part in ("lora_A", "lora_B"):
            out.pop(f"{prefix}{part}", None)
        axis = {"lora_B": 0} if self.lora_kind == "column" else {"lora_A": 1}
        lora = make_sharded_tensors_for_checkpoint(
            {"lora_A": self.lora_A, "lora_B": self.lora_B},
            prefix,
            axis,
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=(metadata or {})["dp_cp_group"],
        )
        if self.lora_gated:
            singleton = (metadata or {}).get("singleton_local_shards", False)
            key = f"{prefix}lora_B"
            lora[key] = apply_swiglu_sharded_factory(lora[key], sharded_offsets, singleton)
        out.update(lora)
        return out


def _adapted_class(base: type) -> type:
    cls = LoraLinear._classes.get(base)
    if cls is None:
        cls = type(f"Lora{base.__name__}", (LoraLinear, base), {"__module__": __name__})
        LoraLinear._classes[base] = cls
    return cls


def lora_modules(model: Any) -> list[LoraLinear]:
    """The adapted projections of ``model`` (DDP-wrapped or not), in module order."""
    return [m for m in unwrap(model).modules() if isinstance(m, LoraLinear)]


def _generator(seed: int, key: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % (1 << 62))


def _uniform(shape: tuple[int, ...], bound: float, gen: torch.Generator) -> torch.Tensor:
    return (torch.rand(shape, generator=gen, dtype=torch.float64) * 2.0 - 1.0).mul(bound).float()


def _initial_a(spec: LowRankSpec, in_features: int, key: str, seed: int) -> torch.Tensor:
    gen = _generator(seed, key)
    if spec.init == "gaussian":
        return (torch.randn((spec.r, in_features), generator=gen, dtype=torch.float64) / spec.r).float()
    return _uniform((spec.r, in_features), 1.0 / math.sqrt(in_features), gen)  # PEFT's Kaiming(a=sqrt(5))


def _initial_b(spec: LowRankSpec, out_features: int, key: str, seed: int) -> torch.Tensor:
    if spec.init != "random":
        return torch.zeros(out_features, spec.r)
    return _uniform((out_features, spec.r), 1.0 / math.sqrt(spec.r), _generator(seed, key))


def _tp() -> tuple[int, int]:
    from megatron.core import parallel_state as mpu

    return mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()


def _qkv_layout(config: Any) -> QkvLayout:
    heads = int(config.num_attention_heads)
    groups = int(config.num_query_groups or heads)
    head_dim = int(config.kv_channels or config.hidden_size // heads)
    return QkvLayout(heads, groups, head_dim)


def apply_lora(model: Any, spec: LowRankSpec, targets: tuple[str, ...], *, bridge: Any, seed: int) -> int:
    """Freeze ``model`` (a ``GPTModel``, not yet wrapped) and add the adapter to its ``targets``
    projections; returns the number of adapted projections on this rank.

    ``bridge`` names the HF modules of each projection; ``seed`` (with each module's name) draws the
    initial values.
    """
    from megatron.core.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        set_defaults_if_not_set_tensor_model_parallel_attributes,
        set_tensor_model_parallel_attributes,
    )

    inner = unwrap(model)
    inner.requires_grad_(False)
    tp_rank, tp_size = _tp()
    layout = _qkv_layout(inner.config)
    count = 0
    for layer in inner.decoder.layers:
        index = int(layer.layer_number) - 1
        for name in targets:
            parent = layer.self_attention if name in _ATTENTION else layer.mlp
            module = getattr(parent, name)
            column = name in _COLUMN
            expected = ColumnParallelLinear if column else RowParallelLinear
            if not isinstance(module, expected):
                raise TypeError(
                    f"train.adapter: layer {index} {name} is a {type(module).__name__}, not Megatron's "
                    f"{expected.__name__} (the megatron trainer adapts the local layer spec's projections)"
                )
            if column and module.gather_output:
                raise TypeError(f"train.adapter: layer {index} {name} gathers its output; not supported")
            if not column and not module.input_is_parallel:
                raise TypeError(f"train.adapter: layer {index} {name} scatters its input; not supported")
            section = "self_attention" if name in _ATTENTION else "mlp"
            hf = [
                n.removesuffix(".weight")
                for n in bridge._weight_name_mapping_mcore_to_hf(f"decoder.layers.{index}.{section}.{name}.weight")
            ]
            if len(hf) != len(FUSED[name]):
                raise ValueError(f"train.adapter: layer {index} {name} maps to {hf}, expected {FUSED[name]}")
            key = f"decoder.layers.{index}.{section}.{name}"
            a_full = _initial_a(spec, int(module.input_size), key, seed)
            if name == "linear_qkv":
                q, k, v = (
                    _initial_b(spec, rows, m, seed)
                    for m, rows in zip(
                        hf,
                        (
                            layout.heads * layout.head_dim,
                            layout.groups * layout.head_dim,
                            layout.groups * layout.head_dim,
                        ),
                        strict=True,
                    )
                )
                a, b = a_full, layout.to_megatron(q, k, v).chunk(tp_size)[tp_rank]
            elif name == "linear_fc1":
                half = int(module.output_size) // 2
                gate, up = (_initial_b(spec, half, m, seed) for m in hf)
                a, b = a_full, torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]])
            else:
                a = a_full.chunk(tp_size, dim=1)[tp_rank]
                b = _initial_b(spec, int(module.output_size), hf[0], seed)
            weight = module.weight
            module.__class__ = _adapted_class(type(module))
            module.lora_A = nn.Parameter(a.to(weight.device, weight.dtype).contiguous())
            module.lora_B = nn.Parameter(b.to(weight.device, weight.dtype).contiguous())
            module.lora_kind = "column" if column else "row"
            module.lora_scaling = spec.scaling
            module.lora_dropout = spec.dropout
            module.lora_enabled = True
            module.lora_modules = tuple(hf)
            module.lora_gated = name == "linear_fc1" and bool(inner.config.gated_linear_unit)
            sharded, whole = (module.lora_B, module.lora_A) if column else (module.lora_A, module.lora_B)
            set_tensor_model_parallel_attributes(sharded, True, 0 if column else 1, 1)
            set_defaults_if_not_set_tensor_model_parallel_attributes(whole)
            # the whole half sees this rank's slice of the sequence: its gradient is summed over the TP group
            whole.sequence_parallel = bool(module.sequence_parallel)
            count += 1
    return count


@contextmanager
def adapters_off(model: Any) -> Iterator[None]:
    """Within: ``model`` computes its base (every adapter off)."""
    modules = lora_modules(model)
    for m in modules:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m in modules:
            m.lora_enabled = True


@contextmanager
def without_adapters(model: Any) -> Iterator[None]:
    """Within: the adapters' parameters are detached from ``model``, whose parameters and state dict are
    then the base model's alone (what mbridge converts, loads and exports)."""
    detached = [(m, m._parameters.pop("lora_A"), m._parameters.pop("lora_B")) for m in lora_modules(model)]
    try:
        yield
    finally:
        for m, a, b in detached:
            m._parameters["lora_A"], m._parameters["lora_B"] = a, b


def _stage_adapter(model: Any) -> dict[str, torch.Tensor]:
    """This pipeline stage's adapter in HF layout (tensor-parallel shards gathered): a collective over
    the tensor-parallel group."""
    from megatron.core import parallel_state as mpu

    from miles.training.comm import all_gather_tensors

    modules = lora_modules(model)
    mine = {
        str(i): (m.lora_B if m.lora_kind == "column" else m.lora_A).detach().float().cpu()
        for i, m in enumerate(modules)
    }
    shards = all_gather_tensors(mine, group=mpu.get_tensor_model_parallel_group())
    layout = _qkv_layout(unwrap(model).config)
    out: dict[str, torch.Tensor] = {}
    for i, m in enumerate(modules):
        parts = [s[str(i)] for s in shards]
        if m.lora_kind == "row":
            a, bs = torch.cat(parts, dim=1), [m.lora_B.detach().float().cpu()]
        else:
            a = m.lora_A.detach().float().cpu()
            if m.lora_gated:
                halves = [p.chunk(2) for p in parts]
                bs = [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
            elif len(m.lora_modules) == 3:
                bs = list(layout.to_hf(torch.cat(parts)))
            else:
                bs = [torch.cat(parts)]
        dtype = m.lora_A.dtype
        for hf, b in zip(m.lora_modules, bs, strict=True):  # each projection its own copy of a shared A
            out[f"{hf}.lora_A"] = a.to(dtype, copy=True).contiguous()
            out[f"{hf}.lora_B"] = b.to(dtype, copy=True).contiguous()
    return out


def gather_adapter(model: Any, spec: LowRankSpec) -> dict[str, torch.Tensor]:
    """The whole adapter in HF layout and PEFT's file naming, on every rank, in layer order: a collective
    over the world (tensor-parallel shards gathered, pipeline stages broadcast)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from miles.training.comm import all_gather_json, broadcast_tensors

    stage = _stage_adapter(model)
    pp = mpu.get_pipeline_model_parallel_world_size()
    if pp > 1:
        stages = all_gather_json(mpu.get_pipeline_model_parallel_rank())
        whole: dict[str, torch.Tensor] = {}
        for s in range(pp):
            src = stages.index(s)  # the lowest global rank of stage s
            whole.update(broadcast_tensors(stage if dist.get_rank() == src else None, src=src))
        stage = whole

    def order(name: str) -> tuple[int, int, str]:
        parts = name.split(".")
        projections = [n for names in FUSED.values() for n in names]
        return int(parts[2]), projections.index(parts[-2]), parts[-1]

    out: dict[str, torch.Tensor] = {}
    for name in sorted(stage, key=order):
        module, part = name.rsplit(".", 1)
        out[spec.tensor_name(module, part)] = stage[name]  # type: ignore[arg-type]
    return out
