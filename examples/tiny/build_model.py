"""Build the tiny random model of the smoke config: ``python examples/tiny/build_model.py runs/tiny-model``."""

from __future__ import annotations

import sys

from miles.testing.models import build_tiny_model

if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "runs/tiny-model"
    print(build_tiny_model(out, "qwen2", seed=0))
