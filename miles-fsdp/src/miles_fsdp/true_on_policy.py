"""True on-policy (``train.true_on_policy``): the trainer's logprobs are the rollout engine's, bit for bit.

The local engine in deterministic mode (``enable_deterministic_inference``) computes every response token's
logprob the same way whatever else runs: it prefills the sequence's tokens but the last prompt token from
position 0 (in chunks of ``_CHUNK``), then feeds one token per decode step, each attending over exactly its
own KV, and takes the log-softmax of that step's fp32 logits (after the ``min_new_tokens`` mask, at the
sampling temperature). A trainer's packed full-sequence forward sums in other orders (one GEMM over every
token, a causal attention kernel over the whole sequence), which changes the last bits of every logprob:
~1e-6 in float32, ~1e-2 in bfloat16.

:class:`EngineReplica` runs the engine's own model runner (:func:`miles.engine.replay.load_runner`) in the trainer
process on the trainer's current weights (loaded as the engine loads a weight update, so the dtype cast is
the engine's), and replays that schedule for each request (:mod:`miles.engine.replay`): the same kernels
(packed oneDNN GEMMs, Miles' CPU kernels or SDPA, as the engine resolved them on this machine), the same
shapes, the same order. Its logprobs are exactly the engine's. A multi-turn session's sample is one request
per policy turn (``Sample.request_spans``): each turn is replayed as its own request, so every policy token
of an agent episode is exact too; the tool, user and template tokens between the turns keep the trainer's
own values (no request sampled them, and the loss masks them out).

Gradients: the train step's loss sees ``replayed + (own - own.detach())``, whose value is the replayed
logprob exactly and whose gradient is that of the trainer's own differentiable forward (the same function,
rounded differently: the engine's inference kernels have no backward). So the importance ratio of an
on-policy step is exactly 1 and ``fidelity/train_rollout_logprob_abs_diff`` is exactly 0.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from miles.engine.replay import engine_logprobs
from miles.errors import SettingsError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from miles.settings.model import MilesSettings
    from miles.training.batch import TrainBatch

__all__ = ["EngineReplica", "check_true_on_policy", "engine_logprobs", "exact_or_own", "with_exact_values"]

log = logging.getLogger(__name__)


def check_true_on_policy(settings: MilesSettings) -> None:
    """Refuse, naming the setting, every combination under which the replica cannot be the engine's
    computation (``build_run`` calls it through :meth:`FSDPTrainer.check_settings`)."""
    if not settings.train.true_on_policy:
        return
    rollout = settings.rollout
    options = rollout.engine.options
    why = "train.true_on_policy replays the local engine's deterministic computation in the trainer"
    problems = []
    if rollout.engine.name != "local":
        problems.append(f"rollout.engine.name = {rollout.engine.name!r}: {why}; use the local engine")
    if not options.get("enable_deterministic_inference", False):
        problems.append(f"rollout.engine.enable_deterministic_inference must be true: {why}")
    if options.get("attention_backend", "auto") != "auto":
        problems.append(
            f"rollout.engine.attention_backend = {options['attention_backend']!r}: {why}, which resolves "
            "'auto' as the engines do on this machine; leave it 'auto'"
        )
    if rollout.engine_dtype != "auto":
        problems.append(
            f"rollout.engine_dtype = {rollout.engine_dtype!r}: the replica serves the precision recipe's dtype; "
            "leave it 'auto'"
        )
    if settings.cluster.device != "cpu":
        problems.append(f"cluster.device = {settings.cluster.device!r}: true on-policy is exact on CPU only for now")
    if rollout.mode != "sync":
        problems.append(
            f"rollout.mode = {rollout.mode!r}: a response sampled across a weight update has no single weight "
            "version to replay; use sync"
        )
    if problems:
        raise SettingsError("\n".join(problems))


def _full_weights(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, full tensor)`` of every parameter (a collective on a sharded model: every rank gathers)."""
    from miles_fsdp.weights import hf_name

    for name, param in module.named_parameters():
        data = param.detach()
        full_tensor = getattr(data, "full_tensor", None)
        yield hf_name(name), (full_tensor() if full_tensor is not None else data)


class EngineReplica:
    """The local engine's model runner inside the trainer, kept at the trainer's weights.

    :param model_path: the policy's HF directory (what the engines load).
    :param dtype: the dtype the engines serve (``Run.engine_dtype``).
    :param attention_backend: the engines' ``attention_backend`` option (``auto`` resolves as theirs does on
        this machine).
    """

    def __init__(self, model_path: str, *, dtype: str, attention_backend: str = "auto") -> None:
        from miles.engine.replay import load_runner

        self.runner = load_runner(model_path, device="cpu", dtype=dtype, attention_backend=attention_backend)
        self.synced_step: int | None = None
        """The trainer step whose weights the runner holds (``None``: not loaded yet)."""

    def sync(self, module: nn.Module, step: int) -> None:
        """Load ``module``'s weights (every rank joins the gathers) unless step ``step``'s are loaded."""
        if self.synced_step == step:
            return
        count = self.runner.load_tensors(_full_weights(module), source="the trainer's weights")
        self.synced_step = step
        log.debug("true on-policy replica: %d tensors of step %d loaded", count, step)

    def logprobs(self, batch: TrainBatch, indices: Sequence[int], temperature: float) -> list[torch.Tensor]:
        """The engine's logprob of every response token of sequences ``indices`` that a request sampled
        (fp32, ``[R_i]`` each; NaN at the tokens between a session's turns)."""
        from miles.engine.replay import request_logprobs
        from miles.training.logit_masks import LOGIT_MASK_IDS
        from miles.training.request_spans import REQUEST_INDEX, spans_of

        out = []
        for i in indices:
            tokens = batch.sequence(i)
            prompt = int(batch.prompt_lengths[i])
            masks = batch.response_tensor_rows(LOGIT_MASK_IDS, [i])
            requests = batch.response_tensor_rows(REQUEST_INDEX, [i])
            if requests is None or bool((requests == 0).all()):
                _check_one_request(batch, i)
                spans: list[tuple[int, int]] = []
            else:
                spans = spans_of(requests)
            out.append(request_logprobs(self.runner, tokens, prompt, spans, temperature, masks))
        return out


def _check_one_request(batch: TrainBatch, i: int) -> None:
    """Refuse a sequence that looks like several requests but says nothing of them: trained tokens after
    untrained ones (a multi-turn rollout function that sets no ``Sample.request_spans``)."""
    mask = batch.token_field("loss_mask", [i])
    if mask is None:
        return
    trained = (mask > 0).tolist()
    first_gap = next((t for t in range(1, len(trained)) if trained[t - 1] and not trained[t]), None)
    if first_gap is not None and any(trained[first_gap:]):
        raise SettingsError(
            f"train.true_on_policy: sequence {i} of the batch trains on tokens after untrained ones (a multi-turn "
            "response) but its sample has no request_spans, so the trainer cannot replay the engine requests that "
            "sampled it; a rollout function that makes several requests per sample must set Sample.request_spans "
            "(sessions do)"
        )


def exact_or_own(own: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """``exact``'s values, ``own``'s where ``exact`` is NaN (tokens no engine request sampled)."""
    import torch

    exact = exact.to(own.device, own.dtype)
    return torch.where(torch.isnan(exact), own.detach(), exact)


def with_exact_values(own: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """``exact``'s values (``own``'s where it is NaN) with ``own``'s gradient: ``exact + (own - own.detach())``
    (``own - own.detach()`` is exactly 0 for finite values)."""
    return exact_or_own(own, exact) + (own - own.detach())
