"""What a run keeps on disk of each step's samples, beside the metrics: the rollout's samples as the engines
produced them (``samples/rollout_<step>.jsonl``) and, when the step computed them, the trainer's logprobs of
the same tokens before its update (``samples/trainer_logprobs_<step>.jsonl``); ``miles view`` reads both."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles.training.batch import TrainBatch
    from miles.types import SampleGroup

__all__ = ["SampleRecords"]


class SampleRecords:
    """Writes a run's per-step sample files into ``run_dir/samples`` (rank 0 writes; see each method)."""

    def __init__(self, run_dir: Path, *, is_driver: bool) -> None:
        self.folder = run_dir / "samples"
        self.is_driver = is_driver

    def rollout(self, step: int, groups: list[SampleGroup]) -> None:
        """Rank 0: every sample of step ``step``, one JSON line each."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"rollout_{step:06d}.jsonl", "w", encoding="utf-8") as f:
            for group in groups:
                for sample in group.samples:
                    f.write(sample.to_json() + "\n")

    def trainer_logprobs(self, step: int, batches: list[TrainBatch], groups: list[SampleGroup] | None) -> None:
        """Every rank (a collective): the trainer's logprobs of each sample before step ``step``'s update,
        written by rank 0 beside the step's samples; nothing when the step did not compute them."""
        import torch

        from miles.training.comm import all_gather_tensors

        if not batches or any(b.old_logprobs is None for b in batches):
            return
        rows: list[Any] = []
        for batch in batches:  # each step's share per rank, in rank order: the samples' order
            assert batch.old_logprobs is not None
            local = {"logprobs": batch.old_logprobs, "lengths": torch.tensor(batch.response_lengths)}
            for part in all_gather_tensors(local):
                rows.extend(part["logprobs"].split(part["lengths"].tolist()))
        if not self.is_driver or groups is None:
            return
        samples = [s for g in groups for s in g.samples]
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"trainer_logprobs_{step:06d}.jsonl", "w", encoding="utf-8") as f:
            for sample, row in zip(samples, rows, strict=True):
                record = {"group_id": sample.group_id, "index": sample.index, "logprobs": row.tolist()}
                f.write(json.dumps(record) + "\n")
