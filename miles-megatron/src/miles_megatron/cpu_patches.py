"""Process-wide patches that let Megatron-Core 0.16 run on CPU ranks (gloo), in one place.

Megatron-Core is written for CUDA: it asks for the current CUDA device at ~175 call sites, allocates with
literal ``device="cuda"``, keeps RNG states of CUDA generators, checks ``param.type()`` against
``torch.cuda.FloatTensor`` and synchronises streams in the MoE dispatcher. Each patch below replaces one
of those with its CPU meaning. They are **global** (they change ``torch.cuda`` and Megatron modules for
the whole process), so:

- :func:`apply_cpu_patches` applies them only for ``device == "cpu"``; on GPU it does nothing;
- each patch has a name and can be switched off with ``MILES_MEGATRON_DISABLE_PATCHES=name,name`` (the
  tests turn each one off in a subprocess and check that Megatron then fails, so a version bump that
  makes one unnecessary is noticed);
- Megatron tests run in their own subprocesses.

The patches were each confirmed necessary for megatron-core 0.16.1 with torch 2.13 (see the tests).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DISABLE_ENV",
    "PATCHES",
    "SHIMS",
    "CpuPatch",
    "applied_patches",
    "apply_cpu_patches",
    "disabled_patches",
    "enter_device_mode",
    "fill_moe_te_names",
]

log = logging.getLogger(__name__)

DISABLE_ENV = "MILES_MEGATRON_DISABLE_PATCHES"
"""Comma-separated names of patches (CPU patches and mbridge shims) to leave out."""

SHIMS = ("mbridge_local_spec", "mbridge_local_names", "mbridge_rope_theta")
"""The mbridge shims (:mod:`miles_megatron.bridge`), switchable off by the same variable."""


@dataclass(frozen=True)
class CpuPatch:
    """One named patch: what it fixes and the function that applies it."""

    name: str
    reason: str
    apply: Callable[[], None]


_APPLIED: list[str] = []
_MODE: Any = None


def disabled_patches() -> set[str]:
    """Names listed in ``MILES_MEGATRON_DISABLE_PATCHES`` (patches and mbridge shims)."""
    return {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}


# -- 1. RNG ----------------------------------------------------------------------------------------
def _patch_cuda_rng() -> None:
    import torch
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    def add(self: Any, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"cpu rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    mrandom.CudaRNGStatesTracker.add = add


# -- 2. current device -----------------------------------------------------------------------------
def _patch_current_device() -> None:
    import torch

    torch.cuda.current_device = lambda: "cpu"


# -- 3. literal cuda devices, .cuda(), pin_memory --------------------------------------------------
def _is_cuda(device: Any) -> bool:
    import torch

    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


def _make_mode() -> Any:
    import torch
    from torch.overrides import TorchFunctionMode

    class CudaToCpu(TorchFunctionMode):
        """Rewrites ``device="cuda"`` (or a CUDA index) in any torch call to the CPU."""

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = dict(kwargs or {})
            if "device" in kwargs and _is_cuda(kwargs["device"]):
                kwargs["device"] = torch.device("cpu")
            if func is torch.Tensor.to and args and len(args) > 1 and _is_cuda(args[1]):
                args = (args[0], torch.device("cpu"), *args[2:])
            if kwargs.pop("pin_memory", False):
                pass
            return func(*args, **kwargs)

    return CudaToCpu()


def _patch_cuda_device_mode() -> None:
    import torch

    global _MODE
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.Tensor.pin_memory = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self
    _MODE = _make_mode()
    _MODE.__enter__()


# -- 4. streams and events -------------------------------------------------------------------------
class _DummyEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, *args: Any) -> None:
        pass

    def query(self) -> bool:
        return True


class _DummyStream(_DummyEvent):
    def wait_stream(self, *args: Any) -> None:
        pass

    def wait_event(self, *args: Any) -> None:
        pass

    def record_event(self, *args: Any) -> _DummyEvent:
        return _DummyEvent()


_STREAM = _DummyStream()


def _patch_cuda_streams() -> None:
    import torch

    torch.cuda.Stream = _DummyStream
    torch.cuda.Event = _DummyEvent
    torch.cuda.current_stream = lambda *a, **k: _STREAM
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.Tensor.record_stream = lambda self, *a, **k: None


# -- 5. tensor type strings ------------------------------------------------------------------------
def _patch_tensor_type() -> None:
    import torch

    original = torch.Tensor.type

    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        # (the device mode dispatches this very function again: prefix once)
        if not args and not kwargs and isinstance(result, str) and result.startswith("torch.") and "cuda" not in result:
            return "torch.cuda." + result.removeprefix("torch.")
        return result

    torch.Tensor.type = type_


# -- 6. sequence parallel with the plain torch norm ------------------------------------------------
def _patch_sp_torch_norm() -> None:
    from megatron.core.transformer import torch_norm

    original = torch_norm.WrappedTorchNorm.__new__

    def new(cls: Any, config: Any, hidden_size: int, *args: Any, **kwargs: Any) -> Any:
        sp = config.sequence_parallel
        if not sp:
            return original(cls, config, hidden_size, *args, **kwargs)
        config.sequence_parallel = False
        try:
            norm = original(cls, config, hidden_size, *args, **kwargs)
        finally:
            config.sequence_parallel = sp
        for param in norm.parameters():
            param.sequence_parallel = True  # gradients are summed over the TP group
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new


# -- 7. recompute: the function mode is popped during backward -------------------------------------
def _patch_recompute_mode() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    original = mrandom.CheckpointFunction.backward

    def backward(ctx: Any, *args: Any) -> Any:
        from torch.overrides import _get_current_function_mode_stack

        if _MODE is None or _MODE in _get_current_function_mode_stack():
            return original(ctx, *args)
        with _MODE:
            return original(ctx, *args)

    mrandom.CheckpointFunction.backward = staticmethod(backward)


# -- 8. names that moe_utils only defines when TransformerEngine imports --------------------------
_TE_MOE_NAMES = (
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "fused_permute",
    "fused_permute_with_probs",
    "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs",
    "fused_topk_with_score_function",
    "fused_unpermute",
    "te_general_gemm",
)


def fill_moe_te_names() -> None:
    """Set the names ``moe_utils`` defines only when TransformerEngine imports to ``None`` (what its code
    tests for), where they are missing; needed on GPU too when TransformerEngine is not installed."""
    from megatron.core.transformer.moe import moe_utils

    for name in _TE_MOE_NAMES:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


# -- 9. all-to-all split sizes ---------------------------------------------------------------------
def _as_list(sizes: Any) -> Any:
    return sizes.tolist() if hasattr(sizes, "tolist") else sizes


def _patch_ep_split_sizes() -> None:
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import token_dispatcher

    original = mappings.all_to_all

    def all_to_all(group: Any, input_: Any, output_split_sizes_: Any = None, input_split_sizes: Any = None) -> Any:
        return original(group, input_, _as_list(output_split_sizes_), _as_list(input_split_sizes))

    token_dispatcher.all_to_all = all_to_all


PATCHES: tuple[CpuPatch, ...] = (
    CpuPatch("cuda_rng", "tensor_parallel.random keeps CUDA generator states: use the CPU generator", _patch_cuda_rng),
    CpuPatch("current_device", "torch.cuda.current_device() (~175 call sites) answers 'cpu'", _patch_current_device),
    CpuPatch(
        "cuda_device_mode",
        "literal device='cuda', .cuda() and pin_memory become the CPU / no-ops (a TorchFunctionMode)",
        _patch_cuda_device_mode,
    ),
    CpuPatch(
        "cuda_streams", "torch.cuda streams, events and synchronize are no-ops (MoE dispatcher)", _patch_cuda_streams
    ),
    CpuPatch(
        "cuda_tensor_type",
        "param.type() == 'torch.cuda.FloatTensor' checks (optimizer, clip_grads) see CPU tensors as CUDA ones",
        _patch_tensor_type,
    ),
    CpuPatch(
        "sp_torch_norm",
        "sequence parallel with the plain torch norm: allowed, its params tagged sequence_parallel",
        _patch_sp_torch_norm,
    ),
    CpuPatch(
        "recompute_mode",
        "activation recompute runs forward inside backward, where torch pops the function mode: re-enter it",
        _patch_recompute_mode,
    ),
    CpuPatch("moe_te_names", "moe_utils names defined only with TransformerEngine are set to None", fill_moe_te_names),
    CpuPatch(
        "ep_split_sizes", "expert-parallel all-to-all split sizes left as tensors become lists", _patch_ep_split_sizes
    ),
)


def applied_patches() -> list[str]:
    """Names of the patches applied in this process so far."""
    return list(_APPLIED)


def apply_cpu_patches(device: str) -> list[str]:
    """Apply every CPU patch not disabled by name, once per process; nothing for ``device != "cpu"``.

    Returns the names applied by this call.
    """
    if device != "cpu":
        return []
    disabled = disabled_patches()
    known = {p.name for p in PATCHES}
    unknown = disabled - known - set(SHIMS)
    if unknown:
        raise ValueError(f"{DISABLE_ENV}: unknown patch name(s) {sorted(unknown)}; known: {sorted(known | set(SHIMS))}")
    done: list[str] = []
    for patch in PATCHES:
        if patch.name in disabled or patch.name in _APPLIED:
            continue
        patch.apply()
        _APPLIED.append(patch.name)
        done.append(patch.name)
    if done:
        log.info("megatron CPU patches applied: %s", ", ".join(done))
    if disabled & known:
        log.warning("megatron CPU patches switched off by %s: %s", DISABLE_ENV, ", ".join(sorted(disabled & known)))
    return done


def enter_device_mode() -> None:
    """Enter the CPU device mode (``cuda_device_mode``) on the calling thread, for good, when it is not there.

    Torch keeps function modes per thread and :func:`apply_cpu_patches` entered it on the thread that
    applied the patches; the async modes train and stage weights on a dedicated thread, where Megatron's
    literal ``device="cuda"`` would otherwise reach torch. Nothing when the patches are not applied.
    """
    from torch.overrides import _get_current_function_mode_stack

    if _MODE is not None and _MODE not in _get_current_function_mode_stack():
        _MODE.__enter__()
