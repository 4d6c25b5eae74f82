"""The ``megatron`` trainer: Megatron-Core ``GPTModel`` with tensor, pipeline, data and expert parallelism.

One instance per rank; every rank calls the same methods in the same order with its share of the batch
(the driver splits each step's sequences over all ranks). The ranks of one model replica (its TP x PP
group) pool their shares first, so each data-parallel replica trains on the union and the results go
back to the rank that owns each sequence. The same code runs on CPU ranks (gloo, with the patches of
:mod:`miles_megatron.cpu_patches`) and GPU ranks (NCCL, TransformerEngine when installed).

With ``train.adapter`` (LoRA) the actor's projections get adapters (:mod:`miles_megatron.lora`): only they
train and hold optimizer state, the KL reference is the actor with its adapters off, and the weights out
are the adapter's tensors in HF/PEFT naming.

This module imports only the core interfaces and the settings at module level; torch, megatron and
mbridge are imported by the methods, so registering the plugin stays cheap.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from miles.errors import SettingsError
from miles.training.trainer import DistContext, LogprobOutput, Trainer, WeightBucket
from miles_megatron.settings import MegatronSettings, check_parallel_layout, read_hf_config

if TYPE_CHECKING:
    import torch

    from miles.algorithms.base import Algorithm
    from miles.precision.base import PrecisionRecipe
    from miles.settings.model import MilesSettings, TrainSettings
    from miles.training.adapter import LowRankSpec
    from miles.training.batch import TrainBatch
    from miles_megatron.microbatch import MicroBatch
    from miles_megatron.model import ModelParts

__all__ = ["MegatronTrainer"]

log = logging.getLogger(__name__)


class MegatronTrainer(Trainer[MegatronSettings]):
    """Megatron-Core (TP / PP / DP / EP) over HF checkpoints converted on the fly with mbridge."""

    name: ClassVar[str] = "megatron"
    supports_adapters: ClassVar[bool] = True

    def __init__(
        self, train: TrainSettings, options: MegatronSettings | None, precision: PrecisionRecipe, dist: DistContext
    ) -> None:
        super().__init__(train, options if options is not None else MegatronSettings(), precision, dist)
        self.step = 0
        """Optimizer steps taken (restored by :meth:`load_checkpoint`)."""
        self.critic_step = 0
        """Optimizer steps of the critic (steps whose algorithm needed values; its schedule's position)."""
        self.actor: ModelParts | None = None
        self.ref: ModelParts | None = None
        self.optimizer: Any = None
        self.critic: ModelParts | None = None
        """The PPO critic (the policy's ``GPTModel`` with a value head), after ``setup(need_values=True)``."""
        self.critic_optimizer: Any = None
        self._hf_config: Any = None
        self._pad_token_id = 0
        self._fuser: Any = None
        self._lora: LowRankSpec | None = None
        """The adapter the actor trains (``train.adapter``), after :meth:`setup`."""

    # -- settings ----------------------------------------------------------------------------------
    @classmethod
    def check_settings(cls, options: MegatronSettings, settings: MilesSettings) -> None:
        """Check the parallel layout against ``cluster.trainer_ranks`` and the model's config, before any
        process starts (``build_run`` calls it). Raises :class:`~miles.errors.SettingsError` naming the field."""
        if settings.train.true_on_policy:
            raise SettingsError(
                'train.true_on_policy: the megatron trainer does not implement it yet; use train.backend = "fsdp" '
                "or set train.true_on_policy = false"
            )
        if settings.train.routing_replay and options.recompute != "none" and options.pipeline_parallel > 1:
            raise SettingsError(
                f"train.routing_replay with train.backend.recompute = {options.recompute!r} and pipeline_parallel = "
                f"{options.pipeline_parallel}: a recomputed forward in the 1F1B schedule runs after later "
                'micro-batches\' forwards and would replay their routing; set recompute = "none" or '
                "pipeline_parallel = 1"
            )
        config = read_hf_config(settings.train.model_path) if settings.train.model_path else None
        check_parallel_layout(options, settings.cluster.trainer_ranks, config)
        saves = settings.checkpoint.save_interval is not None or settings.checkpoint.save_final
        if settings.precision.name not in ("fp32", "auto") and saves and settings.train.adapter is None:
            raise SettingsError(
                f'precision: {settings.precision.name!r} (bfloat16 parameters) with train.backend = "megatron" '
                "cannot save checkpoints yet: Megatron-Core's distributed optimizer finds their optimizer state of "
                "another size than their gradient-buffer range and the run fails at its first save; set precision = "
                '"fp32", or checkpoint.save_interval unset and checkpoint.save_final = false'
            )

    # -- setup -------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        import torch

        return torch.device("cuda", self.dist.local_rank) if self.dist.device == "cuda" else torch.device("cpu")

    def setup(self, *, need_ref: bool = False, need_values: bool = False) -> None:
        """Initialise Megatron's parallel state, build the actor (and a frozen reference), load the HF
        weights through mbridge, wrap the actor in Megatron DDP and build the optimizer.

        With an adapter the actor's base is frozen and gets the adapter's layers before the DDP wrap (the
        optimizer holds the adapter alone), and no reference model is built (the actor with its adapters
        off is the reference)."""
        from miles.precision.dtypes import torch_dtype
        from miles_megatron.model import build_model, build_optimizer, init_parallel, load_hf_config

        train, opts = self.train_settings, self.options
        if not train.model_path:
            raise SettingsError("train.model_path: the megatron trainer needs a Hugging Face model directory")
        config = read_hf_config(train.model_path)
        check_parallel_layout(opts, self.dist.world_size, config)
        init_parallel(opts, device=self.dist.device, seed=train.seed)
        self._hf_config = load_hf_config(train.model_path)
        dtype = torch_dtype(self.precision.param_dtype)
        prepare = self._adapter_preparation()
        self.actor = build_model(
            self._hf_config,
            opts,
            device=self.dist.device,
            dtype=dtype,
            weights=train.model_path,
            trainable=True,
            prepare=prepare,
            local_spec=prepare is not None,
        )
        from miles_megatron.routing import install

        self.actor.routing = install(self.actor.module, replay=train.routing_replay)
        if self.actor.routing is not None:
            self.actor.routing.measure = False  # counted in train steps only
        self.optimizer = build_optimizer(self.actor.module, train, opts, dtype=dtype)
        if need_ref and self._lora is None:
            self.ref = build_model(
                self._hf_config, opts, device=self.dist.device, dtype=dtype, weights=train.model_path, trainable=False
            )
        if need_values:
            self._setup_critic(dtype)
        pad = self._hf_config.pad_token_id if self._hf_config.pad_token_id is not None else self._hf_config.eos_token_id
        self._pad_token_id = int(pad if isinstance(pad, int) else 0)
        log.info(
            "megatron trainer ready on %s x%d (tp=%d pp=%d ep=%d sp=%s recompute=%s, params %s, ref=%s, critic=%s)",
            self.dist.device,
            self.dist.world_size,
            opts.tensor_parallel,
            opts.pipeline_parallel,
            opts.expert_parallel,
            opts.sequence_parallel,
            opts.recompute,
            self.precision.param_dtype,
            need_ref,
            need_values,
        )

    def _adapter_preparation(self) -> Any:
        """``build_model``'s ``prepare`` that adds :attr:`adapter` to the actor (``None`` without one)."""
        if self.adapter is None:
            return None
        spec = self.adapter.low_rank()
        if spec is None:
            raise SettingsError(
                f"train.adapter: adapter {self.adapter.name!r} gives no low-rank spec; the megatron trainer builds "
                "LoRA adapters only"
            )
        if self.train_settings.true_on_policy:
            raise SettingsError("train.true_on_policy: not supported with train.adapter")
        from miles_megatron.lora import apply_lora, megatron_targets

        targets = megatron_targets(spec, self._hf_config)
        seed = self.train_settings.seed
        self._lora = spec

        def add_adapters(model: Any, bridge: Any) -> None:
            count = apply_lora(model, spec, targets, bridge=bridge, seed=seed)
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            log.info(
                "LoRA r=%d on %d projections (%s): %d parameters trainable on this rank",
                spec.r,
                count,
                ", ".join(targets),
                trainable,
            )

        return add_adapters

    def _setup_critic(self, dtype: torch.dtype) -> None:
        """The critic: the policy's ``GPTModel`` loaded from the same weights, a value head on its last
        stage (:mod:`miles_megatron.critic`), its own AdamW at ``critic_lr``."""
        from miles_megatron.critic import attach_value_head
        from miles_megatron.model import build_model, build_optimizer

        train, opts = self.train_settings, self.options

        def to_critic(model: Any, bridge: Any) -> None:
            attach_value_head(model, self._hf_config, init_std=opts.value_head_init_std, seed=train.seed)

        self.critic = build_model(
            self._hf_config,
            opts,
            device=self.dist.device,
            dtype=dtype,
            weights=train.model_path,
            trainable=True,
            prepare=to_critic,
        )
        critic_train = train.model_copy(update={"lr": self.critic_peak_lr})
        self.critic_optimizer = build_optimizer(self.critic.module, critic_train, opts, dtype=dtype)

    @property
    def critic_peak_lr(self) -> float:
        """The critic's peak learning rate (``critic_lr``, else ``train.lr``)."""
        return self.options.critic_lr or self.train_settings.lr

    def model_parts(self) -> ModelParts:
        """The actor's parts (after :meth:`setup`)."""
        return self._require_setup()

    def critic_parts(self) -> ModelParts | None:
        """The critic's parts (``None`` unless ``setup(need_values=True)``)."""
        return self.critic

    def _require_setup(self) -> ModelParts:
        """The actor, on a thread ready for Megatron (the async modes call from a dedicated thread)."""
        if self.actor is None:
            raise RuntimeError("MegatronTrainer.setup() must be called first")
        from miles_megatron.cpu_patches import enter_device_mode

        enter_device_mode()
        return self.actor

    # -- data layout -------------------------------------------------------------------------------
    @property
    def reports_metrics(self) -> bool:
        """Whether this rank adds to the reduced metrics (one rank per data-parallel replica)."""
        from megatron.core import parallel_state as mpu

        return bool(mpu.is_pipeline_last_stage() and mpu.get_tensor_model_parallel_rank() == 0)

    def _pool(self, own: TrainBatch) -> tuple[TrainBatch, int]:
        """The shares of this replica's TP x PP ranks, concatenated; and where ``own`` starts in it."""
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        from miles.training.batch import TrainBatch
        from miles.training.comm import all_gather_tensors

        group = mpu.get_model_parallel_group()
        size = dist.get_world_size(group)
        if size == 1:
            return own, 0
        parts = [TrainBatch.from_tensors(t) for t in all_gather_tensors(own.to_tensors(), group=group)]
        me = dist.get_rank(group)
        return TrainBatch.concat(parts), sum(len(p) for p in parts[:me])

    def data_parallel_batch(self, own: TrainBatch) -> TrainBatch:
        """The sequences this data-parallel replica trains on (the pooled shares of its TP x PP ranks)."""
        return self._pool(own)[0]

    def micro_batches(self, batch: TrainBatch) -> list[MicroBatch]:
        """``batch`` in micro-batches of at most ``train.max_tokens_per_micro_batch`` real tokens, as many
        on every rank."""
        from miles.training.packing import agree_max, first_fit_decreasing
        from miles_megatron.microbatch import make_micro_batch

        bins = first_fit_decreasing(batch.lengths, self.train_settings.max_tokens_per_micro_batch)
        count = agree_max(len(bins), self.device)
        bins += [[] for _ in range(count - len(bins))]
        multiple = self.options.tensor_parallel if self.options.sequence_parallel else 1
        return [
            make_micro_batch(batch, b, self.device, pad_token_id=self._pad_token_id, multiple=multiple) for b in bins
        ]

    def lr_at(self, step: int, *, critic: bool = False) -> float:
        """The learning rate of optimizer step ``step`` (warm-up, then the schedule), of the actor or of
        the critic (the same schedule from its own peak, down to ``train.min_lr``, as miles-fsdp's)."""
        from miles.training.lr_schedule import lr_factor

        train = self.train_settings
        peak = self.critic_peak_lr if critic else train.lr
        total = train.num_rollouts * train.steps_per_rollout
        factor = lr_factor(
            step,
            warmup_steps=train.warmup_steps,
            total_steps=total,
            schedule=train.lr_schedule,
            lr=peak,
            min_lr=train.min_lr,
        )
        return peak * factor

    # -- trainer interface -------------------------------------------------------------------------
    def _per_token(
        self, parts: ModelParts, batch: TrainBatch, compute: Any, names: list[str], *, values: bool = False
    ) -> dict[str, torch.Tensor]:
        """A forward-only pass over the replica's pooled batch; each result of this rank's sequences, packed
        as ``batch``'s per-token fields (``[R]`` float32)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        from miles_megatron.step import forward_per_token

        pooled, start = self._pool(batch)
        filled = forward_per_token(parts, pooled, self.micro_batches(pooled), compute, names, values=values)
        if mpu.get_pipeline_model_parallel_world_size() > 1:  # filled on the last stage
            src, group = mpu.get_pipeline_model_parallel_last_rank(), mpu.get_pipeline_model_parallel_group()
            for tensor in filled.values():
                on_device = tensor.to(self.device)
                dist.broadcast(on_device, src=src, group=group)
                tensor.copy_(on_device.cpu())
        offsets = pooled.response_offsets
        first, end = offsets[start], offsets[start + len(batch)]  # this rank's sequences: a contiguous range
        return {name: tensor[first:end].clone() for name, tensor in filled.items()}

    def compute_logprobs(
        self,
        batch: TrainBatch,
        *,
        model: Literal["actor", "ref"] = "actor",
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> LogprobOutput:
        """Per-response-token logprobs (and entropy) of this rank's sequences, packed as the batch's per-token
        fields."""
        from miles.training.logprobs import token_logprobs

        self._require_setup()
        if model == "ref" and self._lora is not None and self.actor is not None:  # the base: adapters off
            from miles_megatron.lora import adapters_off

            with adapters_off(self.actor.module):
                return self.compute_logprobs(batch, temperature=temperature, with_entropy=with_entropy)
        parts = self.actor if model == "actor" else self.ref
        if parts is None:
            raise RuntimeError("compute_logprobs(model='ref') needs setup(need_ref=True)")

        def compute(mb: MicroBatch, logits: torch.Tensor) -> dict[str, torch.Tensor]:
            lp, ent = token_logprobs(logits, mb.targets, temperature, with_entropy, mask_ids=mb.mask_ids)
            return {"logprobs": lp} if ent is None else {"logprobs": lp, "entropy": ent}

        names = ["logprobs", "entropy"] if with_entropy else ["logprobs"]
        out = self._per_token(parts, batch, compute, names)
        return LogprobOutput(logprobs=out["logprobs"], entropy=out.get("entropy"))

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """Critic values at the positions that predict each response token (needs ``need_values``), packed as
        the batch's per-token fields."""
        self._require_setup()
        if self.critic is None:
            raise RuntimeError("compute_values needs setup(need_values=True)")
        out = self._per_token(self.critic, batch, lambda mb, values: {"values": values}, ["values"], values=True)
        return out["values"]

    def train_step(self, batch: TrainBatch, algorithm: Algorithm, *, temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step over the step's sequences (this rank's share); see :mod:`miles_megatron.step`."""
        from miles_megatron.step import run_train_step

        actor = self._require_setup()
        routing = actor.routing
        if routing is not None:  # agreement is counted by the train step's forwards (once per step)
            routing.stats.reset()
            routing.measure = True
        try:
            metrics = run_train_step(self, batch, algorithm, temperature=temperature)
        finally:
            if routing is not None:
                routing.measure = False
        if routing is not None:  # a collective: every rank's counts (its stage's layers, its tokens)
            metrics.update(routing.stats.metrics(routing.num_layers))
        self.step += 1
        self.critic_step += int(algorithm.needs.values)
        return metrics

    def iter_weights(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """The actor's full weights in the in-memory HF naming (TP gathered, PP stages broadcast, EP experts
        gathered), in buckets on rank 0; a collective. With an adapter: the adapter's tensors alone, in
        HF/PEFT naming (each HF projection of a fused one with the shared ``A`` and its rows of ``B``)."""
        from miles_megatron.weights import iter_buckets, iter_hf_weights, runtime_fuser

        actor = self._require_setup()
        if self._lora is not None:
            from miles_megatron.lora import gather_adapter

            adapter = gather_adapter(actor.module, self._lora)
            yield from iter_buckets(iter(adapter.items()), bucket_bytes, keep=self.dist.rank == 0)
            return
        if self._fuser is None:
            self._fuser = runtime_fuser(self._hf_config) or False
        fuser = self._fuser

        def pairs() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in iter_hf_weights(actor.bridge, actor.module):
                yield from (fuser(name, tensor) if fuser else [(name, tensor)])

        yield from iter_buckets(pairs(), bucket_bytes, keep=self.dist.rank == 0)

    def save_checkpoint(self, path: str) -> None:
        """``megatron.core.dist_checkpointing`` of the model and optimizer (and the critic's, in
        ``critic/``), plus step and RNG states."""
        from miles_megatron.checkpoint import save_checkpoint

        actor = self._require_setup()
        critic = None if self.critic is None else (self.critic.module, self.critic_optimizer)
        save_checkpoint(
            path,
            actor.module,
            self.optimizer,
            step=self.step,
            rank=self.dist.rank,
            critic=critic,
            critic_step=self.critic_step,
        )

    def load_checkpoint(self, path: str) -> None:
        """Resume from a :meth:`save_checkpoint` directory (exactly) or load a HF directory's weights."""
        from miles_megatron.checkpoint import is_megatron_checkpoint, load_checkpoint
        from miles_megatron.weights import check_hf_keys

        actor = self._require_setup()
        if is_megatron_checkpoint(path):
            critic = None if self.critic is None else (self.critic.module, self.critic_optimizer)
            self.step, self.critic_step = load_checkpoint(
                path, actor.module, self.optimizer, rank=self.dist.rank, critic=critic
            )
            return
        import torch

        from miles_megatron.lora import without_adapters
        from miles_megatron.modules import unwrap

        log.info("%s is a Hugging Face directory: loading the actor's weights (optimizer state starts fresh)", path)
        with without_adapters(actor.module):  # with an adapter: the base's weights (the adapter is kept)
            check_hf_keys(actor.bridge, actor.module, path)
            with torch.no_grad():
                actor.bridge.load_weights([unwrap(actor.module)], path)

    def export_hf(self, path: str, *, bucket_bytes: int = 1 << 30) -> None:
        """Write the actor as a HF safetensors directory that ``transformers`` loads with strict keys.

        With an adapter: the merged model (``W + alpha / r * B A``) there, and the adapter alone in
        ``path/adapter`` (``adapter_model.safetensors`` + ``adapter_config.json``, PEFT's format)."""
        import torch.distributed as dist

        from miles_megatron.weights import export_adapted_dir, export_hf_dir

        actor = self._require_setup()
        if self._lora is not None and self.adapter is not None:
            export_adapted_dir(
                actor.bridge,
                actor.module,
                self._hf_config,
                path,
                spec=self._lora,
                adapter_config=self.adapter.adapter_config(),
                rank=self.dist.rank,
                bucket_bytes=bucket_bytes,
                source_dir=self.train_settings.model_path,
            )
        else:
            export_hf_dir(
                actor.bridge,
                actor.module,
                self._hf_config,
                path,
                rank=self.dist.rank,
                bucket_bytes=bucket_bytes,
                source_dir=self.train_settings.model_path,
            )
        if dist.is_initialized():
            dist.barrier()

    def close(self) -> None:
        """Drop the models and the optimizer (no collective: ``close`` also runs after a failure)."""
        self.actor = self.ref = self.critic = None
        self.optimizer = self.critic_optimizer = None
