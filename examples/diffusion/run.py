"""Flow-GRPO on a laptop CPU in a few minutes: ``python examples/diffusion/run.py [RUN_ROOT]``.

Builds the tiny SD3-style policy and the prompts, runs ``miles train`` on ``flow_grpo_tiny.toml`` (an image
engine process, a trainer rank, disk weight pushes verified by checksum), then writes
``<RUN_ROOT>/flow_grpo/curves.png`` (``miles plot``: reward, KL, train-vs-rollout log-prob gap, timings) and
``<RUN_ROOT>/before_after.png``: the same prompts and seeds sampled by the initial policy (top rows) and by
the trained one (bottom rows).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPTS = ["a red square", "a green cat", "a blue sky", "a white house"]


def sample_grid(policy: Path, seeds: list[int]) -> object:
    """One row of images per prompt, one column per seed, as the recipe's engine samples them."""
    import numpy as np

    from miles_diffusion.policy import load_pipeline
    from miles_diffusion.sampling import SamplingOptions, sample_trajectories

    pipe = load_pipeline(policy)
    options = SamplingOptions(num_steps=6, height=32, width=32, noise_level=0.7, max_sequence_length=16)
    rows = []
    for prompt in PROMPTS:
        images = [t.image for t in sample_trajectories(pipe, [prompt] * len(seeds), seeds, options)]
        rows.append(np.concatenate(images, axis=1))
    return np.concatenate(rows, axis=0)


def main() -> None:
    import numpy as np
    from PIL import Image

    sys.path.insert(0, str(HERE))
    from make_inputs import make_inputs

    root = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/diffusion").resolve()
    policy, prompts = make_inputs(root)
    run_dir = root / "flow_grpo"
    overrides = [f"train.model_path={policy}", f"data.path={prompts}", f"log.run_dir={run_dir}"]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, "-m", "miles", "train", str(HERE / "flow_grpo_tiny.toml")]
    subprocess.run([*cmd, *[a for o in overrides for a in ("--set", o)]], check=True, env=env)
    subprocess.run([sys.executable, "-m", "miles", "plot", str(run_dir)], check=True, env=env)
    seeds = [11, 12, 13, 14, 15, 16]
    before, after = sample_grid(policy, seeds), sample_grid(run_dir / "hf", seeds)
    gap = np.full((4, before.shape[1], 3), 255, dtype=np.uint8)
    grid = np.concatenate([before, gap, after], axis=0)
    Image.fromarray(grid).resize((grid.shape[1] * 4, grid.shape[0] * 4), Image.NEAREST).save(root / "before_after.png")
    print(f"reward curve: {run_dir / 'curves.png'}\nimages before (top) / after (bottom): {root / 'before_after.png'}")


if __name__ == "__main__":
    main()
