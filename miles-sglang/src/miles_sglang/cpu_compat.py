"""SGLang 0.5.23 on a CPU: what Miles adds so that its Python side runs on the CPU kernels built from
``third_party/sgl-kernel-cpu`` and beside PyPI's torchvision.

The SGLang CPU environment (``scripts/sglang/cpu_env.py``) puts a ``.pth`` file in its site-packages that
calls :func:`install` at every interpreter start, so the server and the scheduler and detokenizer processes
SGLang spawns all have it. :func:`install` only adds an import hook (no torch import); the work happens when
the hooked modules are imported:

- ``sgl_kernel`` (the CPU kernels, which predate 0.5.23's Python side): once it has loaded, the ops 0.5.23
  calls with another schema get an overload with that schema (:func:`register_kernel_ops`):

  * ``decode_attention_cpu`` and ``extend_attention_cpu``: 0.5.23 passes ``key_scale`` / ``value_scale``
    (fp8 KV cache) and, to extend, ``is_causal`` (``layers/attention/intel_amx_backend.py``); the overload
    forwards to the kernel when those say what the kernel does (scales of 1.0; causal self-attention,
    non-causal cross-attention) and refuses anything else with an error naming the argument;
  * ``murmur_hash32_cpu`` (seeded sampling, ``kernels/ops/sampling/murmur_hash.py``), which the kernels lack:
    :func:`murmur_hash32`, the Triton kernel's hash in torch.

  A kernel built from a newer source that has these schemas is left alone.
- ``sglang.srt.mem_cache.pool_host.common``: SGLang page-locks host buffers for CUDA copies
  (``_cuda_host_register``: ``torch.cuda.cudart().cudaHostRegister``) whatever the device — the routed-experts
  capturer of ``--enable-return-routed-experts`` does so at start, and a CPU torch then fails with "Torch not
  compiled with CUDA enabled". Page-locking has no purpose without a GPU: where torch has no CUDA,
  :func:`host_register_on_cpu` takes its place and records that nothing was registered (so SGLang's own
  unregistering finds nothing to undo).
- ``sglang.srt.lora.*``: SGLang's LoRA layers and backends allocate page-locked host tensors unconditionally
  (``torch.tensor(..., pin_memory=True)``, ``tensor.pin_memory()``), which a CPU torch refuses ("pin_memory=True
  requires a CUDA or other accelerator backend"): ``--enable-lora`` killed the server at start. Where torch has
  no CUDA, :func:`unpin_on_cpu` makes those requests allocate ordinary memory, in the process that imports
  SGLang's LoRA package (a request that can only fail on such a torch, so nothing that worked changes).
- ``torchvision._meta_registrations``: PyPI's torchvision is built against CUDA, so its C++ ops do not load
  beside a CPU torch, and its meta-kernel module then fails at import (``operator torchvision::nms does not
  exist``) — SGLang imports ``torchvision.transforms`` unconditionally. When the ops did not load, that module
  is replaced by an empty one: there is nothing to give meta kernels to, and torchvision's own operators still
  say that its C++ ops are missing when called.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import types
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "COMPAT_OVERLOAD",
    "HOST_POOL_MODULE",
    "LORA_PACKAGE",
    "host_register_on_cpu",
    "install",
    "installed",
    "murmur_hash32",
    "patch_host_pool",
    "register_kernel_ops",
    "unpin_on_cpu",
]

log = logging.getLogger(__name__)

COMPAT_OVERLOAD = "sglang_0_5_23"
"""The overload name under which the attention ops get SGLang 0.5.23's schema."""

_DECODE_SCHEMA = (
    "decode_attention_cpu.sglang_0_5_23(Tensor query, Tensor k_cache, Tensor v_cache, float key_scale, "
    "float value_scale, Tensor(a!) output, Tensor? key, Tensor? value, Tensor loc, Tensor attn_logits, "
    "Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, float sm_scale, float logit_cap, "
    "bool is_cross_attn, int sliding_window_size, Tensor? encoder_lens, Tensor? sinks) -> ()"
)
_EXTEND_SCHEMA = (
    "extend_attention_cpu.sglang_0_5_23(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend, "
    "Tensor k_buffer, Tensor v_buffer, float key_scale, float value_scale, Tensor req_to_token, "
    "Tensor req_pool_indices, Tensor seq_lens, Tensor extend_seq_lens, Tensor extend_start_loc, "
    "int max_len_extend, float sm_scale, float logit_cap, bool is_cross_attn, int sliding_window_size, "
    "Tensor? encoder_lens, Tensor? sinks, Tensor? tree_mask, bool is_causal) -> ()"
)
_MURMUR_SCHEMA = "murmur_hash32_cpu(Tensor seed, Tensor positions, Tensor col_indices) -> Tensor"

_SOURCE = "the CPU kernels built from third_party/sgl-kernel-cpu"

HOST_POOL_MODULE = "sglang.srt.mem_cache.pool_host.common"
"""The SGLang module whose ``_cuda_host_register`` page-locks host buffers (:func:`patch_host_pool`)."""
_REGISTERED_RANGES = "_sglang_cuda_host_registered_ranges"
"""The attribute in which SGLang 0.5.23 keeps the ranges it registered on a buffer (empty: none)."""

_library: Any = None
"""The ``torch.library.Library`` fragment holding the registrations (kept alive: they die with it)."""
_hook: _ImportHook | None = None


# -- murmur hash ---------------------------------------------------------------------------------------
_MASK32 = 0xFFFFFFFF


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """``a * c mod 2**32`` for ``0 <= a < 2**32`` in int64 without overflow (``c`` split in 16-bit halves)."""
    return (a * (c & 0xFFFF) + (((a * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _MASK32


def _mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = _rotl32(_mul32(k, 0xCC9E2D51), 15)
    h = _rotl32(h ^ _mul32(k, 0x1B873593), 13)
    return (h * 5 + 0xE6546B64) & _MASK32


def murmur_hash32(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """SGLang's seeded-sampling hash: ``out[i, j]`` is MurmurHash3 (x86, 32 bit, seed 0) of the 16 bytes
    ``seed[i]`` (64 bit, low word first), ``positions[i]`` and ``col_indices[j]`` (each cut to 32 bits).

    Matches ``murmur_hash32_kernel`` (Triton) of SGLang 0.5.23 and the contract of its CPU op: ``seed``
    uint64, ``positions`` int64 or uint64, ``col_indices`` int64, all 1-D; returns uint32 ``(n, m)``.
    """
    import torch

    if seed.dim() != 1 or positions.dim() != 1 or col_indices.dim() != 1:
        raise ValueError(
            f"murmur_hash32: seed, positions and col_indices must be 1-D, got shapes "
            f"{tuple(seed.shape)}, {tuple(positions.shape)}, {tuple(col_indices.shape)}"
        )
    if seed.shape[0] != positions.shape[0]:
        raise ValueError(f"murmur_hash32: {seed.shape[0]} seeds for {positions.shape[0]} positions")
    if seed.dtype != torch.uint64:
        raise TypeError(f"murmur_hash32: seed must have dtype torch.uint64, got {seed.dtype}")
    if positions.dtype not in (torch.int64, torch.uint64):
        raise TypeError(f"murmur_hash32: positions must have dtype torch.int64 or torch.uint64, got {positions.dtype}")
    if col_indices.dtype != torch.int64:
        raise TypeError(f"murmur_hash32: col_indices must have dtype torch.int64, got {col_indices.dtype}")
    # same bits as int64 (a view, no conversion); the masks below keep every value in [0, 2**32)
    seed64 = seed.contiguous().view(torch.int64)
    pos64 = positions.contiguous().view(torch.int64)
    h = torch.zeros_like(seed64)
    h = _mix(h, seed64 & _MASK32)
    h = _mix(h, (seed64 >> 32) & _MASK32)
    h = _mix(h, pos64 & _MASK32)
    h = _mix(h.unsqueeze(1), (col_indices & _MASK32).unsqueeze(0))
    h = h ^ 16  # the key's length in bytes
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    h = h ^ (h >> 16)
    return h.to(torch.uint32)


# -- attention with 0.5.23's schema --------------------------------------------------------------------
def _refuse_scales(op: str, key_scale: float, value_scale: float) -> None:
    if key_scale != 1.0 or value_scale != 1.0:
        raise NotImplementedError(
            f"sgl_kernel::{op}: key_scale={key_scale}, value_scale={value_scale}: {_SOURCE} have no scaled "
            "(fp8) KV cache; serve with an unscaled KV cache (no --kv-cache-dtype fp8*)"
        )


def _decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key_scale: float,
    value_scale: float,
    output: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    loc: torch.Tensor,
    attn_logits: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    logit_cap: float,
    is_cross_attn: bool,
    sliding_window_size: int,
    encoder_lens: torch.Tensor | None,
    sinks: torch.Tensor | None,
) -> None:
    import torch

    _refuse_scales("decode_attention_cpu", key_scale, value_scale)
    torch.ops.sgl_kernel.decode_attention_cpu.default(
        query,
        k_cache,
        v_cache,
        output,
        key,
        value,
        loc,
        attn_logits,
        req_to_token,
        req_pool_indices,
        seq_lens,
        sm_scale,
        logit_cap,
        is_cross_attn,
        sliding_window_size,
        encoder_lens,
        sinks,
    )


def _extend_attention(
    q_extend: torch.Tensor,
    k_extend: torch.Tensor | None,
    v_extend: torch.Tensor | None,
    o_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    key_scale: float,
    value_scale: float,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    max_len_extend: int,
    sm_scale: float,
    logit_cap: float,
    is_cross_attn: bool,
    sliding_window_size: int,
    encoder_lens: torch.Tensor | None,
    sinks: torch.Tensor | None,
    tree_mask: torch.Tensor | None,
    is_causal: bool,
) -> None:
    import torch

    _refuse_scales("extend_attention_cpu", key_scale, value_scale)
    # the kernel masks self-attention causally and attends to every encoder token in cross-attention
    if is_causal == is_cross_attn:
        kind = "cross-attention" if is_cross_attn else "self-attention"
        raise NotImplementedError(
            f"sgl_kernel::extend_attention_cpu: is_causal={is_causal} for {kind}: {_SOURCE} compute causal "
            "self-attention and non-causal cross-attention only (an encoder-only model needs a newer kernel)"
        )
    torch.ops.sgl_kernel.extend_attention_cpu.default(
        q_extend,
        k_extend,
        v_extend,
        o_extend,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        extend_seq_lens,
        extend_start_loc,
        max_len_extend,
        sm_scale,
        logit_cap,
        is_cross_attn,
        sliding_window_size,
        encoder_lens,
        sinks,
        tree_mask,
    )


def _arguments(qualified: str) -> list[str] | None:
    """Argument names of every overload of ``sgl_kernel::<name>`` (``None``: no such op)."""
    import torch

    packet = getattr(torch.ops.sgl_kernel, qualified, None)
    if packet is None:
        return None
    names: list[str] = []
    for overload in packet.overloads():
        names += [a.name for a in getattr(packet, overload)._schema.arguments]
    return names


def register_kernel_ops() -> list[str]:
    """Give the loaded ``sgl_kernel`` the schemas SGLang 0.5.23 calls (see the module's docstring).

    Idempotent; returns what it registered (``"decode_attention_cpu.sglang_0_5_23"`` ...), empty when the
    kernels already have them. Raises :class:`RuntimeError` when ``sgl_kernel``'s attention ops are missing.
    """
    global _library
    import torch

    added: list[str] = []
    decode, extend = _arguments("decode_attention_cpu"), _arguments("extend_attention_cpu")
    if decode is None or extend is None:
        raise RuntimeError(
            "sgl_kernel is loaded but has no decode_attention_cpu / extend_attention_cpu: not a CPU build of "
            f"the kernels ({_SOURCE})"
        )
    if _library is None:
        _library = torch.library.Library("sgl_kernel", "FRAGMENT")
    namespace = torch.ops.sgl_kernel
    for op, arguments, schema, impl in (
        ("decode_attention_cpu", decode, _DECODE_SCHEMA, _decode_attention),
        ("extend_attention_cpu", extend, _EXTEND_SCHEMA, _extend_attention),
    ):
        if "key_scale" in arguments:
            continue
        _library.define(schema)
        _library.impl(f"{op}.{COMPAT_OVERLOAD}", impl, "CPU")
        added.append(f"{op}.{COMPAT_OVERLOAD}")
        # a packet resolves overloads among those that existed when it was first looked up (it is cached on
        # the namespace): drop a cached one so that the next lookup sees the new overload
        vars(namespace).pop(op, None)
    if _arguments("murmur_hash32_cpu") is None:
        _library.define(_MURMUR_SCHEMA)
        _library.impl("murmur_hash32_cpu", murmur_hash32, "CPU")
        vars(namespace).pop("murmur_hash32_cpu", None)
        added.append("murmur_hash32_cpu")
    if added:
        log.debug("sgl_kernel: registered %s for SGLang 0.5.23", ", ".join(added))
    return added


# -- page-locked host buffers -------------------------------------------------------------------------
def host_register_on_cpu(buffer: torch.Tensor, registration_granularity_bytes: int | None = None) -> None:
    """SGLang's ``_cuda_host_register`` where torch has no CUDA: nothing to page-lock for; the buffer is
    marked as holding no registered range, as SGLang marks a buffer it did not register."""
    setattr(buffer, _REGISTERED_RANGES, [])


def patch_host_pool(module: types.ModuleType) -> bool:
    """Replace ``module._cuda_host_register`` (SGLang's :data:`HOST_POOL_MODULE`) by
    :func:`host_register_on_cpu` when torch has no CUDA; returns whether it did. Raises
    :class:`RuntimeError` when the module has no such function (another SGLang: check this patch)."""
    import torch

    if torch.cuda.is_available():
        return False
    if not callable(getattr(module, "_cuda_host_register", None)):
        raise RuntimeError(
            f"{module.__name__} has no _cuda_host_register: not SGLang 0.5.23's host pool (miles_sglang.cpu_compat)"
        )
    module._cuda_host_register = host_register_on_cpu  # type: ignore[attr-defined]
    log.debug("%s: host buffers are not page-locked on a CPU", module.__name__)
    return True


_PINNING_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_strided")
"""The torch factories SGLang's LoRA code calls with ``pin_memory=True``."""
_unpinned = False


def unpin_on_cpu() -> bool:
    """Where torch has no CUDA: ``pin_memory=True`` of the :data:`_PINNING_FACTORIES` is dropped and
    ``Tensor.pin_memory()`` returns the tensor (both raise on such a torch: there is no page-locked allocator
    and nothing to copy to). Idempotent; returns whether this process is patched."""
    global _unpinned
    import functools

    import torch

    if torch.cuda.is_available():
        return False
    if _unpinned:
        return True

    def unpinned(factory: Any) -> Any:
        @functools.wraps(factory)
        def call(*args: Any, **kwargs: Any) -> Any:
            kwargs.pop("pin_memory", None)
            return factory(*args, **kwargs)

        return call

    for name in _PINNING_FACTORIES:
        setattr(torch, name, unpinned(getattr(torch, name)))

    def pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
        return self

    torch.Tensor.pin_memory = pin_memory
    _unpinned = True
    log.debug("pin_memory requests allocate ordinary memory (torch has no CUDA)")
    return True


# -- import hook ---------------------------------------------------------------------------------------
class _AfterLoad(importlib.abc.Loader):
    """Runs the module's own loader, then ``then()`` (given the module when it takes an argument)."""

    def __init__(self, loader: importlib.abc.Loader, then: Any) -> None:
        self._loader = loader
        self._then = then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        self._then(module)


class _EmptyModule(importlib.abc.Loader):
    def __init__(self, doc: str) -> None:
        self._doc = doc

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.__doc__ = self._doc


def _torchvision_has_ops() -> bool:
    extension = sys.modules.get("torchvision.extension")
    return extension is None or bool(extension._has_ops())


def _unpin_after_load(module: types.ModuleType) -> None:
    unpin_on_cpu()


_AFTER_LOAD: dict[str, Any] = {
    "sgl_kernel": lambda module: register_kernel_ops(),
    HOST_POOL_MODULE: patch_host_pool,
}
"""What runs once each hooked module has loaded."""
LORA_PACKAGE = "sglang.srt.lora"
"""SGLang's LoRA code (a namespace package: the hook catches each of its modules, :func:`unpin_on_cpu`)."""


class _ImportHook(importlib.abc.MetaPathFinder):
    """Registers the kernel overloads after ``sgl_kernel`` loads and patches SGLang's host pool after it loads;
    stands in for torchvision's meta kernels when its C++ ops did not load."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == "torchvision._meta_registrations" and not _torchvision_has_ops():
            doc = "Left empty by miles_sglang.cpu_compat: torchvision's C++ ops did not load (a CUDA build)."
            return importlib.machinery.ModuleSpec(fullname, _EmptyModule(doc))
        after = _AFTER_LOAD.get(fullname)
        if after is None and fullname.startswith(LORA_PACKAGE + "."):
            after = _unpin_after_load
        if after is None:
            return None
        spec = _find_elsewhere(self, fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _AfterLoad(spec.loader, after)
        return spec


def _find_elsewhere(
    hook: _ImportHook, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None
) -> importlib.machinery.ModuleSpec | None:
    for finder in sys.meta_path:
        if finder is hook:
            continue
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        spec = find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


def install() -> None:
    """Add the import hook (idempotent). When ``sgl_kernel`` is already loaded its overloads are registered
    now; a torchvision imported before cannot be helped (its import has already failed)."""
    global _hook
    if _hook is None:
        _hook = _ImportHook()
        sys.meta_path.insert(0, _hook)
    if "sgl_kernel" in sys.modules:
        register_kernel_ops()
    if HOST_POOL_MODULE in sys.modules:
        patch_host_pool(sys.modules[HOST_POOL_MODULE])
    if any(name.startswith(LORA_PACKAGE + ".") for name in sys.modules):
        unpin_on_cpu()


def installed() -> bool:
    """Whether :func:`install` ran in this process."""
    return _hook is not None and _hook in sys.meta_path
