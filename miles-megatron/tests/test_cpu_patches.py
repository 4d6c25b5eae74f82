"""Each CPU patch (and mbridge shim) is still needed: with it switched off, Megatron fails at the first
stage of a trainer's life that needs it, with the error it exists for; with every patch on, the same
stages pass.

A version bump of megatron-core / mbridge that fixes one makes its case here fail: drop the patch then.
``patch_probe.py`` runs every probe in processes of its own (the patches are process-wide), forked from
one parent that paid the imports once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import patch_probe
import pytest
from helpers import run_script

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


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
    assert names | {"mbridge_local_spec", "mbridge_local_names", "mbridge_rope_theta"} == set(patch_probe.PROBES)


@pytest.fixture(scope="module")
def probes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from miles.testing.models import build_tiny_model

    root = tmp_path_factory.mktemp("probes")
    for arch in {s.arch for s in patch_probe.SCENARIOS.values()}:
        build_tiny_model(root / arch, arch, seed=1)
    proc = run_script([str(Path(patch_probe.__file__)), str(root), str(root / "out")], timeout=800)
    assert proc.returncode == 0, proc.stderr[-6000:]
    results: dict[str, Any] = json.loads((root / "out" / "results.json").read_text())
    return results


@pytest.mark.parametrize("scenario", sorted(patch_probe.controls()))
def test_the_probed_stages_pass_with_every_patch_on(probes: dict[str, Any], scenario: str) -> None:
    ranks = probes[f"control:{scenario}"]["ranks"]
    assert [r["stage"] for r in ranks] == ["ok"] * patch_probe.SCENARIOS[scenario].world, ranks


@pytest.mark.parametrize("name", list(patch_probe.PROBES))
def test_switching_the_patch_off_breaks_megatron(probes: dict[str, Any], name: str) -> None:
    probe, ranks = patch_probe.PROBES[name], probes[name]["ranks"]
    assert any(r["stage"] != "ok" for r in ranks), f"patch {name!r} is no longer needed (the probe passed without it)"
    assert [r["stage"] for r in ranks] == [probe.stage] * len(ranks), ranks
    assert any(probe.error in r["error"] for r in ranks), ranks


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


_TE_NAMES_CODE = """
import os, sys, torch, torch.distributed as dist
from transformers import AutoConfig
from megatron.core import parallel_state
from megatron.core.transformer.moe import moe_utils
from miles_megatron.bridge import build_bridge, te_available
from miles_megatron.settings import MegatronSettings
assert not te_available() and not hasattr(moe_utils, "te_general_gemm")
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
parallel_state.initialize_model_parallel(1, 1)
build_bridge(AutoConfig.from_pretrained(sys.argv[1]), cpu=False, dtype=torch.bfloat16, options=MegatronSettings(),
             vocab_divisor=None)
print("filled" if getattr(moe_utils, "te_general_gemm", "missing") is None else "missing")
"""


@pytest.mark.parametrize("disabled", ["", "moe_te_names"])
def test_without_transformer_engine_the_bridge_fills_the_moe_names_on_gpu_too(tmp_path: Path, disabled: str) -> None:
    """Megatron's MoE router reads ``moe_utils.te_general_gemm``, defined only when TransformerEngine imports:
    on a GPU without TransformerEngine the MoE forward raised ``NameError`` (seen on an H200) until the bridge
    filled the names for every device, not only for CPU ranks."""
    from miles.net import free_port
    from miles.testing.models import build_tiny_model

    model = build_tiny_model(tmp_path / "moe", "qwen2_moe", seed=1)
    proc = run_script(
        ["-c", _TE_NAMES_CODE, str(model), str(free_port())], env={"MILES_MEGATRON_DISABLE_PATCHES": disabled}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == ("missing" if disabled else "filled")
