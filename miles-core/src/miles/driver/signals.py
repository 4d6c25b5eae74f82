"""Signal checks: cheap per-step checks that the signals a run learns from are alive (``log.signals``).

A run can look healthy while a signal is dead: a frozen teacher that answers uniform logprobs for every
token, a reward that is the same for every sample, a push after which the engines serve the same policy,
a loss whose gradient never reaches the parameters. Each check below measures one of them every step:

- ``teacher_logprobs_uniform`` / ``ref_logprobs_uniform``: the root mean square of ``logprob + log V`` over
  the step's trained tokens (``V``: the tokenizer's vocabulary) is at most ``uniform_tolerance``;
- ``teacher_logprobs_constant`` / ``ref_logprobs_constant``: their standard deviation is at most
  ``constant_tolerance``;
- ``reward_constant``: every scored sample of the step has the same reward;
- ``reward_uncorrelated``: over the last ``reward_window`` steps the reward's largest absolute correlation
  with the samples' features (response length, prompt length, mean rollout logprob) is at most
  ``reward_min_correlation``;
- ``probe_unchanged``: after the push of a step that trained (gradient norm above 0), each engine's
  logprobs of a fixed probe sequence (the first :data:`SIGNAL_PROBE_TOKENS` tokens of the one of
  ``transport.verify_with = "logprobs"``) moved by at most
  ``probe_min_change`` on average since the previous push;
- ``grad_zero``: the gradient norm is at most ``grad_zero_tolerance`` while the advantages are not all 0.

Each check's metric ``signals/<check>`` is 1 in a step where it fired and 0 where it was measured and did
not; a warning names the check and its setting, or with ``log.signals.stop`` a :class:`SignalCheckError`
stops the run (after the step's metrics are logged).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from miles.errors import SignalCheckError
from miles.training.comm import all_gather_json

if TYPE_CHECKING:
    from miles.rollout.client import EngineClient
    from miles.settings.signals import SignalSettings
    from miles.training.batch import TrainBatch
    from miles.types import SampleGroup

__all__ = ["SIGNAL_PROBE_TOKENS", "SignalChecks", "logprob_spread", "pearson"]

log = logging.getLogger(__name__)

SIGNAL_PROBE_TOKENS = 9
"""``probe_unchanged`` probes the first this many tokens of the verification probe (8 logprobs). A trained weight
moves the logprob at every position (an embedding row only where its token is), so the check needs a few
positions, not the 35 of SmolLM2's verification probe; 8 rows are one forward of the local engine's row kernel,
which reads each weight once: on an AMD EPYC the probe took 23-49 ms after each push instead of 80-135."""

_LOGPROB_FIELDS = (("teacher", "teacher_logprobs"), ("ref", "ref_logprobs"))


def logprob_spread(batches: Sequence[TrainBatch]) -> dict[str, float]:
    """Every rank (a collective): the count, mean and standard deviation of the teacher's and the
    reference's logprobs over the trained tokens of every rank's ``batches``, as ``signals/<who>_logprob_*``;
    and the mean |advantage| (``signals/advantage_abs_mean``). Fields no batch has are left out."""
    import torch

    local: dict[str, list[float]] = {}  # name -> [count, mean, sum of squared deviations]
    named = [*_LOGPROB_FIELDS, ("advantage", "advantages")]
    for who, name in named:
        values = [getattr(b, name)[b.loss_mask != 0] for b in batches if getattr(b, name) is not None]
        if not values:
            continue
        x = torch.cat(values).double()
        mean = float(x.mean()) if x.numel() else 0.0
        if who == "advantage":
            local[who] = [float(x.numel()), float(x.abs().mean()) if x.numel() else 0.0, 0.0]
        else:
            local[who] = [float(x.numel()), mean, float(((x - mean) ** 2).sum())]
    out: dict[str, float] = {}
    for who, _ in named:
        parts = [p[who] for p in all_gather_json(local) if who in p]
        n = sum(p[0] for p in parts)
        if not parts or not n:
            continue
        mean = sum(p[0] * p[1] for p in parts) / n
        if who == "advantage":
            out["signals/advantage_abs_mean"] = mean
            continue
        squares = sum(p[2] + p[0] * (p[1] - mean) ** 2 for p in parts)  # Chan's combination of the ranks
        out[f"signals/{who}_logprob_tokens"] = n
        out[f"signals/{who}_logprob_mean"] = mean
        out[f"signals/{who}_logprob_std"] = math.sqrt(squares / n)
    return out


def pearson(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Pearson's correlation of ``x`` and ``y``; ``None`` when either is constant."""
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxx = sum((a - mx) ** 2 for a in x)
    syy = sum((b - my) ** 2 for b in y)
    if sxx <= 0.0 or syy <= 0.0:
        return None
    return sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / math.sqrt(sxx * syy)


class SignalChecks:
    """The checks of one run. Every rank calls :func:`logprob_spread` on its batches; rank 0 adds the
    reward's (:meth:`reward_metrics`) and the probe's (:meth:`probe_metrics`) measurements and judges the
    step (:meth:`judge`).

    :param vocab_size: the size of the vocabulary a uniform distribution spreads over (the tokenizer's).
    """

    def __init__(self, settings: SignalSettings, *, vocab_size: int | None) -> None:
        self.settings = settings
        self.vocab_size = vocab_size
        self._rewards: deque[list[tuple[float, list[float]]]] = deque(maxlen=settings.reward_window)
        self._probe: dict[str, list[float]] = {}
        """The last probe logprobs of each engine."""
        self._messages: dict[str, str] = {}

    def active(self, check: str) -> bool:
        return self.settings.enabled and check not in self.settings.disable

    # -- measurements (rank 0) ----------------------------------------------------------------------
    def reward_metrics(self, groups: Sequence[SampleGroup]) -> dict[str, float]:
        """The spread of the step's rewards and, once ``reward_window`` steps are in, the reward's largest
        absolute correlation with the samples' features over them."""
        rows: list[tuple[float, list[float]]] = []
        for group in groups:
            for s in group.samples:
                if s.reward is None or not s.response_length:
                    continue
                trained = [lp for lp, m in zip(s.rollout_logprobs, s.loss_mask, strict=False) if m]
                confidence = sum(trained) / len(trained) if trained else 0.0
                rows.append((float(s.reward), [float(s.response_length), float(len(s.prompt_ids)), confidence]))
        if not rows:
            return {}
        rewards = [r for r, _ in rows]
        mean = sum(rewards) / len(rewards)
        out = {
            "signals/reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)),
            "signals/reward_samples": float(len(rows)),
        }
        self._rewards.append(rows)
        if len(self._rewards) == self._rewards.maxlen:
            pooled = [row for step in self._rewards for row in step]
            y = [r for r, _ in pooled]
            corrs = [pearson([f[i] for _, f in pooled], y) for i in range(len(pooled[0][1]))]
            known = [abs(c) for c in corrs if c is not None]
            if known:
                out["signals/reward_feature_corr"] = max(known)
        return out

    async def probe_metrics(self, client: EngineClient, probe: Sequence[int]) -> dict[str, float]:
        """Each engine's logprobs of ``probe`` now against the last time: the smallest mean |change| over the
        engines (``signals/probe_logprob_change``; none the first time or for a new engine)."""
        from miles.errors import EngineError
        from miles.transport.verify import engine_probe_logprobs

        changes: list[float] = []
        for url in client.urls:
            try:
                now = await engine_probe_logprobs(client, url, probe)
            except EngineError as exc:  # (an engine that died since the push: failover deals with it, not a signal)
                log.info("probe_unchanged: engine %s gave no probe logprobs (%s); not measured this step", url, exc)
                self._probe.pop(url, None)
                continue
            before = self._probe.get(url)
            self._probe[url] = now
            if before is not None and len(before) == len(now):
                changes.append(sum(abs(a - b) for a, b in zip(now, before, strict=True)) / len(now))
        return {"signals/probe_logprob_change": min(changes)} if changes else {}

    # -- the verdict (rank 0) -----------------------------------------------------------------------
    def judge(self, step: int, metrics: dict[str, float]) -> list[str]:
        """Evaluate every check on the step's ``metrics`` and add its ``signals/<check>`` flag; warn about
        each that fired. Returns the names of those that fired (:meth:`stop_if_fired` ends the run)."""
        cfg = self.settings
        if not cfg.enabled:
            return []
        verdicts: dict[str, tuple[bool, str]] = {}
        for who in ("teacher", "ref"):
            std = metrics.get(f"signals/{who}_logprob_std")
            mean = metrics.get(f"signals/{who}_logprob_mean")
            if std is None or mean is None:
                continue
            what = "teacher's" if who == "teacher" else "reference model's"
            if self.vocab_size:
                rms = math.sqrt(std**2 + (mean + math.log(self.vocab_size)) ** 2)
                metrics[f"signals/{who}_uniform_rms"] = rms
                verdicts[f"{who}_logprobs_uniform"] = (
                    rms <= cfg.uniform_tolerance,
                    f"the {what} logprobs are uniform over the {self.vocab_size}-token vocabulary "
                    f"(rms of logprob + log V = {rms:.3g} <= log.signals.uniform_tolerance = {cfg.uniform_tolerance:g})",
                )
            verdicts[f"{who}_logprobs_constant"] = (
                std <= cfg.constant_tolerance,
                f"the {what} logprobs are the same for every token ({mean:.4f}, std {std:.3g} <= "
                f"log.signals.constant_tolerance = {cfg.constant_tolerance:g})",
            )
        reward_std = metrics.get("signals/reward_std")
        if reward_std is not None and metrics.get("signals/reward_samples", 0.0) > 1:
            verdicts["reward_constant"] = (
                reward_std == 0.0,
                f"every sample of the step has the same reward ({metrics.get('reward/mean', float('nan')):.4g})",
            )
        corr = metrics.get("signals/reward_feature_corr")
        if corr is not None:
            verdicts["reward_uncorrelated"] = (
                corr <= cfg.reward_min_correlation,
                f"over the last {cfg.reward_window} steps the reward's correlation with response length, prompt "
                f"length and mean rollout logprob is at most {corr:.3g} (log.signals.reward_min_correlation = "
                f"{cfg.reward_min_correlation:g})",
            )
        change = metrics.get("signals/probe_logprob_change")
        grad = metrics.get("train/grad_norm")
        if change is not None and grad is not None and grad > 0.0:
            verdicts["probe_unchanged"] = (
                change <= cfg.probe_min_change,
                f"the step trained (grad norm {grad:.3g}) but the engines' logprobs of the probe sequence moved by "
                f"{change:.3g} on average after the push (log.signals.probe_min_change = {cfg.probe_min_change:g}): "
                "a learning rate too small for the weights' dtype, a frozen model, or weights that never reached "
                "the engines",
            )
        advantages = metrics.get("signals/advantage_abs_mean")
        if grad is not None and advantages is not None and advantages > 0.0:
            verdicts["grad_zero"] = (
                grad <= cfg.grad_zero_tolerance,
                f"the gradient norm is {grad:.3g} (log.signals.grad_zero_tolerance = {cfg.grad_zero_tolerance:g}) "
                f"while the advantages are not 0 (mean |advantage| {advantages:.3g}): no gradient reaches the "
                "parameters",
            )
        fired: list[str] = []
        for check, (bad, message) in verdicts.items():
            if not self.active(check):
                continue
            metrics[f"signals/{check}"] = 1.0 if bad else 0.0
            if bad:
                fired.append(check)
                log.warning("step %d: signal check %s: %s", step, check, message)
        self._messages = {check: verdicts[check][1] for check in fired}
        return fired

    def stop_if_fired(self, step: int, fired: Sequence[str]) -> None:
        """With ``log.signals.stop``: raise :class:`SignalCheckError` naming the first check that fired."""
        if fired and self.settings.stop:
            check = fired[0]
            raise SignalCheckError(
                f"step {step}: signal check {check!r} fired: {self._messages[check]} "
                f"(log.signals.stop = true; disable this check with log.signals.disable = [{check!r}])"
            )
