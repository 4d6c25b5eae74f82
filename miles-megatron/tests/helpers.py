"""Shared by the tests: run a helper script in its own process and read safetensors directories."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def run_script(
    args: list[str], *, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` with the test environment (threads pinned, hub offline)."""
    full_env = {**os.environ, **ENV, **(env or {})}
    return subprocess.run([sys.executable, *args], env=full_env, capture_output=True, text=True, timeout=timeout)


def load_dir(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    return weights
