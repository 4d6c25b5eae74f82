"""Each trainer rank's random generator states in a checkpoint (``rng/rank<r>.safetensors``).

Saved beside the model and optimizer state by every backend so that a resumed run draws the same numbers
(dropout, sampling in the trainer) as the uninterrupted one; tensors in safetensors, never pickles.
"""

from __future__ import annotations

import logging
from pathlib import Path

__all__ = ["load_rng_state", "save_rng_state"]

log = logging.getLogger(__name__)


def _file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / "rng" / f"rank{rank}.safetensors"


def save_rng_state(checkpoint: str | Path, rank: int) -> None:
    """Write this rank's torch CPU (and, when CUDA is up, CUDA) generator states into ``checkpoint``."""
    import torch
    from safetensors.torch import save_file

    path = _file(Path(checkpoint), rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    save_file(rng, str(path))


def load_rng_state(checkpoint: str | Path, rank: int) -> bool:
    """Restore what :func:`save_rng_state` wrote for ``rank``; ``False`` (and a warning) when the checkpoint
    has none for it (saved with another world size)."""
    import torch
    from safetensors.torch import load_file

    path = _file(Path(checkpoint), rank)
    if not path.exists():
        log.warning("%s has no RNG state for rank %d (saved with another world size?)", checkpoint, rank)
        return False
    rng = load_file(str(path))
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return True
