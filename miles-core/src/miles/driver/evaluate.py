"""Rollout-only jobs: ``miles generate`` (samples to JSONL) and ``miles eval`` (pass@k, mean reward)."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.types import SampleGroup, SampleStatus

if TYPE_CHECKING:
    from miles.compose import Run
    from miles.rewards.scoring import Scorer
    from miles.rollout.client import EngineClient
    from miles.settings.model import MilesSettings

__all__ = ["eval_due", "eval_metrics", "evaluate_once", "generate_rollouts", "pass_at_k"]

log = logging.getLogger(__name__)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def eval_metrics(groups: Sequence[SampleGroup], *, ks: Sequence[int], threshold: float = 1.0) -> dict[str, float]:
    """Mean reward and pass@k over groups (a sample passes when its reward reaches ``threshold``)."""
    samples = [s for g in groups for s in g.samples]
    out = {"eval/reward_mean": sum(s.reward or 0.0 for s in samples) / max(len(samples), 1)}
    for k in ks:
        scores = []
        for g in groups:
            n = len(g.samples)
            if k > n:
                continue
            c = sum(1 for s in g.samples if s.status != SampleStatus.FAILED and (s.reward or 0.0) >= threshold)
            scores.append(pass_at_k(n, c, k))
        if scores:
            out[f"eval/pass@{k}"] = sum(scores) / len(scores)
    return out


async def evaluate_once(run: Run, client: EngineClient, scorer: Scorer, *, tokenizer: Any) -> dict[str, float]:
    """One pass over ``data.eval_path``: each prompt sampled ``max(train.eval_pass_k)`` times, scored;
    returns mean reward and pass@k (``eval/*``)."""
    settings = run.settings
    assert settings.data.eval_path is not None
    ks = sorted(set(settings.train.eval_pass_k))
    source = run.data_source(tokenizer, path=settings.data.eval_path, shuffle=False)
    rows = len(source)  # type: ignore[arg-type]
    rollout = settings.rollout.model_copy(update={"n_samples_per_prompt": max(ks), "rollout_batch_size": rows})
    manager = run.rollout_manager(client, scorer, rollout=rollout, seed_offset=1_000_003, filter_groups=False)
    result = await manager.rollout(source)
    return eval_metrics(result.groups, ks=ks)


def eval_due(step: int, settings: MilesSettings) -> bool:
    """Whether step ``step`` of a training run evaluates (every ``train.eval_interval`` steps and the last)."""
    interval = settings.train.eval_interval
    return interval is not None and (step % interval == 0 or step == settings.train.num_rollouts)


async def generate_rollouts(
    run: Run, client: EngineClient, *, num_rollouts: int, data_path: str | None = None, out: Path | None = None
) -> list[SampleGroup]:
    """Run ``num_rollouts`` rollouts against running engines, scored; optionally write samples JSONL."""
    data = run.data_source(run.tokenizer, path=data_path)
    scorer = run.scorer()
    manager = run.rollout_manager(client, scorer, filter_groups=False)
    groups: list[SampleGroup] = []
    try:
        for i in range(num_rollouts):
            result = await manager.rollout(data)
            groups.extend(result.groups)
            log.info(
                "rollout %d/%d: %s",
                i + 1,
                num_rollouts,
                json.dumps({k: round(v, 4) for k, v in result.metrics.items()}),
            )
    finally:
        await manager.close()  # the rollout function's services (a session server)
        await scorer.close()
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            for group in groups:
                for sample in group.samples:
                    f.write(sample.to_json() + "\n")
    return groups
