""":mod:`miles_sglang.cpu_compat` without SGLang: the seeded-sampling hash against MurmurHash3 itself and the
values SGLang lists for its CPU kernel, and the import hook driving stand-ins of ``sgl_kernel`` (the old
attention schemas, recording what they receive) and of a torchvision whose C++ ops did not load. The real
kernels and torchvision: ``tests/real/test_cpu_compat.py``."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from miles_sglang.cpu_compat import murmur_hash32  # noqa: E402


def murmur3_x86_32(data: bytes, seed: int = 0) -> int:
    """MurmurHash3_x86_32 as Austin Appleby specified it (whole 4-byte blocks only)."""
    c1, c2, mask = 0xCC9E2D51, 0x1B873593, 0xFFFFFFFF
    h = seed
    for (k,) in struct.iter_unpack("<I", data):
        k = (k * c1) & mask
        k = ((k << 15) | (k >> 17)) & mask
        h ^= (k * c2) & mask
        h = ((h << 13) | (h >> 19)) & mask
        h = (h * 5 + 0xE6546B64) & mask
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & mask
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & mask
    return h ^ (h >> 16)


def test_known_values_of_sglang_cpu_kernel() -> None:
    """The expected values of SGLang's own test of its CPU op (test_murmur_hash32_cpu_known_values)."""
    seed = torch.tensor([0, 1, 42, 0x123456789ABCDEF0], dtype=torch.uint64)
    cols = torch.tensor([0, 1, 2, 17], dtype=torch.int64)
    for dtype in (torch.int64, torch.uint64):
        hashed = murmur_hash32(seed, torch.tensor([0, 7, 123, 456], dtype=dtype), cols)
        assert hashed.dtype == torch.uint32 and hashed.shape == (4, 4)
        assert hashed.tolist() == [
            [2167721464, 10027521, 2423355346, 2203067026],
            [3755322398, 4196701286, 1002451629, 183234019],
            [772287619, 548237471, 2740678348, 3656549299],
            [3746406971, 2891010872, 104055988, 3372550890],
        ]


def test_it_is_murmur3_of_seed_position_and_column() -> None:
    """Random 64-bit seeds, positions beyond 32 bits and negative (cut to their low 32 bits, as the Triton
    kernel's ``.to(tl.uint32)`` does), a vocabulary-sized row of columns."""
    gen = torch.Generator().manual_seed(0)
    seeds = torch.randint(-(2**63), 2**63 - 1, (6,), generator=gen, dtype=torch.int64)
    positions = torch.tensor([0, 1, 2**32 + 5, -1, 70000, 2**40 + 2**31], dtype=torch.int64)
    cols = torch.arange(5000, dtype=torch.int64)
    hashed = murmur_hash32(seeds.view(torch.uint64), positions, cols).to(torch.int64)
    for row in range(6):
        for col in (0, 1, 31, 4096, 4999):
            key = struct.pack("<QII", int(seeds[row]) & (2**64 - 1), int(positions[row]) & 0xFFFFFFFF, col)
            assert int(hashed[row, col]) == murmur3_x86_32(key), (row, col)
    assert murmur_hash32(seeds.view(torch.uint64)[:0], positions[:0], cols).shape == (0, 5000)


def test_bad_inputs_are_named() -> None:
    seed = torch.zeros(2, dtype=torch.uint64)
    cols = torch.arange(3)
    with pytest.raises(TypeError, match="seed must have dtype torch.uint64, got torch.int64"):
        murmur_hash32(torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), cols)
    with pytest.raises(TypeError, match="positions must have dtype torch.int64 or torch.uint64"):
        murmur_hash32(seed, torch.zeros(2, dtype=torch.int32), cols)
    with pytest.raises(ValueError, match="2 seeds for 3 positions"):
        murmur_hash32(seed, torch.zeros(3, dtype=torch.int64), cols)
    with pytest.raises(ValueError, match="must be 1-D"):
        murmur_hash32(seed, torch.zeros(2, dtype=torch.int64), cols.view(1, 3))


# stand-ins: an ``sgl_kernel`` with the attention schemas of the vendored kernel source, recording calls
FAKE_SGL_KERNEL = """
import torch

CALLS = []
_lib = torch.library.Library("sgl_kernel", "DEF")
_lib.define(
    "decode_attention_cpu(Tensor query, Tensor k_cache, Tensor v_cahce, Tensor(a!) output, Tensor? key, "
    "Tensor? value, Tensor loc, Tensor attn_logits, Tensor req_to_token, Tensor req_pool_indices, "
    "Tensor seq_lens, float sm_scale, float logit_cap, bool is_cross_attn, int sliding_window_size, "
    "Tensor? encoder_lens, Tensor? sinks) -> ()"
)
_lib.define(
    "extend_attention_cpu(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend, "
    "Tensor k_buffer, Tensor v_buffer, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "
    "Tensor extend_seq_lens, Tensor extend_start_loc, int max_len_extend, float sm_scale, float logit_cap, "
    "bool is_cross_attn, int sliding_window_size, Tensor? encoder_lens, Tensor? sinks, Tensor? tree_mask=None) -> ()"
)


def _record(name):
    def impl(*args):
        CALLS.append([name] + [a.item() if isinstance(a, torch.Tensor) else a for a in args])
    return impl


_lib.impl("decode_attention_cpu", _record("decode"), "CPU")
_lib.impl("extend_attention_cpu", _record("extend"), "CPU")
"""

FAKE_TORCHVISION = {
    "__init__.py": "from . import extension\nfrom torchvision import _meta_registrations\n",
    "extension.py": "def _has_ops():\n    return False\n",
    "_meta_registrations.py": "raise RuntimeError('operator torchvision::nms does not exist')\n",
}

DRIVER = """
import json, sys, torch
import miles_sglang.cpu_compat as compat
compat.install()
import torchvision
import sgl_kernel
t = lambda v: torch.tensor([float(v)])
ops = torch.ops.sgl_kernel
# SGLang 0.5.23's argument order (layers/attention/intel_amx_backend.py), each tensor holding its position
ops.decode_attention_cpu(t(0), t(1), t(2), 1.0, 1.0, t(5), t(6), t(7), t(8), t(9), t(10), t(11), t(12),
                         0.125, 0.0, False, 15, None, t(18))
ops.extend_attention_cpu(t(0), t(1), t(2), t(3), t(4), t(5), 1.0, 1.0, t(8), t(9), t(10), t(11), t(12), 13,
                         0.125, 0.0, False, 17, None, None, t(20), True)
# the kernel's own schema still works
ops.decode_attention_cpu(t(0), t(1), t(2), t(3), t(4), t(5), t(6), t(7), t(8), t(9), t(10), 0.5, 0.0, False,
                         -1, None, None)
try:
    ops.decode_attention_cpu(t(0), t(1), t(2), 0.5, 1.0, t(5), t(6), t(7), t(8), t(9), t(10), t(11), t(12),
                             0.125, 0.0, False, 15, None, None)
except NotImplementedError as e:
    refused = str(e)
hashed = ops.murmur_hash32_cpu.default(torch.tensor([42], dtype=torch.uint64), torch.tensor([123]),
                                       torch.tensor([17]))
print(json.dumps({"calls": sgl_kernel.CALLS, "refused": refused, "hash": hashed.tolist(),
                  "meta_doc": sys.modules["torchvision._meta_registrations"].__doc__,
                  "again": compat.register_kernel_ops()}))
"""


def test_the_hook_gives_old_kernels_the_new_schemas(tmp_path: Path) -> None:
    (tmp_path / "sgl_kernel").mkdir()
    (tmp_path / "sgl_kernel" / "__init__.py").write_text(FAKE_SGL_KERNEL)
    (tmp_path / "torchvision").mkdir()
    for name, text in FAKE_TORCHVISION.items():
        (tmp_path / "torchvision" / name).write_text(text)
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(src)])}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(DRIVER)], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    decode, extend, plain = result["calls"]
    # the scales are dropped, every other argument lands where the kernel's schema has it
    assert decode == ["decode", 0, 1, 2, 5, 6, 7, 8, 9, 10, 11, 12, 0.125, 0.0, False, 15, None, 18]
    assert extend == ["extend", 0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13, 0.125, 0.0, False, 17, None, None, 20]
    assert plain[:2] == ["decode", 0] and len(plain) == 18
    assert "key_scale=0.5, value_scale=1.0" in result["refused"]
    assert result["hash"] == [[3656549299]]
    assert result["meta_doc"].startswith("Left empty by miles_sglang.cpu_compat")
    assert result["again"] == []  # idempotent


# a stand-in of SGLang 0.5.23's host pool: its registration calls torch.cuda.cudart(), as SGLang's does
FAKE_HOST_POOL = """
import torch

def _cuda_host_register(buffer, registration_granularity_bytes=None):
    torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel() * buffer.element_size(), 0)

def alloc_with_host_register(dims, dtype, device, pin_memory, allocator=None):
    buffer = torch.zeros(dims, dtype=dtype)
    if pin_memory:
        _cuda_host_register(buffer)
    return buffer
"""

HOST_POOL_DRIVER = """
import json, torch
import miles_sglang.cpu_compat as compat
compat.install()
from sglang.srt.mem_cache.pool_host import common
buffer = common.alloc_with_host_register((4, 2, 2), torch.int32, "cpu", pin_memory=True)
print(json.dumps({"shape": list(buffer.shape), "ranges": buffer._sglang_cuda_host_registered_ranges,
                  "patched": common._cuda_host_register is compat.host_register_on_cpu}))
"""


def test_host_buffers_are_not_page_locked_on_a_cpu(tmp_path: Path) -> None:
    """SGLang's routed-experts capturer allocates its host buffer through ``_cuda_host_register``, which calls
    ``torch.cuda.cudart()``: on a CPU torch that raises; with the hook the buffer is allocated, unregistered."""
    package = tmp_path / "sglang" / "srt" / "mem_cache" / "pool_host"
    package.mkdir(parents=True)
    for folder in (package, *list(package.parents)[:3]):
        (folder / "__init__.py").write_text("")
    (package / "common.py").write_text(FAKE_HOST_POOL)
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(src)])}
    driver = textwrap.dedent(HOST_POOL_DRIVER)
    out = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"shape": [4, 2, 2], "ranges": [], "patched": True}
    # without the hook (which the SGLang CPU environment installs at every start): what SGLang does on a CPU torch
    bare = driver.replace("compat.install()", "compat._hook in sys.meta_path and sys.meta_path.remove(compat._hook)")
    bare = bare.replace("import json, torch", "import json, sys, torch")
    out = subprocess.run([sys.executable, "-c", bare], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode != 0 and "Torch not compiled with CUDA enabled" in out.stderr


# a stand-in of SGLang 0.5.23's LoRA layers (a namespace package): they pin host tensors whatever the device
FAKE_LORA_LAYERS = """
import torch

def offsets():
    return torch.tensor([0, 4], dtype=torch.int32, device="cpu", pin_memory=True), torch.ones(3).pin_memory()
"""

LORA_DRIVER = """
import json, sys, torch
import miles_sglang.cpu_compat as compat
compat.install()
from sglang.srt.lora import layers
try:
    a, b = layers.offsets()
    print(json.dumps({"offsets": a.tolist(), "ones": b.tolist(), "pinned": a.is_pinned()}))
except RuntimeError as e:
    print(json.dumps({"error": str(e)}))
"""


def test_lora_host_tensors_are_not_pinned_on_a_cpu(tmp_path: Path) -> None:
    """``--enable-lora`` died at start on a CPU torch: SGLang's LoRA layers ask for pinned host tensors, which it
    cannot allocate. With the hook, the LoRA package's tensors are ordinary ones; without it, the error."""
    package = tmp_path / "sglang" / "srt" / "lora"
    package.mkdir(parents=True)
    for folder in (package.parent, package.parent.parent):
        (folder / "__init__.py").write_text("")
    (package / "layers.py").write_text(FAKE_LORA_LAYERS)  # (no __init__.py: a namespace package, as SGLang's)
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(src)])}
    driver = textwrap.dedent(LORA_DRIVER)
    out = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"offsets": [0, 4], "ones": [1.0, 1.0, 1.0], "pinned": False}
    bare = driver.replace("compat.install()", "compat._hook in sys.meta_path and sys.meta_path.remove(compat._hook)")
    out = subprocess.run([sys.executable, "-c", bare], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "pin_memory=True requires a CUDA" in json.loads(out.stdout)["error"]
