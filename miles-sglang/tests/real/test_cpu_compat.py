""":mod:`miles_sglang.cpu_compat` in the SGLang CPU environment, without a server: the kernels built from
``third_party/sgl-kernel-cpu`` get SGLang 0.5.23's schemas (checked against the call sites in 0.5.23's own
source), SGLang's seeded-sampling hash runs on them, and PyPI's torchvision imports beside the CPU torch."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from miles_sglang import cpu_compat


def _call_arguments(module: str, method: str) -> list[str]:
    """The argument expressions of ``self.<method>(...)`` in SGLang's ``module`` (its installed source, read
    without importing it)."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin is not None
    path = Path(spec.origin).parent.joinpath(*module.split(".")[1:]).with_suffix(".py")
    tree = ast.parse(path.read_text())
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method
    ]
    assert len(calls) == 1, f"{method} is called {len(calls)} times in {module}"
    return [ast.unparse(arg) for arg in calls[0].args]


def _schema_arguments(op: str) -> list[str]:
    import torch

    packet = getattr(torch.ops.sgl_kernel, op)
    return [a.name for a in getattr(packet, cpu_compat.COMPAT_OVERLOAD)._schema.arguments]


def test_the_overloads_take_what_sglang_0_5_23_passes() -> None:
    """0.5.23's intel_amx backend passes the scales third and fourth (decode) or seventh and eighth (extend),
    and is_causal last: the overloads' argument lists line up with those calls, name for name."""
    import sgl_kernel  # noqa: F401  (the import hook registers the overloads)

    module = "sglang.srt.layers.attention.intel_amx_backend"
    decode = _call_arguments(module, "decode_attention_fwd")
    schema = _schema_arguments("decode_attention_cpu")
    assert len(decode) == len(schema) == 19
    assert (decode[3], decode[4]) == ("key_scale", "value_scale") and schema[3:5] == ["key_scale", "value_scale"]
    extend = _call_arguments(module, "extend_attention_fwd")
    schema = _schema_arguments("extend_attention_cpu")
    assert len(extend) == len(schema) == 22
    assert (extend[6], extend[7], extend[-1]) == ("key_scale", "value_scale", "is_causal")
    assert schema[6:8] == ["key_scale", "value_scale"] and schema[-1] == "is_causal"


def test_the_overloads_refuse_what_the_kernels_cannot_compute() -> None:
    import sgl_kernel  # noqa: F401
    import torch

    t = torch.zeros(1)
    decode = torch.ops.sgl_kernel.decode_attention_cpu
    with pytest.raises(NotImplementedError, match=r"key_scale=0.5, value_scale=1.0: .* no scaled \(fp8\) KV cache"):
        decode(t, t, t, 0.5, 1.0, t, None, None, t, t, t, t, t, 1.0, 0.0, False, 0, None, None)
    extend = torch.ops.sgl_kernel.extend_attention_cpu
    with pytest.raises(NotImplementedError, match="is_causal=False for self-attention"):
        extend(t, t, t, t, t, t, 1.0, 1.0, t, t, t, t, t, 1, 1.0, 0.0, False, 0, None, None, None, False)
    with pytest.raises(NotImplementedError, match="value_scale=2.0"):
        extend(t, t, t, t, t, t, 1.0, 2.0, t, t, t, t, t, 1, 1.0, 0.0, False, 0, None, None, None, True)


def test_sglang_seeded_sampling_hash_runs_on_the_cpu() -> None:
    """SGLang's own ``murmur_hash32`` (which calls ``sgl_kernel::murmur_hash32_cpu`` for CPU tensors) gives
    the values SGLang's tests list for its CPU kernel."""
    import torch
    from sglang.kernels.ops.sampling.murmur_hash import murmur_hash32

    seed = torch.tensor([0, 1, 42, 0x123456789ABCDEF0], dtype=torch.uint64)
    positions = torch.tensor([0, 7, 123, 456], dtype=torch.int64)
    hashed = murmur_hash32(seed, positions, torch.tensor([0, 1, 2, 17], dtype=torch.int64))
    assert hashed.dtype == torch.uint32
    assert hashed.tolist()[3] == [3746406971, 2891010872, 104055988, 3372550890]


def test_torchvision_imports_and_says_its_ops_are_missing() -> None:
    """In a fresh interpreter of this environment (the ``.pth`` installs the hook): torchvision and the
    torchvision import SGLang makes work; torchvision's operators still fail with its own message."""
    code = (
        "import torchvision, torchvision.transforms, torch\n"
        "import miles_sglang.cpu_compat as c; assert c.installed()\n"
        "assert not torchvision.extension._has_ops()\n"
        "try:\n"
        "    torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)\n"
        "except RuntimeError as e:\n"
        "    print('refused:', str(e)[:40])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refused: Couldn't load custom C++ ops"), out.stdout
