"""Write the tiny policy and the prompt file the recipe reads (``python examples/diffusion/make_inputs.py DIR``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLOURS = ("red", "green", "blue", "white")
OBJECTS = ("square", "cat", "sky", "house")


def write_prompts(path: Path) -> Path:
    """16 prompts, "a <colour> <object>", the colour as the label (for ``color_match``)."""
    rows = [{"prompt": f"a {c} {o}", "label": c} for c in COLOURS for o in OBJECTS]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def make_inputs(root: Path) -> tuple[Path, Path]:
    """``(policy dir, prompts file)`` under ``root`` (the policy is built once)."""
    from miles_diffusion.policy import build_tiny_policy

    policy = root / "policy"
    if not (policy / "model_index.json").exists():
        build_tiny_policy(policy, seed=0)
    return policy, write_prompts(root / "prompts.jsonl")


if __name__ == "__main__":
    print(*make_inputs(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/diffusion")))
