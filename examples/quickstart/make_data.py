"""Write the quickstart's arithmetic prompts: ``python examples/quickstart/make_data.py``.

Small additions and subtractions, answered in one number. SmolLM2-135M-Instruct gets a fair share
right when sampling (neither 0 % nor 100 %), so GRPO has a signal to climb on.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent


def make(n: int, seed: int) -> list[dict[str, object]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(2, 30), rng.randint(2, 9)
        op = "+" if rng.random() < 0.75 else "-"
        answer = a + b if op == "+" else a - b
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"What is {a} {op} {b}? Reply with the number only."}],
                "label": str(answer),
            }
        )
    return rows


if __name__ == "__main__":
    for name, n, seed in (("train", 512, 0), ("eval", 64, 1)):
        path = HERE / f"{name}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for row in make(n, seed):
                f.write(json.dumps(row) + "\n")
        print(f"wrote {n} rows to {path}")
