"""Build the tiny vision-language model and the "how many red squares?" data of ``grpo_tiny_vlm.toml``:

    python examples/vlm/make_inputs.py runs/vlm

writes ``runs/vlm/model`` (a random tiny Qwen2-VL with its tokenizer and image processor) and
``runs/vlm/data/train.jsonl`` with its PNG images.
"""

from __future__ import annotations

import sys
from pathlib import Path

from miles.testing.vlm import build_tiny_vlm, write_squares_task

if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/vlm")
    print(build_tiny_vlm(out / "model", seed=0))
    print(write_squares_task(out / "data", 64, seed=0))
