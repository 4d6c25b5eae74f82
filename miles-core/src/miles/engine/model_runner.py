"""The model side of the engine: a HF causal LM run layer by layer over preallocated KV buffers.

The weights and the sub-modules (norms, projections, MLP / MoE blocks, rotary embedding) are the HF
model's own, so every supported architecture computes exactly what ``transformers`` computes; only the
attention is driven here, against a KV buffer of shape ``[layers, slots, kv_heads, capacity, head_dim]``
in which running request ``i`` owns slot ``i``. Supported: Llama, Qwen2, Qwen3 (q/k norms), and the
MoE variants Qwen2-MoE / Qwen3-MoE, whose routers are observed to report routed experts; and the
vision-language Qwen2-VL / Qwen2.5-VL, whose vision tower and M-RoPE are the model's own too (images:
:mod:`miles.engine.multimodal`).

On CPU, the dense matmuls of a float32 model, and of a bfloat16 one where the CPU has native bfloat16
(AVX512-BF16 / AMX), run on weights prepacked once in oneDNN's blocked layout (``torch.ops.mkldnn``, the
kernels ``torch.compile``'s CPU freezing uses). In bfloat16 that is the same oneDNN GEMM as ``F.linear``
without reordering the weight on every call, so the results are bit for bit those of ``F.linear``. In
float32 ``F.linear`` runs MKL's sgemm, which on AMD CPUs reaches well under half of oneDNN's rate (measured
2-4x slower on the development machine, at decode and at prefill sizes); the packed GEMM equals it to
float32 rounding, not bit for bit. A packed weight is rebuilt whenever one of its parameters changes
(weight updates bump the parameters' version counters); the packed copies double the dense weights'
memory (:meth:`drop_packed` frees them). On a CPU the projections and the embedding lie in one block on
transparent huge pages, in the order a decode step reads them (:mod:`miles.engine.huge_pages`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from miles.engine.cpu_kernels import (
    ROWS_KEEP_BYTES,
    ROWS_MEASURED,
    measure_rows,
    rows_limit,
    save_rows_limit,
    saved_rows_limit,
)
from miles.engine.invariant import attention as invariant_attention
from miles.engine.invariant import linear as invariant_linear
from miles.engine.invariant import rms_norm as invariant_rms_norm
from miles.engine.invariant import silu as invariant_silu
from miles.engine.lora import GATE_UP, QKV
from miles.engine.multimodal import VISION_MODEL_TYPES, ImageInputs, place_images
from miles.engine.options import ATTENTION_BACKENDS
from miles.engine.packing import PACK_AFTER, PACK_BATCH, plain_linear
from miles.engine.packing import packing_works as _packing_works
from miles.engine.routers import Routers

__all__ = ["ATTENTION_BACKENDS", "SUPPORTED_MODEL_TYPES", "ModelRunner"]

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mistral")
_RMS_NORMS = tuple(
    f"{m}RMSNorm" for m in ("Llama", "Mistral", "Qwen2", "Qwen3", "Qwen2Moe", "Qwen3Moe", "Qwen2VL", "Qwen2_5_VL")
)
"""HF norm classes that compute ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`` (the fused kernel's formula)."""
"""``sdpa``: PyTorch ops only; ``miles_cpu``: decode attention, RMSNorm and rotary on Miles' CPU kernels
(:mod:`miles.engine.cpu_kernels`); ``auto``: the kernels on CPU where they build. Prefill attention always
runs SDPA."""
_SILUS = ("SiLU", "SiLUActivation")
"""Activation modules whose forward is ``F.silu`` (torch's, and HF's ``ACT2FN["silu"]``)."""


class ModelRunner:
    """Loads a HF checkpoint and runs prefill / batched decode over slot-indexed KV buffers."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        attention_backend: str = "auto",
        quantization: str | None = None,
        invariant: bool = False,
        huge_pages: bool = True,
    ) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend: expected one of {', '.join(ATTENTION_BACKENDS)}, got {attention_backend!r}"
            )

        self.model_path = Path(model_path)
        self.device = torch.device(device)
        config = AutoConfig.from_pretrained(self.model_path)
        self.is_vision = config.model_type in VISION_MODEL_TYPES
        """A vision-language model: its prompts may hold images (:mod:`miles.engine.multimodal`)."""
        if config.model_type not in SUPPORTED_MODEL_TYPES + VISION_MODEL_TYPES:
            raise ValueError(
                f"{self.model_path}/config.json: model_type {config.model_type!r} is not supported by the "
                f"local engine (supported: {', '.join(SUPPORTED_MODEL_TYPES + VISION_MODEL_TYPES)})"
            )
        text = config.get_text_config()
        if getattr(text, "use_sliding_window", False):
            raise ValueError(f"{self.model_path}/config.json: sliding-window attention is not supported")
        torch_dtype = getattr(torch, dtype) if dtype != "auto" else None
        auto = AutoModelForImageTextToText if self.is_vision else AutoModelForCausalLM
        self.model = auto.from_pretrained(self.model_path, dtype=torch_dtype or "auto", attn_implementation="sdpa").to(
            self.device
        )
        self.model.eval()
        self.model.requires_grad_(False)
        self.config = config
        self.dtype = next(self.model.parameters()).dtype
        self.pack_weights = self.device.type == "cpu" and _packing_works(self.dtype)
        self.invariant = invariant and self._invariant_works(quantization)
        """Compute with the batch-invariant ops (:mod:`miles.engine.invariant`): rows independent of the batch."""
        self.pack_after = PACK_AFTER if self.dtype == torch.bfloat16 and not self.invariant else 1
        """A weight is packed at its ``pack_after``-th forward of many rows since it changed (before: ``F.linear``,
        bit for bit the packed result in bfloat16; :data:`~miles.engine.packing.PACK_AFTER`); float32 packs at
        once (``F.linear`` runs MKL there, another rounding)."""
        if quantization is not None:  # projections hold and compute with the pushed low-precision weights
            from miles.engine.quantized import quantize_model

            quantize_model(self.model, quantization, pack=PACK_BATCH if self.pack_weights else 0)
        self.text_model: Any = self.model.model.language_model if self.is_vision else self.model.model  # the decoder
        self.layers = list(self.text_model.layers)
        attn0 = self.layers[0].self_attn
        self.head_dim: int = attn0.head_dim
        self.num_heads: int = text.num_attention_heads
        self.num_kv_heads: int = text.num_key_value_heads
        self.group = self.num_heads // self.num_kv_heads
        self.scaling: float = attn0.scaling
        self.vocab_size: int = text.vocab_size
        self.context_length: int = int(getattr(text, "max_position_embeddings", 4096))
        self.routers = Routers(self.layers, invariant=self.invariant)
        """The MoE routers (``routed_experts`` of every forward; none for a dense model)."""
        self.moe_layers, self.topk = self.routers.layers, self.routers.topk
        self._packed: dict[str, tuple[tuple[int, ...], torch.Tensor]] = {}
        self._unpacked: dict[str, tuple[tuple[int, ...], int, int]] = {}
        """Forwards each weight ran plain since it changed (its versions, their count, the last one's number):
        see ``pack_after``."""
        self._forwards = 0
        """Prefills and decode steps so far (a weight's calls in one forward count once)."""
        self.weights_generation = 0
        """Bumped whenever weights change (what encoded images are checked against)."""
        self._fused_qkv: list[tuple[torch.Tensor, torch.Tensor | None] | None] = []
        self._fused_mlp: list[torch.Tensor | None] = []
        self._blocks_args: tuple[list[torch.Tensor | None], list[float]] | None = None
        """The layers' weights and epsilons as ``decode_blocks`` takes them (:meth:`_block_args`, at the first step)."""
        self._dequantized_qkv: list[tuple[Any, ...] | None] = []
        """Per layer: q/k/v as quantized projections that dequantize (one prepacked matmul for the three)."""
        self._dequantized_gate_up: list[tuple[Any, ...] | None] = []
        self.huge_pages = "off (huge_pages = false)"
        """Where the projections and the embedding lie: how much of them on huge pages, or why not there."""
        self._fuse_projections(huge_pages)
        from miles.engine.lora import EngineLoras

        self.lora = EngineLoras(self)
        """LoRA adapters served over this base model, applied per batch row (:mod:`miles.engine.lora`)."""
        from miles.engine.cpu_kernels import resolve_attention_backend

        self.attention_backend = resolve_attention_backend(attention_backend, self.device, self.group, self.head_dim)
        self._ops: Any = None  # Miles' CPU kernels for the fused norm and rotary steps
        if self.attention_backend == "miles_cpu" and self.dtype in (torch.bfloat16, torch.float32) and not invariant:
            from miles.engine.cpu_kernels import load

            self._ops = load()
        rows = self._ops is not None and self.dtype == torch.bfloat16 and self._ops.linear_rows_available()
        saved = saved_rows_limit() if rows else None
        self._rows_max = saved or (1 if rows else 0)
        """bfloat16 linears of up to this many rows (decode at small batch) on the kernel that streams each weight
        once: one row, then up to what :meth:`_choose_rows` measured on this machine."""
        self._rows_pending = rows and saved is None
        self._blocks = rows and all(self._plain_block(i) for i in range(len(self.layers)))
        """Decode steps of up to ``_rows_max`` rows run each layer in one kernel call (``decode_block``, the same
        kernels and rounding as :meth:`_layers`' steps): every layer a plain dense one, fused, without LoRA."""
        self._dense: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        """The dense weight (and bias) of each packed one, kept until :meth:`_choose_rows` has timed both."""
        # KV buffers, allocated and grown on demand
        self.k = self.v = torch.zeros(0)
        self.slots = self.capacity = 0
        self.free_buffers()
        log.info(
            "loaded %s (%s, %d layers, %.1fM params, %s on %s)",
            self.model_path,
            config.model_type,
            len(self.layers),
            sum(p.numel() for p in self.model.parameters()) / 1e6,
            self.dtype,
            self.device,
        )

    # ------------------------------------------------------------------ helpers
    def _invariant_works(self, quantization: str | None) -> bool:
        """Whether the batch-invariant ops serve this model here (else deterministic inference runs each request
        alone on the usual kernels, and says why)."""
        from miles.engine.invariant import engine_unsupported

        reason = engine_unsupported(self.config, self.device, self.dtype, quantization=quantization)
        if reason is not None:
            log.warning("deterministic inference without the batch-invariant ops: %s", reason)
        return reason is None

    def _plain_block(self, i: int) -> bool:
        """Whether layer ``i`` is one ``decode_block`` runs as :meth:`_layers` does: RMSNorms, fused q/k/v and
        gate/up projections (contiguous), plain o / down projections, SiLU, no per-head q / k norm."""
        layer = self.layers[i]
        attn, mlp = layer.self_attn, layer.mlp
        fused, gate_up = self._fused_qkv[i], self._fused_mlp[i]
        return (
            fused is not None
            and gate_up is not None
            and not hasattr(attn, "q_norm")
            and all(type(n).__name__ in _RMS_NORMS for n in (layer.input_layernorm, layer.post_attention_layernorm))
            and plain_linear(attn.o_proj)
            and plain_linear(mlp.down_proj)
            and type(mlp.act_fn).__name__ in _SILUS
            and all(w.is_contiguous() for w in (fused[0], gate_up, attn.o_proj.weight, mlp.down_proj.weight))
        )

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @torch.no_grad()
    def _fuse_projections(self, huge_pages: bool) -> None:
        """Concatenate q/k/v (and dense gate/up) weights into one matrix per layer, and re-point the HF
        parameters at views of it: one matmul instead of three, and weight loads (which copy into the
        parameters) update the fused matrices too. With ``huge_pages`` on a CPU where the kernel offers them,
        the fused matrices, the other projections and the embedding (the tied head) are placed in one block on
        transparent huge pages (:mod:`miles.engine.huge_pages`), the same values in the same layout."""
        from miles.engine.huge_pages import (
            SMALLEST,
            WeightArena,
            huge_page_bytes,
            huge_pages_unavailable,
            slice_bytes,
        )

        def plain(*modules: Any) -> bool:  # quantized projections run their own forward, unfused; invariant: each
            return not self.invariant and all(plain_linear(m) for m in modules)  # alone, as the trainer computes

        def dequantized(*modules: Any) -> tuple[Any, ...] | None:
            """``modules`` if all are quantized projections computing on dequantized, prepacked weights."""
            return modules if all(getattr(m, "pack", 0) for m in modules) else None

        # per layer, in the order a decode step reads them: q/k/v (fused), o, gate/up (fused), down; a plain
        # projection not fused with another ("o", "down") is placed in the arena as it is, or left where it is
        rows: list[dict[str, list[torch.nn.Linear]]] = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
            self._dequantized_qkv.append(dequantized(*qkv))
            dense = all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))
            no_bias = dense and mlp.gate_proj.bias is None and mlp.up_proj.bias is None
            self._dequantized_gate_up.append(dequantized(mlp.gate_proj, mlp.up_proj) if no_bias else None)
            row: dict[str, list[torch.nn.Linear]] = {}
            if plain(*qkv):
                row["qkv"] = list(qkv)
            if plain(attn.o_proj):
                row["o"] = [attn.o_proj]
            if no_bias and plain(mlp.gate_proj, mlp.up_proj) and plain_linear(mlp.down_proj):
                row["gate_up"] = [mlp.gate_proj, mlp.up_proj]
                if plain(mlp.down_proj):
                    row["down"] = [mlp.down_proj]
            rows.append(row)
        embeddings = [self.text_model.embed_tokens.weight]
        if self.model.lm_head.weight is not embeddings[0] and plain_linear(self.model.lm_head):
            embeddings.append(self.model.lm_head.weight)

        arena = None
        why = "off (huge_pages = false)" if not huge_pages else huge_pages_unavailable()
        if why is None and self.device.type != "cpu":
            why = f"off (the weights are on {self.device.type})"
        if why is None:
            linears = [lin for row in rows for group in row.values() for lin in group]
            tensors = [t for lin in linears for t in (lin.weight, lin.bias) if t is not None] + embeddings
            total = sum(slice_bytes(t.shape, t.dtype) for t in tensors)
            if total >= SMALLEST:
                arena = WeightArena(total)
            else:
                why = f"off (the weights, {total / 2**20:.1f} MiB, are under {SMALLEST >> 20} MiB)"

        def fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
            def joined(parts: list[torch.Tensor]) -> torch.Tensor:
                if arena is None:
                    return torch.cat(parts)
                return torch.cat(
                    parts, out=arena.take((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), parts[0].dtype)
                )

            weight = joined([lin.weight for lin in linears])
            sizes = [lin.weight.shape[0] for lin in linears]
            bias = None
            if all(lin.bias is not None for lin in linears):
                bias = joined([lin.bias for lin in linears])
            offset = 0
            for lin, size in zip(linears, sizes, strict=True):
                lin.weight.data = weight[offset : offset + size]
                if bias is not None:
                    lin.bias.data = bias[offset : offset + size]
                offset += size
            return weight, bias

        for row in rows:
            placed = {key: fuse(group) for key, group in row.items() if arena is not None or key in ("qkv", "gate_up")}
            self._fused_qkv.append(placed.get("qkv"))
            self._fused_mlp.append(placed["gate_up"][0] if "gate_up" in placed else None)
        if arena is None:
            self.huge_pages = why or "off"
            return
        for weight in embeddings:
            weight.data = arena.take(weight.shape, weight.dtype).copy_(weight)
        on = min(huge_page_bytes(arena.bytes), arena.used)  # (its mapping's: the block and a page around it)
        self.huge_pages = f"{on / 2**20:.0f} of {arena.used / 2**20:.0f} MiB of weights on 2 MiB pages"
        log.info("huge pages: %s", self.huge_pages)

    def _dequantized_linear(self, key: str, x: torch.Tensor, modules: tuple[Any, ...]) -> torch.Tensor:
        """One prepacked matmul over the dequantized weights of quantized projections (q/k/v, gate/up),
        rebuilt when any of their parts changes: what the unquantized model's fused projections do."""
        sources = tuple(p for m in modules for p in m.parts().values())
        versions = tuple(p._version for p in sources)
        entry = self._packed.get(key)
        if entry is None or entry[0] != versions:
            weight = torch.cat([m.dense_weight() for m in modules])
            entry = (versions, torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH))
            self._packed[key] = entry
        biases = [m.bias for m in modules]
        bias = torch.cat(biases) if all(b is not None for b in biases) else None
        return torch.ops.mkldnn._linear_pointwise(x, entry[1], bias, "none", [], "")

    def _linear(
        self, key: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sources: tuple[Any, ...]
    ) -> torch.Tensor:
        """``F.linear(x, weight, bias)``, on a prepacked weight when packing is on (``sources``: the
        parameters ``weight`` is built from, whose versions say when to repack); bfloat16 rows up to
        ``_rows_max`` on Miles' row kernel."""
        if x.numel() <= self._rows_max * x.shape[-1] and weight.is_contiguous():
            out: torch.Tensor = self._ops.linear_rows(x.reshape(-1, x.shape[-1]).contiguous(), weight, bias)
            return out.view(*x.shape[:-1], -1)
        if not self.pack_weights:
            return invariant_linear(x, weight, bias) if self.invariant else F.linear(x, weight, bias)
        versions = tuple(p._version for p in sources)
        entry = self._packed.get(key)
        if entry is None or entry[0] != versions:
            if self._still_plain(key, versions):
                return F.linear(x, weight, bias)
            entry = (versions, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH))
            self._packed[key] = entry
            if self._rows_pending and weight.is_contiguous():
                self._dense[key] = (weight.detach(), bias)
        if self.invariant:  # the packed weight gives the plain one's bits (:mod:`miles.engine.invariant`)
            return invariant_linear(x, entry[1], bias)
        return torch.ops.mkldnn._linear_pointwise(x, entry[1], bias, "none", [], "")

    def _still_plain(self, key: str, versions: tuple[int, ...]) -> bool:
        """Whether this call of ``key``'s weight (at ``versions``) runs on the plain weight: in one of the first
        ``pack_after - 1`` forwards since the weight changed (counted here; calls within a forward count once).
        Never while the row limit is still to be measured: :meth:`_choose_rows` times the packed weights."""
        if self._rows_pending:
            return False
        seen = self._unpacked.get(key)
        count = 1 if seen is None or seen[0] != versions else seen[1] + (seen[2] != self._forwards)
        if count >= self.pack_after:
            self._unpacked.pop(key, None)
            return False
        self._unpacked[key] = (versions, count, self._forwards)
        return True

    def _proj(self, module: Any, x: torch.Tensor) -> torch.Tensor:
        """A projection module's output: through :meth:`_linear` (``invariant``) or its own forward."""
        if self.invariant and plain_linear(module):
            return self._linear(f"p{id(module)}", x, module.weight, module.bias, (module.weight,))
        out: torch.Tensor = module(x)
        return out

    def _with_lora(self, y: torch.Tensor, layer: int, modules: tuple[str, ...], x: torch.Tensor) -> torch.Tensor:
        """``y`` plus the LoRA adapters' addition of each row that has one (``y`` itself when none does)."""
        extra = self.lora.delta(layer, modules, x)
        return y if extra is None else y + extra

    def _choose_rows(self) -> None:
        """Up to how many rows the row kernel runs the bfloat16 linears: timed against oneDNN on this model's
        weights (:func:`~miles.engine.cpu_kernels.measure_rows`) at the first forward of a few rows after the
        weights were packed, by the first engine on this machine (later ones read what it kept). On an AMD EPYC
        (AVX-512 BF16, no AMX) the kernel won at 2, 4 and 8 rows (decode 1.1-1.35x); on a Xeon with AMX oneDNN
        was as fast from two rows before the kernel prefetched."""
        weights = [(w, self._packed[key][1], b) for key, (w, b) in self._dense.items() if key in self._packed]
        self._rows_pending = False
        self._dense.clear()
        times, swept = measure_rows(weights)
        self._rows_max = rows_limit(times)
        kept = (
            f"kept for every engine on this machine in {save_rows_limit(self._rows_max, times)}"
            if swept >= ROWS_KEEP_BYTES
            else f"not kept: {swept / 2**20:.0f} MB of weights fit in a cache"
        )
        log.info(
            "bfloat16 linears of up to %d row(s) on Miles' row kernel (a sweep over %.0f MB of the weights at %s "
            "rows: kernel %s ms, oneDNN %s ms; %s)",
            self._rows_max,
            swept / 2**20,
            "/".join(str(m) for m in times),
            "/".join(f"{k * 1e3:.1f}" for k, _ in times.values()),
            "/".join(f"{d * 1e3:.1f}" for _, d in times.values()),
            kept,
        )

    def drop_packed(self) -> None:
        """Free the packed weights, and the quantized projections' dequantized ones (memory release; they are
        rebuilt on the next forward)."""
        self._packed.clear()
        self._unpacked.clear()
        self._dense.clear()
        self.weights_generation += 1
        for module in self.model.modules():
            drop = getattr(module, "drop_cache", None)
            if drop is not None:
                drop()

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V of one token position over all layers."""
        return 2 * len(self.layers) * self.num_kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    def fit(self, slots: int, length: int) -> None:
        """When nothing runs: free the KV buffers if they are over 4x the size that ``slots`` requests of
        ``length`` tokens need (a past long batch must not hold memory forever); the next :meth:`ensure`
        allocates what is needed. Buffers that fit are kept, so a steady workload never reallocates."""
        if self.slots * self.capacity > 4 * max(slots, 1) * max(length, 1):
            self.free_buffers()

    def free_buffers(self) -> int:
        """Drop the KV buffers (the next :meth:`ensure` allocates again); returns the bytes freed."""
        freed = (self.k.numel() * self.k.element_size()) + (self.v.numel() * self.v.element_size())
        self.k = torch.zeros(0, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(0, dtype=self.dtype, device=self.device)
        self.slots = self.capacity = 0
        return freed

    def ensure(self, slots: int, length: int) -> None:
        """Grow the KV buffers to hold ``slots`` requests of ``length`` tokens (doubling)."""
        if slots <= self.slots and length <= self.capacity:
            return
        new_slots = max(self.slots, 1)
        while new_slots < slots:
            new_slots *= 2
        new_cap = max(self.capacity, 1)
        while new_cap < length:
            new_cap *= 2
        new_cap = min(new_cap, max(length, self.context_length))
        shape = (len(self.layers), new_slots, self.num_kv_heads, new_cap, self.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.slots:
            k[:, : self.slots, :, : self.capacity] = self.k
            v[:, : self.slots, :, : self.capacity] = self.v
        self.k, self.v, self.slots, self.capacity = k, v, new_slots, new_cap

    # ---------------------------------------------------------------- KV moves
    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` cached positions of slot ``src`` into slot ``dst``."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def load_prefix(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write cached KV (``[layers, kv_heads, n, head_dim]``) at positions ``0..n-1`` of ``slot``."""
        n = k.shape[2]
        self.ensure(slot + 1, n + 1)
        self.k[:, slot, :, :n] = k
        self.v[:, slot, :, :n] = v

    def read_kv(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the first ``length`` cached positions of ``slot``."""
        return self.k[:, slot, :, :length], self.v[:, slot, :, :length]

    # ----------------------------------------------------------------- forward
    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of ``x`` ``[B, T, heads, head_dim]``: the formula and the rounding of HF's
        ``apply_rotary_pos_emb`` (``x * cos + rotate_half(x) * sin``, shared by every supported model), in
        one fused CPU kernel where available (bit for bit the same)."""
        if self._ops is not None:
            return self._ops.rotary(x, cos, sin)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos) + (rotated * sin)

    def _norm(self, norm: Any, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x + delta`` (the residual stream) and the norm of it: one fused CPU kernel for HF's RMSNorm where
        available (``x`` updated in place; bit for bit in bfloat16, to float32 rounding in float32 — the sum
        of squares is summed in another order), else the HF module."""
        if self._ops is not None and type(norm).__name__ in _RMS_NORMS:
            if delta is not None and not delta.is_contiguous():
                delta = delta.contiguous()
            return x, self._ops.rms_norm(x, delta, norm.weight, norm.variance_epsilon)
        if delta is not None:
            x = x + delta
        if self.invariant and type(norm).__name__ in _RMS_NORMS:
            return x, invariant_rms_norm(x, norm.weight, norm.variance_epsilon)
        return x, norm(x)

    def _head_norm(self, norm: Any, x: torch.Tensor) -> torch.Tensor:
        """Qwen3's per-head q / k norm."""
        if self.invariant and type(norm).__name__ in _RMS_NORMS:
            return invariant_rms_norm(x, norm.weight, norm.variance_epsilon)
        out: torch.Tensor = norm(x)
        return out

    def _layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        step: tuple[int, torch.Tensor, int] | None = None,
    ) -> torch.Tensor:
        """Run the decoder on ``x`` ``[B, T, hidden]`` (a fresh tensor: the residual stream is updated in
        place); ``attend(layer, q, k, v)`` stores k/v and attends. ``step``: a decode step on the attention
        kernel (first slot, positions, span), which runs each layer in one kernel call where it can."""
        base = self.text_model
        cos, sin = base.rotary_emb(x, positions)
        b, t = x.shape[:2]
        if self._rows_pending and 1 < b * t <= ROWS_MEASURED[-1] and self._dense:
            self._choose_rows()
        delta: torch.Tensor | None = None  # the last block's output, added to the residual by the next norm
        if step is not None and self._blocks and b * t <= self._rows_max and not self.lora.active:
            return self._decode_blocks(x, cos, sin, *step)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x, h = self._norm(layer.input_layernorm, x, delta)
            fused, dequantized = self._fused_qkv[i], self._dequantized_qkv[i]
            if fused is None and dequantized is not None:
                qkv = self._dequantized_linear(f"qkv{i}", h, dequantized)
            elif fused is None:
                qkv = torch.cat(
                    [self._proj(attn.q_proj, h), self._proj(attn.k_proj, h), self._proj(attn.v_proj, h)], -1
                )
            else:
                sources = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
                qkv = self._linear(f"qkv{i}", h, fused[0], fused[1], sources)
            qkv = self._with_lora(qkv, i, QKV, h)
            qkv = qkv.view(b, t, -1, self.head_dim)  # [B, T, heads + 2 x kv_heads, head_dim]
            heads = self.num_heads
            if hasattr(attn, "q_norm"):
                q, k = (
                    self._rotate(self._head_norm(attn.q_norm, qkv[:, :, :heads]), cos, sin),
                    self._rotate(self._head_norm(attn.k_norm, qkv[:, :, heads : heads + self.num_kv_heads]), cos, sin),
                )
            else:  # queries and keys rotated in one go
                qk = self._rotate(qkv[:, :, : heads + self.num_kv_heads], cos, sin)
                q, k = qk[:, :, :heads], qk[:, :, heads:]
            v = qkv[:, :, heads + self.num_kv_heads :]
            out = attend(i, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            o, attn_out = attn.o_proj, out.transpose(1, 2).reshape(b, t, -1)
            o_out = self._linear(f"o{i}", attn_out, o.weight, o.bias, (o.weight,)) if plain_linear(o) else o(attn_out)
            delta = self._with_lora(o_out, i, ("o_proj",), attn_out)
            x, h = self._norm(layer.post_attention_layernorm, x, delta)
            gate_up, dequantized = self._fused_mlp[i], self._dequantized_gate_up[i]
            if gate_up is None and dequantized is None and self.invariant and hasattr(layer.mlp, "gate_proj"):
                mlp = layer.mlp  # a dense MLP, projection by projection, with the invariant SiLU (and adapters)
                gu = torch.cat([self._proj(mlp.gate_proj, h), self._proj(mlp.up_proj, h)], -1)
                g, u = self._with_lora(gu, i, GATE_UP, h).chunk(2, -1)
                act = invariant_silu(g) * u
                delta = self._with_lora(self._proj(mlp.down_proj, act), i, ("down_proj",), act)
            elif gate_up is None and dequantized is None:
                delta = layer.mlp(h)
            else:
                mlp = layer.mlp
                if gate_up is None:
                    assert dequantized is not None
                    gu = self._dequantized_linear(f"gu{i}", h, dequantized)
                else:
                    gu = self._linear(f"gu{i}", h, gate_up, None, (mlp.gate_proj.weight, mlp.up_proj.weight))
                g, u = self._with_lora(gu, i, GATE_UP, h).chunk(2, -1)
                down, act = mlp.down_proj, mlp.act_fn(g) * u
                down_out = (
                    self._linear(f"down{i}", act, down.weight, down.bias, (down.weight,))
                    if plain_linear(down)
                    else down(act)
                )
                delta = self._with_lora(down_out, i, ("down_proj",), act)
        return self._norm(base.norm, x, delta)[1]

    def _decode_blocks(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, first_slot: int, pos: torch.Tensor, span: int
    ) -> torch.Tensor:
        """:meth:`_layers` for a decode step of plain layers on the row kernel: every layer one ``decode_block``
        (the same kernels and ATen ops in the same order: the same bits), all in one call, then the final norm."""
        weights, eps = self._block_args()
        delta = self._ops.decode_blocks(
            x, cos, sin, self.num_heads, self.num_kv_heads, self.k, self.v, first_slot, pos, span, self.scaling,
            weights, eps,
        )  # fmt: skip
        return self._norm(self.text_model.norm, x, delta)[1]

    def _block_args(self) -> tuple[list[torch.Tensor | None], list[float]]:
        """Every layer's weights and norm epsilons as ``decode_blocks`` takes them, gathered once: a decode step of
        SmolLM2 looked up some 440 module attributes (``nn.Module.__getattr__``, about a microsecond each) and
        called ``decode_block`` 30 times from Python to pass the same tensors (bfloat16 steps, interleaved in one
        process on an Intel Xeon without AMX: 12.6 -> 11.9 ms at one row, 20.5 -> 19.7 ms at eight, the same
        logits, from the gathering alone). Weight loads copy into these tensors and a release empties and refills
        their storage, so they hold for the runner's life (the layers' modules are not replaced)."""
        if self._blocks_args is None:
            weights: list[torch.Tensor | None] = []
            eps: list[float] = []
            for i, layer in enumerate(self.layers):
                attn, mlp = layer.self_attn, layer.mlp
                norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
                fused = self._fused_qkv[i]
                assert fused is not None  # (every layer's, where _blocks)
                weights += [norm1.weight, fused[0], fused[1], attn.o_proj.weight, attn.o_proj.bias, norm2.weight,
                            self._fused_mlp[i], mlp.down_proj.weight, mlp.down_proj.bias]  # fmt: skip
                eps += [norm1.variance_epsilon, norm2.variance_epsilon]
            self._blocks_args = (weights, eps)
        return self._blocks_args

    @torch.inference_mode()
    def prefill(
        self,
        first_slot: int,
        chunks: list[list[int]],
        starts: list[int],
        want_logits: list[bool],
        images: list[ImageInputs | None] | None = None,
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Feed ``chunks[b]`` at positions ``starts[b]..`` of slot ``first_slot + b`` (earlier positions of
        each slot already hold its cached prefix), all in one padded forward. ``images[b]``: the images of
        chunk ``b``'s prompt (encoded, :meth:`encode_images`): their embeddings replace the chunk's
        placeholder tokens and their M-RoPE positions its rotary positions.

        Returns, per chunk, fp32 logits ``[n, vocab]`` (where ``want_logits``) and routed experts
        ``[n, layers, topk]`` (MoE models).
        """
        self._forwards += 1
        bsz = len(chunks)
        lengths = [len(c) for c in chunks]
        longest = max(lengths)
        self.ensure(first_slot + bsz, max(starts) + longest + 1)
        ids = torch.zeros(bsz, longest, dtype=torch.long, device=self.device)
        for b, chunk in enumerate(chunks):
            ids[b, : len(chunk)] = torch.tensor(chunk, dtype=torch.long)
        start_t = torch.tensor(starts, dtype=torch.long, device=self.device)
        positions = start_t[:, None] + torch.arange(longest, device=self.device)[None, :]
        span = int(positions.max()) + 1
        slots = slice(first_slot, first_slot + bsz)
        rows = torch.arange(first_slot, first_slot + bsz, device=self.device)[:, None]
        # every chunk from position 0: causal attention is exact for each chunk's own queries (a padded
        # query past a chunk's end attends junk, but nothing reads its output or its KV before decode
        # overwrites it); otherwise an additive mask, built once for all layers
        causal = all(start == 0 for start in starts)
        mask = None
        if not causal:
            keys_at = torch.arange(span, device=self.device)
            mask = self._additive((keys_at[None, None, :] <= positions[:, :, None])[:, None])  # [B, 1, T, L]

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # padded query positions write junk beyond a chunk's end; decode overwrites it before use
            self.k[i][rows, :, positions] = k.transpose(1, 2)
            self.v[i][rows, :, positions] = v.transpose(1, 2)
            keys = self.k[i, slots, :, :span]
            values = self.v[i, slots, :, :span]
            if self.invariant:
                return invariant_attention(q, keys, values, positions, self.scaling)
            return F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, is_causal=causal, scale=self.scaling, enable_gqa=True
            )

        x = self.text_model.embed_tokens(ids)
        rotary = positions
        if images is not None and any(i is not None for i in images):
            rotary = place_images(x, positions, starts, lengths, images)
        hidden = self._layers(x, rotary, attend)
        logits: list[torch.Tensor | None] = []
        for b, n in enumerate(lengths):
            logits.append(self._lm_head(hidden[b, :n]) if want_logits[b] else None)
        routed = self.routers.take()
        experts: list[torch.Tensor | None] = [None] * bsz
        if routed is not None:
            routed = routed.view(bsz, longest, *routed.shape[1:])
            experts = [routed[b, :n] for b, n in enumerate(lengths)]
        return logits, experts

    @torch.inference_mode()
    def decode(
        self, tokens: list[int], positions: list[int], first_slot: int = 0, rope_deltas: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token for each of the requests in slots ``first_slot..`` (``tokens[i]`` at ``positions[i]``;
        at rotary position ``positions[i] + rope_deltas[i]``, M-RoPE's offset after a prompt's images).

        Attention spans the longest request's positions only, so a single request (deterministic
        inference) attends over exactly its own KV. Returns fp32 logits ``[B, vocab]`` and routed experts
        ``[B, layers, topk]``.
        """
        b = len(tokens)
        self._forwards += 1
        longest = max(positions) + 1
        self.ensure(first_slot + b, longest + 1)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        rows = torch.arange(first_slot, first_slot + b, device=self.device)
        kernel = self.attention_backend == "miles_cpu" and not self.invariant
        if kernel:
            from miles.engine.cpu_kernels import decode_attention
        # SDPA: no mask when every request attends over the same span (uniform lengths); else an additive one
        mask = None
        if not kernel and not self.invariant and min(positions) != longest - 1:
            mask = self._additive(
                (torch.arange(longest, device=self.device)[None, :] <= pos[:, None])[:, None, None, :]
            )
        g = self.group

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if kernel:  # writes k / v into the cache too
                keys, values = self.k[i, first_slot : first_slot + b], self.v[i, first_slot : first_slot + b]
                out = decode_attention(q[:, :, 0], keys, values, k[:, :, 0], v[:, :, 0], pos, longest, self.scaling)
                return out[:, :, None]
            self.k[i, rows, :, pos] = k[:, :, 0]
            self.v[i, rows, :, pos] = v[:, :, 0]
            keys = self.k[i, first_slot : first_slot + b, :, :longest]
            values = self.v[i, first_slot : first_slot + b, :, :longest]
            if self.invariant:
                return invariant_attention(q, keys, values, pos[:, None], self.scaling)
            # grouped-query attention without repeating K/V: a head group is a query block
            qg = q.reshape(b, self.num_kv_heads, g, self.head_dim)
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=self.scaling)
            return out.reshape(b, self.num_heads, 1, self.head_dim)

        x = self.text_model.embed_tokens(ids)
        rotary = pos if not rope_deltas or not any(rope_deltas) else pos + torch.tensor(rope_deltas, device=self.device)
        hidden = self._layers(x, rotary[:, None], attend, (first_slot, pos, longest) if kernel else None)
        logits = self._lm_head(hidden[:, 0])
        return logits, self.routers.take()

    @torch.inference_mode()
    def encode_images(self, prompts: list[ImageInputs]) -> None:
        """Run the vision tower once over the images of ``prompts``: the embeddings of their placeholders."""
        grid = torch.cat([p.grid_thw for p in prompts]).to(self.device)
        pixels = torch.cat([p.pixel_values for p in prompts]).to(self.device)
        per_image = list(self.model.model.get_image_features(pixels, grid, return_dict=True).pooler_output)
        for inputs in prompts:
            mine, per_image = per_image[: len(inputs.hashes)], per_image[len(inputs.hashes) :]
            inputs.embeds, inputs.weights = torch.cat(mine).to(self.dtype), self.weights_generation

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """A boolean attention mask as an additive one in the model's dtype (0 / -inf): SDPA converts a
        boolean mask on every call, i.e. once per layer."""
        return torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill_(~allowed, float("-inf"))

    def _lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits."""
        head = self.model.lm_head
        return self._linear("lm_head", hidden, head.weight, head.bias, (head.weight,)).float()

    # ----------------------------------------------------------------- weights
    @torch.inference_mode()
    def load_weights(self, model_path: str | Path) -> int:
        """Copy every tensor of the safetensors files in ``model_path`` into the model (by HF name).

        Raises ``ValueError`` naming the file and tensor on an unknown name or a shape mismatch, before
        any weight is changed. Returns the number of tensors loaded.
        """
        from miles.engine.weight_copy import safetensors_tensors

        return self._copy_in(safetensors_tensors(model_path))

    @torch.no_grad()
    def load_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]], *, source: str = "weights") -> int:
        """:meth:`load_weights` from ``(HF name, tensor)`` pairs in memory (``source`` names them in errors):
        the trainer's replica of the engine (``train.true_on_policy``) takes its weights this way (not in inference
        mode: ``tensors`` may be produced lazily, by collectives on the trainer's own tensors)."""
        return self._copy_in([(source, name, tensor) for name, tensor in tensors])

    def _copy_in(self, named: list[tuple[str, str, torch.Tensor]]) -> int:
        from miles.engine.weight_copy import copy_in

        count = copy_in(self.model, named, vision=self.is_vision)
        self.weights_generation += 1
        if getattr(self.config, "tie_word_embeddings", False):
            self.model.tie_weights()
        return count
