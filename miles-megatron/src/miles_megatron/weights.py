"""HF-named weights out of (and into) a Megatron model: strict key checks, buckets for the transports and
the safetensors export.

``bridge.export_weights`` (mbridge) is a collective over the model-parallel groups: each tensor is
broadcast from its pipeline stage, all-gathered over tensor parallel (and over expert parallel for
experts) and converted to HF layout (QKV and gate/up split). Every rank iterates; rank 0 keeps.

Two HF layouts exist for MoE experts in transformers 5: the files hold one tensor per expert
(``mlp.experts.<e>.gate_proj.weight`` ...), the in-memory model fuses them (``mlp.experts.gate_up_proj``
``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``). Engines load by in-memory names, so
:func:`iter_runtime_weights` fuses experts when the HF model does; the export writes the file layout.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from miles.training.comm import all_gather_json
from miles.training.hf_export import write_hf_checkpoint

if TYPE_CHECKING:
    from miles.training.adapter import LowRankSpec

__all__ = [
    "check_hf_keys",
    "expected_hf_names",
    "export_adapted_dir",
    "export_hf_dir",
    "hf_file_names",
    "iter_buckets",
    "iter_hf_weights",
    "runtime_fuser",
]

log = logging.getLogger(__name__)

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def hf_file_names(path: str) -> list[str]:
    """Tensor names of a HF safetensors directory (from its index, or from the single file)."""
    from safetensors import safe_open

    src = Path(path)
    index = src / "model.safetensors.index.json"
    if index.exists():
        return sorted(json.loads(index.read_text())["weight_map"])
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src}: no model.safetensors (nor an index of shards)")
    names: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names.extend(f.keys())
    return sorted(names)


def expected_hf_names(bridge: Any, model: Any) -> set[str]:
    """HF tensor names of the whole model (every stage and expert): a collective over the world."""
    from miles_megatron.modules import unwrap

    inner = unwrap(model)
    local_to_global = bridge._weight_name_mapping_mcore_local_to_global(inner)
    names: set[str] = set()
    for local, global_name in local_to_global.items():
        if "_extra_state" in local:
            continue
        names.update(bridge._weight_name_mapping_mcore_to_hf(global_name))
    return {n for part in all_gather_json(sorted(names)) for n in part}


def check_hf_keys(bridge: Any, model: Any, path: str) -> None:
    """Strict: the directory's tensor names equal the model's; the error names the first missing or
    unexpected key (a collective)."""
    expected = expected_hf_names(bridge, model)
    found = set(hf_file_names(path))
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing:
        raise KeyError(f"{path}: weights do not match the model: missing key {missing[0]!r} ({len(missing)} missing)")
    if unexpected:
        raise KeyError(
            f"{path}: weights do not match the model: unexpected key {unexpected[0]!r} ({len(unexpected)} unexpected)"
        )


def iter_hf_weights(bridge: Any, model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` in the file layout, each name once (a collective: every rank iterates
    and receives every tensor)."""
    from miles_megatron.modules import unwrap

    seen: set[str] = set()
    vocab = bridge.vocab_size
    for name, tensor in bridge.export_weights([unwrap(model)]):
        if name in seen:  # tied embeddings: the output layer of the last stage maps to embed_tokens too
            continue
        seen.add(name)
        if vocab is not None and name in ("model.embed_tokens.weight", "lm_head.weight") and tensor.shape[0] > vocab:
            tensor = tensor[:vocab]
        yield name, tensor


def runtime_fuser(hf_config: Any) -> Any:
    """A function mapping the file layout to the in-memory HF layout, or ``None`` when they agree.

    Decided from the HF model itself (built on the meta device): fused experts when it has
    ``mlp.experts.gate_up_proj``.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(hf_config)
    names = {n for n, _ in meta.named_parameters()}
    if not any(n.endswith("mlp.experts.gate_up_proj") for n in names):
        return None
    num_experts = int(hf_config.num_experts)
    return _ExpertFuser(num_experts)


class _ExpertFuser:
    """Collects one layer's per-expert tensors and emits the fused ``gate_up_proj`` / ``down_proj``."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.pending: dict[str, dict[tuple[str, int], torch.Tensor]] = {}

    def __call__(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        match = _EXPERT.match(name)
        if not match:
            return [(name, tensor)]
        prefix, expert, part = match.group(1), int(match.group(2)), match.group(3)
        layer = self.pending.setdefault(prefix, {})
        layer[(part, expert)] = tensor.detach().clone()
        out: list[tuple[str, torch.Tensor]] = []
        experts = range(self.num_experts)
        if all(("gate_proj", e) in layer and ("up_proj", e) in layer for e in experts):
            fused = torch.stack([torch.cat([layer[("gate_proj", e)], layer[("up_proj", e)]], 0) for e in experts])
            out.append((f"{prefix}.gate_up_proj", fused))
            for e in experts:
                del layer[("gate_proj", e)], layer[("up_proj", e)]
        if all(("down_proj", e) in layer for e in experts):
            out.append((f"{prefix}.down_proj", torch.stack([layer.pop(("down_proj", e)) for e in experts])))
        return out


def iter_buckets(
    pairs: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int, *, keep: bool
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``pairs`` into buckets of about ``bucket_bytes``; ranks with ``keep=False`` get empty ones
    (the same number, so that a collective transport stays in step)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = count = 0
    for name, tensor in pairs:
        count += 1
        size += tensor.numel() * tensor.element_size()
        if keep:
            bucket.append((name, tensor.detach().to("cpu", copy=True).contiguous()))
        if size >= bucket_bytes:
            yield bucket
            bucket, size, count = [], 0, 0
    if count:
        yield bucket


def export_hf_dir(
    bridge: Any, model: Any, hf_config: Any, path: str, *, rank: int, bucket_bytes: int, source_dir: str | None
) -> None:
    """Write a HF safetensors directory (shards of about ``bucket_bytes`` + index, ``config.json``,
    tokenizer and generation files copied from ``source_dir``). A collective; rank 0 writes."""
    buckets = iter_buckets(iter_hf_weights(bridge, model), bucket_bytes, keep=rank == 0)
    write_hf_checkpoint(buckets, path, rank=rank, config=hf_config, source_dir=source_dir)


def export_adapted_dir(
    bridge: Any,
    model: Any,
    hf_config: Any,
    path: str,
    *,
    spec: LowRankSpec,
    adapter_config: dict[str, Any],
    rank: int,
    bucket_bytes: int,
    source_dir: str | None,
) -> None:
    """A model with LoRA adapters (:mod:`miles_megatron.lora`): the merged model as a HF directory at
    ``path`` (as :func:`export_hf_dir` writes it) and the adapter alone in ``path/adapter``
    (``adapter_model.safetensors`` + ``adapter_config.json``). A collective; rank 0 writes.

    The merge runs in HF layout on the exported base weights, with the same ``A`` / ``B`` the engines get.
    """
    from safetensors.torch import save_file

    from miles_megatron.lora import gather_adapter, without_adapters

    adapter = gather_adapter(model, spec)
    waiting = {n for n in adapter if n.endswith(".lora_A.weight")}

    def merged() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in iter_hf_weights(bridge, model):
            a_name = spec.tensor_name(name.removesuffix(".weight"), "lora_A")
            if name.endswith(".weight") and a_name in adapter:
                waiting.discard(a_name)
                tensor = spec.merge(tensor, adapter[a_name], adapter[a_name.replace(".lora_A.", ".lora_B.")])
            yield name, tensor
        if waiting:
            raise RuntimeError(f"LoRA merge: no base weight for {sorted(waiting)[0]} ({len(waiting)} adapters)")

    with without_adapters(model):
        buckets = iter_buckets(merged(), bucket_bytes, keep=rank == 0)
        write_hf_checkpoint(buckets, path, rank=rank, config=hf_config, source_dir=source_dir)
    if rank == 0:
        out = Path(path) / "adapter"
        out.mkdir(parents=True, exist_ok=True)
        save_file(adapter, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = {**adapter_config, "base_model_name_or_path": source_dir}
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
