"""The ``fsdp`` trainer: FSDP2 (``fully_shard``) data parallelism over a Hugging Face causal LM.

One instance per rank; every rank calls the same methods in the same order with its share of the batch.
The same code runs on CPU ranks (gloo) and GPU ranks (NCCL), switched by ``DistContext.device``.

This module imports only the core interfaces at module level; torch and transformers are imported by the
methods (and the sibling modules they use), so registering the plugin stays cheap.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from miles.errors import SettingsError
from miles.training.trainer import DistContext, LogprobOutput, Trainer, WeightBucket, WeightShard
from miles_fsdp.settings import FSDPSettings

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PretrainedConfig

    from miles.algorithms.base import Algorithm
    from miles.precision.base import PrecisionRecipe
    from miles.settings.model import MilesSettings, TrainSettings
    from miles.training.batch import TrainBatch
    from miles.training.routing import RouterReplay
    from miles_fsdp.fused_head import FusedHead
    from miles_fsdp.microbatch import PackedMicroBatch
    from miles_fsdp.true_on_policy import EngineReplica
    from miles_fsdp.vision import VisionInputs

    Part = tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]
    """A trained model with its optimizer and learning-rate scheduler."""

__all__ = ["FSDPTrainer"]

log = logging.getLogger(__name__)


class FSDPTrainer(Trainer[FSDPSettings]):
    """PyTorch FSDP2 over Hugging Face causal LMs: CPU with gloo, GPUs with NCCL; no weight conversion."""

    name: ClassVar[str] = "fsdp"
    supports_adapters: ClassVar[bool] = True
    supports_weights_on_every_rank: ClassVar[bool] = True

    def __init__(
        self, train: TrainSettings, options: FSDPSettings | None, precision: PrecisionRecipe, dist: DistContext
    ) -> None:
        super().__init__(train, options if options is not None else FSDPSettings(), precision, dist)
        self.step = 0
        """Optimizer steps taken (restored by :meth:`load_checkpoint`)."""
        self.actor: nn.Module | None = None
        """The policy (FSDP2-wrapped, or the plain module at world size 1), after :meth:`setup`."""
        self.ref: nn.Module | None = None
        """The frozen reference (``setup(need_ref=True)`` without an adapter: the adapter off is the reference)."""
        self.critic: nn.Module | None = None
        """The value model (``setup(need_values=True)``)."""
        self._parts: dict[str, Part] = {}
        """``{"actor": (model, optimizer, scheduler), "critic": ...}``: what steps and checkpoints."""
        self._config: PretrainedConfig | None = None
        """The actor's Hugging Face config."""
        self._pad_token_id = 0
        """What pads the rows of a micro-batch: the config's pad token, else its EOS."""
        self._onednn = False
        """``onednn_linear`` on a CPU rank: the models' linears run on oneDNN (:mod:`miles_fsdp.onednn_linear`)."""
        self._share_prefixes = False
        """Micro-batches hold a shared prompt once (``share_prefixes`` with ``packed_sdpa``)."""
        self._packed_attention = False
        """The models attend with ``packed_sdpa``: each forward is given its row's layout, computed on the host
        when the micro-batch was packed (no device-to-host copy in any layer)."""
        self._precision_context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
        """A fresh context for each forward (:func:`miles_fsdp.wrap.forward_precision`)."""
        self._heads: dict[int, FusedHead] = {}
        """``id(module)`` -> its :class:`~miles_fsdp.fused_head.FusedHead` (``fused_logprobs``)."""
        self._routing: RouterReplay | None = None
        """MoE actors: the :class:`~miles.training.routing.RouterReplay` its routers go through (R3 and the
        routing-agreement metric; :mod:`miles_fsdp.routing`)."""
        self._vision: VisionInputs | None = None
        """A vision-language actor's image inputs (:mod:`miles_fsdp.vision`)."""
        self._replica: EngineReplica | None = None
        """``train.true_on_policy`` by replay: the engine's model runner at the actor's weights
        (:mod:`miles_fsdp.true_on_policy`)."""
        self._invariant = False
        """``train.true_on_policy`` by the invariant forward: the actor computes with the engine's batch-invariant
        ops (:mod:`miles_fsdp.invariant_forward`)."""

    @classmethod
    def check_settings(cls, options: FSDPSettings, settings: MilesSettings) -> None:
        """Refuse what this trainer cannot do with the rest of the run (``build_run`` calls it): the
        combinations under which ``train.true_on_policy`` cannot be exact."""
        from miles_fsdp.true_on_policy import check_true_on_policy

        check_true_on_policy(settings)

    # -- setup -------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        import torch

        return torch.device("cuda", self.dist.local_rank) if self.dist.device == "cuda" else torch.device("cpu")

    def setup(self, *, need_ref: bool = False, need_values: bool = False) -> None:
        """Load and shard the actor (and a frozen reference / a critic when asked); build optimizers."""
        import torch
        from torch.distributed.device_mesh import init_device_mesh

        from miles.precision.dtypes import torch_dtype
        from miles_fsdp.model import load_causal_lm, load_config, load_value_model
        from miles_fsdp.onednn_linear import install_onednn_linears
        from miles_fsdp.optim import build_optimizer, build_scheduler
        from miles_fsdp.wrap import forward_precision, stays_plain, wrap_model

        train, opts = self.train_settings, self.options
        if not train.model_path:
            raise SettingsError("train.model_path: the fsdp trainer needs a Hugging Face model directory or .gguf file")
        if self.dist.device == "cuda":
            torch.cuda.set_device(self.device)
        mesh = init_device_mesh(self.device.type, (self.dist.world_size,))
        offload = opts.cpu_offload_optimizer and self.dist.device == "cuda"
        if opts.cpu_offload_optimizer and not offload:
            log.warning("[train.backend] cpu_offload_optimizer has no effect on CPU ranks; ignored")
        param_dtype = torch_dtype(self.precision.param_dtype)
        shard = dict(
            mesh=mesh,
            plain=stays_plain(
                self.dist.world_size,
                param_dtype,
                wrap_single_rank=opts.wrap_single_rank,
                true_on_policy=train.true_on_policy,
            ),
            device=self.device,
            param_dtype=param_dtype,
            reduce_dtype=torch_dtype(self.precision.reduce_dtype),
        )
        from miles_fsdp.invariant_forward import INVARIANT_ATTENTION, invariant_unsupported
        from miles_fsdp.packed_attention import PACKED_SDPA

        attn: str = opts.attn_implementation
        if attn in ("auto", "packed_sdpa"):
            from miles_fsdp.packed_attention import packed_unsupported, register_packed_attention

            reason = packed_unsupported(load_config(train.model_path))
            if reason is not None and attn == "packed_sdpa":
                raise SettingsError(f"[train.backend] attn_implementation 'packed_sdpa': {reason}; use 'sdpa'")
            if reason is not None:
                log.info("attention: sdpa (%s, which packed_sdpa does not implement)", reason)
            attn = "sdpa" if reason is not None else register_packed_attention()
        ref_attn = attn
        if train.true_on_policy:
            why = invariant_unsupported(load_config(train.model_path), param_dtype, self.device.type)
            self._invariant = why is None
            if self._invariant:
                from miles_fsdp.invariant_forward import register_invariant_attention

                attn = register_invariant_attention()
            else:
                log.info("true on-policy by replaying the engine (%s)", why)
        from miles_fsdp.vision import VisionInputs, is_vision_config

        vision = is_vision_config(load_config(train.model_path))
        packed = attn in (PACKED_SDPA, INVARIANT_ATTENTION)
        self._share_prefixes = opts.share_prefixes and packed and not vision  # M-RoPE rows are whole
        self._packed_attention = packed

        actor = load_causal_lm(train.model_path, seed=train.seed, attn_implementation=attn)
        actor.config.use_cache = False
        self._onednn = opts.onednn_linear and self.dist.device == "cpu"
        self._config = actor.config
        from miles_fsdp.routing import patch_routers

        self._routing = patch_routers(actor, replay=train.routing_replay, invariant=self._invariant)
        if vision:  # what would score a vision-language policy without its images is refused
            if need_values or train.true_on_policy:
                what = "a PPO critic (need_values)" if need_values else "train.true_on_policy"
                raise SettingsError(f"train.model_path: {what} is not supported for a vision-language model yet")
            self._vision = VisionInputs(actor, train_vision_tower=opts.train_vision_tower)
        if self.adapter is not None:  # the base frozen; the reference is this model with its adapters off
            if train.true_on_policy:
                raise SettingsError("train.true_on_policy: not supported with train.adapter")
            actor = self.adapter.apply(actor)
        if self._invariant:
            from miles_fsdp.invariant_forward import install_invariant_forward

            install_invariant_forward(actor)
        elif self._onednn:
            install_onednn_linears(actor)
        self.actor = wrap_model(
            actor,
            reshard_after_forward=opts.reshard_after_forward,
            cpu_offload=offload,
            activation_checkpointing=opts.activation_checkpointing,
            **shard,
        )
        optimizer = build_optimizer(self.actor.parameters(), train)
        self._parts = {"actor": (self.actor, optimizer, build_scheduler(optimizer, train))}
        if need_ref and self.adapter is None:
            ref = load_causal_lm(train.model_path, seed=train.seed, attn_implementation=ref_attn)
            if self._vision is not None:  # the same image placeholders as the actor's
                self._vision.attach(ref)
            ref.requires_grad_(False)
            ref.eval()
            if self._onednn:
                install_onednn_linears(ref)
            self.ref = wrap_model(
                ref,
                reshard_after_forward=opts.ref_reshard_after_forward,
                cpu_offload=offload,
                activation_checkpointing=False,
                **shard,
            )
        if need_values:
            critic = load_value_model(
                train.model_path, seed=train.seed, attn_implementation=attn, init_std=opts.value_head_init_std
            )
            if self._onednn:
                install_onednn_linears(critic)
            self.critic = wrap_model(
                critic,
                reshard_after_forward=opts.reshard_after_forward,
                cpu_offload=offload,
                activation_checkpointing=opts.activation_checkpointing,
                **shard,
            )
            critic_train = train.model_copy(update={"lr": opts.critic_lr or train.lr})
            critic_opt = build_optimizer(self.critic.parameters(), critic_train)
            self._parts["critic"] = (self.critic, critic_opt, build_scheduler(critic_opt, critic_train))
        if train.true_on_policy and not self._invariant:
            from miles_fsdp.true_on_policy import EngineReplica

            self._replica = EngineReplica(train.model_path, dtype=self.precision.param_dtype)
        self._precision_context = lambda: forward_precision(bool(shard["plain"]), param_dtype, self.device)
        if opts.fused_logprobs:
            self._install_fused_heads()
        pad = self._config.pad_token_id if self._config.pad_token_id is not None else self._config.eos_token_id
        self._pad_token_id = int(pad if isinstance(pad, int) else 0)
        log.info(
            "fsdp trainer ready on %s x%d (%s, params %s, reduce %s, ref=%s, critic=%s)",
            self.dist.device,
            self.dist.world_size,
            "plain module" if shard["plain"] else "FSDP2",
            self.precision.param_dtype,
            self.precision.reduce_dtype,
            need_ref,
            need_values,
        )

    def _require_setup(self) -> None:
        if self.actor is None:
            raise RuntimeError("FSDPTrainer.setup() must be called first")

    # -- forward helpers ---------------------------------------------------------------------------
    def _micro_batches(self, batch: TrainBatch, subset: Sequence[int] | None = None) -> Iterator[PackedMicroBatch]:
        """``batch``'s sequences (or those of ``subset``) packed into micro-batches of the token budget; every
        rank yields the same number (empty ones where it has fewer)."""
        from miles.training.packing import agree_max, balanced_bins, first_fit_decreasing
        from miles_fsdp.microbatch import pack

        budget = self.train_settings.max_tokens_per_micro_batch
        every = batch.lengths
        chosen = list(range(len(batch))) if subset is None else list(subset)
        lengths = [every[i] for i in chosen]
        count = agree_max(len(first_fit_decreasing(lengths, budget)), self.device)
        for bin_ in balanced_bins(lengths, budget, count):
            indices = [chosen[i] for i in bin_]
            mb = pack(batch, indices, self.device, self._pad_token_id, share_prefixes=self._share_prefixes)
            if self._vision is not None:
                self._vision.annotate(mb, batch, self.device)
            yield mb

    def _inputs(self, mb: PackedMicroBatch) -> dict[str, Any]:
        """The forward's inputs: token ids, positions and, with ``packed_sdpa``, the row's layout."""
        inputs: dict[str, Any] = {"input_ids": mb.input_ids, "position_ids": mb.position_ids, **mb.model_inputs}
        if self._packed_attention:
            inputs["packed_segments"] = mb.segments
            if mb.varlen is not None:
                inputs["packed_varlen"] = mb.varlen
        if self._vision is not None:
            self._vision.allowed = mb.image_mask
        return inputs

    def _logits(self, module: nn.Module, mb: PackedMicroBatch) -> torch.Tensor:
        if module is self.actor and self._routing is not None:
            # the micro-batch's rollout experts, kept for an activation-checkpointing recompute in backward
            self._routing.set_rows(mb.routed_experts)
        with self._precision_context():
            out = module(**self._inputs(mb), logits_to_keep=mb.keep_index, use_cache=False)
        # squeeze, not [0]: a select's backward zero-fills a tensor of the whole logits' size (K x vocabulary)
        return out.logits.squeeze(0)

    def _install_fused_heads(self) -> None:
        from miles_fsdp.fused_head import FusedHead, unsupported_reason

        reason = unsupported_reason(self.actor)
        if reason is not None:
            log.warning("[train.backend] fused_logprobs: %s; scoring from the full logits", reason)
            return
        for module in (self.actor, self.ref):
            if module is not None:
                self._heads[id(module)] = FusedHead(module, chunk_tokens=self.options.fused_logprobs_chunk_tokens)

    def _fused_logprobs(
        self, module: nn.Module, mb: PackedMicroBatch, temperature: float, with_entropy: bool, entropy_grad: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Logprobs (and entropy) of ``mb``'s targets through ``module``'s fused head; ``None`` without one.
        An empty micro-batch scores its one dummy position against token 0 (its loss is multiplied by 0)."""
        import torch

        head = self._heads.get(id(module))
        if head is None:
            return None
        if module is self.actor and self._routing is not None:
            self._routing.set_rows(mb.routed_experts)
        targets = mb.targets if not mb.is_empty else torch.zeros_like(mb.keep_index)
        with head.scoring(targets, temperature, mb.mask_ids, entropy_grad=entropy_grad), self._precision_context():
            out = module(**self._inputs(mb), logits_to_keep=mb.keep_index, use_cache=False).logits.squeeze(0)
        return out[:, 0], (out[:, 1] if with_entropy else None)

    def _values(self, mb: PackedMicroBatch) -> torch.Tensor:
        if self.critic is None:
            raise RuntimeError("values need setup(need_values=True)")
        with self._precision_context():
            values = self.critic(**self._inputs(mb))
        return values.squeeze(0).index_select(0, mb.keep_index)

    # -- trainer interface -------------------------------------------------------------------------
    def compute_logprobs(
        self,
        batch: TrainBatch,
        *,
        model: Literal["actor", "ref"] = "actor",
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> LogprobOutput:
        """Per-response-token logprobs (and entropy) of this rank's sequences (micro-batches packed by the
        token budget), packed as the batch's per-token fields."""
        import torch

        from miles.training.logprobs import token_logprobs

        self._require_setup()
        if model == "ref" and self.adapter is not None:  # the reference: the base, adapters switched off
            with self.adapter.disabled(self.actor):
                return self.compute_logprobs(batch, temperature=temperature, with_entropy=with_entropy)
        module = self.actor if model == "actor" else self.ref
        if module is None:
            raise RuntimeError("compute_logprobs(model='ref') needs setup(need_ref=True)")
        offsets = batch.response_offsets
        logprobs = torch.zeros(batch.num_response_tokens, dtype=torch.float32)
        entropy = torch.zeros(batch.num_response_tokens, dtype=torch.float32)
        if model == "actor" and self._replica is not None:
            self._replica.sync(self.actor, self.step)
        if self._routing is not None:  # agreement is counted once per step, by the train step's forwards
            self._routing.measure = False
        was_training = module.training
        module.eval()
        with torch.no_grad():
            fused = model == "ref" or not self.train_settings.true_on_policy  # true on-policy: the full logits
            for mb in self._micro_batches(batch):
                scored = self._fused_logprobs(module, mb, temperature, with_entropy, False) if fused else None
                if scored is None:
                    logits = self._logits(module, mb)
                    if mb.is_empty:
                        continue
                    scored = token_logprobs(logits, mb.targets, temperature, with_entropy, mask_ids=mb.mask_ids)
                if mb.is_empty:
                    continue
                lp, ent = scored
                own = [part.float().cpu() for part in lp.split(mb.response_lengths)]
                if model == "actor" and self._replica is not None:  # the engine's values, bit for bit
                    from miles_fsdp.true_on_policy import exact_or_own

                    exact = self._replica.logprobs(batch, mb.indices, temperature)
                    own = [exact_or_own(o, values) for o, values in zip(own, exact, strict=True)]
                for i, part in zip(mb.indices, own, strict=True):
                    logprobs[offsets[i] : offsets[i + 1]] = part
                if ent is not None:
                    for i, part in zip(mb.indices, ent.split(mb.response_lengths), strict=True):
                        entropy[offsets[i] : offsets[i + 1]] = part.float().cpu()
        module.train(was_training)
        return LogprobOutput(logprobs=logprobs, entropy=entropy if with_entropy else None)

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """Critic values at the positions that predict each response token (needs ``need_values``), packed
        as the batch's per-token fields."""
        import torch

        if self.critic is None:
            raise RuntimeError("compute_values needs setup(need_values=True)")
        offsets = batch.response_offsets
        values = torch.zeros(batch.num_response_tokens, dtype=torch.float32)
        self.critic.eval()
        with torch.no_grad():
            for mb in self._micro_batches(batch):
                v = self._values(mb)
                for i, part in zip(mb.indices, v.split(mb.response_lengths), strict=True):
                    values[offsets[i] : offsets[i + 1]] = part.float().cpu()
        return values

    def train_step(self, batch: TrainBatch, algorithm: Algorithm, *, temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step over this rank's share of the step's sequences.

        The loss is aggregated with step-wide denominators (token / sequence counts all-reduced first)
        and gradients are summed over ranks, so the result equals one process training on the whole
        batch. ``temperature`` is the rollout's sampling temperature (logits are divided by it).
        """
        from miles_fsdp.step import StepContext, run_train_step

        self._require_setup()
        exact = None
        if self._replica is not None:  # train.true_on_policy: the loss sees the engine's logprobs exactly
            self._replica.sync(self.actor, self.step)
            exact = self._replica.logprobs(batch, range(len(batch)), temperature)
        ctx = StepContext(
            device=self.device,
            actor=self.actor,
            critic=self.critic,
            parts=self._parts,
            train=self.train_settings,
            empty_cache=self.options.empty_cache_between_steps,
            micro_batches=self._micro_batches,
            logits=self._logits,
            values=self._values,
            fused_logprobs=self._fused_logprobs if not self.train_settings.true_on_policy else None,
            step=self.step,
            exact_logprobs=exact,
            # not with a vision tower: it runs only in micro-batches with images, and a rank whose sequences are
            # all inert would run an empty micro-batch while another encodes images (the ranks' FSDP gathers
            # would differ)
            score_without_backward=self.options.skip_zero_advantage_backward and self._vision is None,
        )
        if self._routing is not None:
            self._routing.measure = True
            self._routing.stats.reset()
        metrics = run_train_step(ctx, batch, algorithm, temperature=temperature)
        if self._routing is not None:  # a collective: every rank's counts
            metrics.update(self._routing.stats.metrics(self._routing.num_layers))
            self._routing.measure = False
        self.step += 1
        return metrics

    def iter_weights(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """The actor's full weights in HF naming, gathered one parameter at a time into buckets on rank 0
        (with an adapter: only the adapter's tensors, in its naming)."""
        from miles_fsdp.weights import iter_full_weights

        self._require_setup()
        rename = self.adapter.adapter_name if self.adapter is not None else None
        yield from iter_full_weights(
            self.actor, bucket_bytes, rank=self.dist.rank, rename=rename, every_rank=self.weights_on_every_rank
        )

    def iter_weight_shards(self, bucket_bytes: int = 256 << 20) -> Iterator[WeightShard]:
        """The actor's DTensor shards on this rank, with their offsets (nothing is gathered)."""
        from miles_fsdp.weights import iter_weight_shards

        self._require_setup()
        if self.adapter is None:
            yield from iter_weight_shards(self.actor)
            return
        import dataclasses

        for shard in iter_weight_shards(self.actor):
            name = self.adapter.adapter_name(shard.name)
            if name is not None:
                yield dataclasses.replace(shard, name=name)

    def save_checkpoint(self, path: str) -> None:
        """Sharded DCP checkpoint of actor (+ critic) and optimizers, scheduler, RNG states and step."""
        from miles_fsdp.checkpoint import save_sharded

        self._require_setup()
        save_sharded(path, self._parts, step=self.step, rank=self.dist.rank)

    def load_checkpoint(self, path: str) -> None:
        """Resume from a :meth:`save_checkpoint` directory (exactly) or from a HF directory (weights only)."""
        from miles_fsdp.checkpoint import is_dcp_checkpoint, load_hf_weights, load_sharded

        self._require_setup()
        if is_dcp_checkpoint(path):
            self.step = load_sharded(path, self._parts, rank=self.dist.rank)
            if self._replica is not None:
                self._replica.synced_step = None
        else:
            log.info("%s is a Hugging Face directory: loading the actor's weights (optimizer state starts fresh)", path)
            load_hf_weights(self.actor, path)
            if self._replica is not None:
                self._replica.synced_step = None

    def export_hf(self, path: str, *, bucket_bytes: int = 1 << 30) -> None:
        """Write the actor as a HF safetensors directory (config, shards, tokenizer files of the source)."""
        from miles_fsdp.weights import export_hf_dir

        self._require_setup()
        if self.adapter is not None:
            from miles_fsdp.weights import export_adapted

            export_adapted(
                self.actor,
                self.adapter,
                self._config,
                path,
                rank=self.dist.rank,
                bucket_bytes=bucket_bytes,
                source_dir=self.train_settings.model_path,
            )
        else:
            export_hf_dir(
                self.actor,
                self._config,
                path,
                rank=self.dist.rank,
                bucket_bytes=bucket_bytes,
                source_dir=self.train_settings.model_path,
            )
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()

    def offloadable(self, part: Literal["state", "weights"]) -> list[torch.Tensor]:
        """``"state"``: the optimizers' state, the gradients, the reference and critic models;
        ``"weights"``: the actor's parameters (FSDP2's shards: the storages
        under them, views included)."""
        import torch

        if part == "weights":
            return [] if self.actor is None else list(self.actor.parameters())
        out: list[torch.Tensor] = []
        for model, optimizer, _ in self._parts.values():
            for state in optimizer.state.values():
                out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
            out.extend(p.grad for p in model.parameters() if p.grad is not None)
        for model in (self.ref, self.critic):
            if model is not None:
                out.extend(model.parameters())
        return out

    def close(self) -> None:
        """Drop the models and optimizers. No collective: ``close`` also runs after a failure on this rank,
        when the other ranks are not coming (the worker's teardown barriers after a completed run)."""
        self.actor = self.ref = self.critic = None
        self._replica = self._routing = None
        self._heads = {}
        self._parts = {}
