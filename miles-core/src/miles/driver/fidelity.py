"""The always-on fidelity signals of a step that the driver computes itself: how far the trainer's logprobs
of the rollout's tokens are from the engine's, before the step's update (the trainer's own signals, such as
routing agreement, come with its step metrics), and the warning when that exceeds ``log.logprob_diff_warn``."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from miles.training.comm import all_gather_json

if TYPE_CHECKING:
    from miles.settings.model import MilesSettings
    from miles.training.batch import TrainBatch

__all__ = ["mismatch_metrics", "optimizer_step_metrics", "scoring_temperature_of", "warn_on_mismatch"]

log = logging.getLogger(__name__)


def scoring_temperature_of(settings: MilesSettings) -> float:
    """The temperature of the distribution the engines report logprobs of (what the trainer scores at): the
    sampling temperature, or 1 for greedy decoding and engines reporting the raw logits' logprobs."""
    from miles.training.logprobs import scoring_temperature

    rollout = settings.rollout
    original = bool(rollout.engine.options.get("return_original_logprob", False))
    return scoring_temperature(rollout.temperature, top_k=rollout.top_k, original_logprobs=original)


def mismatch_metrics(batches: list[TrainBatch], version: int | None = None) -> dict[str, float]:
    """|trainer - rollout| logprob difference over trained tokens, before the step's updates, all ranks.

    With ``version`` (the weight version the trainer holds), also over the *fresh* samples alone, those whose
    every token was sampled by that version (``fidelity/train_rollout_logprob_abs_diff_fresh``, when there are
    any): in the async modes the older samples differ by the policy's change as well, the fresh ones only by
    how the engine and the trainer compute (exactly 0.0 with ``train.true_on_policy``)."""
    import torch

    total = count = largest = fresh_total = fresh_count = fresh_largest = 0.0
    for batch in batches:
        if batch.old_logprobs is None or batch.rollout_logprobs is None:
            return {}
        trained = batch.loss_mask != 0
        diff = (batch.old_logprobs.double() - batch.rollout_logprobs.double()).abs()
        total += float(diff[trained].sum())
        count += float(trained.sum())
        largest = max(largest, float(diff[trained].max())) if bool(trained.any()) else largest
        if version is not None:
            lengths = torch.diff(torch.tensor(batch.response_offsets))
            fresh_rows = torch.repeat_interleave(batch.weight_versions == version, lengths)
            fresh = trained & fresh_rows
            fresh_total += float(diff[fresh].sum())
            fresh_count += float(fresh.sum())
            fresh_largest = max(fresh_largest, float(diff[fresh].max())) if bool(fresh.any()) else fresh_largest
    parts = all_gather_json([total, count, largest, fresh_total, fresh_count, fresh_largest])
    tokens = sum(p[1] for p in parts)
    if not tokens:
        return {}
    out = {
        "fidelity/train_rollout_logprob_abs_diff": sum(p[0] for p in parts) / tokens,
        "fidelity/train_rollout_logprob_abs_diff_max": max(p[2] for p in parts),
    }
    fresh_tokens = sum(p[4] for p in parts)
    if fresh_tokens:
        out["fidelity/train_rollout_logprob_abs_diff_fresh"] = sum(p[3] for p in parts) / fresh_tokens
        out["fidelity/train_rollout_logprob_abs_diff_fresh_max"] = max(p[5] for p in parts)
        out["fidelity/fresh_token_fraction"] = fresh_tokens / tokens
    return out


def optimizer_step_metrics(step_metrics: list[dict[str, float]]) -> dict[str, float]:
    """The metrics of a rollout's optimizer steps, averaged, as ``train/*``; the trainer's fidelity signals
    (routing agreement) keep their ``fidelity/`` prefix. When the rollout trained in one on-policy step the
    driver skipped the old logprobs, and the step measured the trainer/rollout mismatch before its update:
    that is the step's ``fidelity/train_rollout_logprob_abs_diff``."""
    out: dict[str, float] = {}
    for key in step_metrics[0] if step_metrics else []:
        values = [row[key] for row in step_metrics if key in row]
        out[key if key.startswith("fidelity/") else f"train/{key}"] = sum(values) / len(values)
    if len(step_metrics) == 1 and "train_rollout_logprob_abs_diff" in step_metrics[0]:
        out["fidelity/train_rollout_logprob_abs_diff"] = step_metrics[0]["train_rollout_logprob_abs_diff"]
    return out


def warn_on_mismatch(step: int, metrics: dict[str, float], settings: MilesSettings) -> None:
    """Rank 0: a warning when the step's mismatch exceeds ``log.logprob_diff_warn``."""
    diff = metrics.get("fidelity/train_rollout_logprob_abs_diff")
    threshold = settings.log.logprob_diff_warn
    if diff is not None and diff > threshold:
        log.warning("step %d: |train - rollout| logprob difference %.4f exceeds %.4f", step, diff, threshold)
