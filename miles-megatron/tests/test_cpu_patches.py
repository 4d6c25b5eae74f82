"""Each CPU patch (and mbridge shim) is still needed: with it switched off, a real training step fails.

A version bump of megatron-core / mbridge that fixes one makes its case here fail: drop the patch then.
The probes run in their own processes (the patches are process-wide), two at a time.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import free_port, run_script

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

NEEDED_BY = {
    "cuda_rng": "dense",
    "current_device": "dense",
    "cuda_device_mode": "dense",
    "cuda_tensor_type": "dense",
    "recompute_mode": "dense",
    "cuda_streams": "moe",
    "moe_te_names": "moe",
    "ep_split_sizes": "ep",
    "sp_torch_norm": "sp",
    "mbridge_local_spec": "dense",
    "mbridge_local_names": "dense",
    "mbridge_rope_theta": "dense",
}


def test_every_patch_and_shim_has_a_probe() -> None:
    import ast

    source = Path(__file__).parents[1] / "src" / "miles_megatron"
    text = (source / "cpu_patches.py").read_text()
    names = {
        node.args[0].value
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", "") == "CpuPatch"
        and isinstance(node.args[0], ast.Constant)
    }
    assert names | {"mbridge_local_spec", "mbridge_local_names", "mbridge_rope_theta"} == set(NEEDED_BY)


@pytest.fixture(scope="module")
def probes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str]]:
    from miles.testing.models import build_tiny_model

    root = tmp_path_factory.mktemp("probes")
    for arch in ("qwen2", "qwen2_moe"):
        build_tiny_model(root / arch, arch, seed=1)
    script = str(Path(__file__).with_name("patch_probe.py"))

    def probe(name: str) -> tuple[str, tuple[int, str]]:
        proc = run_script(
            [script, NEEDED_BY[name], str(root), str(free_port())],
            env={"MILES_MEGATRON_DISABLE_PATCHES": name},
            timeout=600,
        )
        return name, (proc.returncode, proc.stderr[-3000:])

    with ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as pool:
        return dict(pool.map(probe, NEEDED_BY))


@pytest.mark.parametrize("name", list(NEEDED_BY))
def test_switching_the_patch_off_breaks_megatron(probes: dict[str, tuple[int, str]], name: str) -> None:
    code, stderr = probes[name]
    assert code != 0, f"patch {name!r} is no longer needed (the probe passed without it):\n{stderr}"


def test_unknown_patch_name_is_a_clear_error(tmp_path: Path) -> None:
    code = "from miles_megatron.cpu_patches import apply_cpu_patches; apply_cpu_patches('cpu')"
    proc = run_script(["-c", code], env={"MILES_MEGATRON_DISABLE_PATCHES": "cuda_rgn"})
    assert proc.returncode != 0
    assert "MILES_MEGATRON_DISABLE_PATCHES: unknown patch name(s) ['cuda_rgn']" in proc.stderr


def test_patches_are_not_applied_on_gpu() -> None:
    code = (
        "import torch; from miles_megatron.cpu_patches import apply_cpu_patches, applied_patches; "
        "f = torch.cuda.current_device; assert apply_cpu_patches('cuda') == [] and applied_patches() == []; "
        "assert torch.cuda.current_device is f; import sys; assert 'megatron.core' not in sys.modules"
    )
    proc = run_script(["-c", code])
    assert proc.returncode == 0, proc.stderr[-2000:]
