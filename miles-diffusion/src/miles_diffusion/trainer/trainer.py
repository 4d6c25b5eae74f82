"""The ``diffusion`` trainer: FSDP2 (``fully_shard``) over the policy's diffusers transformer.

The transformer is sharded per ``JointTransformerBlock`` and at the root with miles-fsdp's
:func:`~miles_fsdp.model.shard_model` (gradients summed over ranks, exact aggregation), so the same code
runs one CPU rank (gloo), several, or GPUs (NCCL). The text encoders are frozen and replicated; the VAE is
not loaded (training needs no pixels). Checkpoints are miles-fsdp's sharded DCP files with the optimizer,
scheduler and RNG states; weights leave in diffusers naming, bucket by bucket.

This module imports only core interfaces at module level; torch and diffusers are imported by its methods.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from miles.components import ComponentSettings
from miles.errors import SettingsError
from miles.training.trainer import DistContext, LogprobOutput, Trainer, WeightBucket

if TYPE_CHECKING:
    import torch

    from miles.algorithms.base import Algorithm
    from miles.precision.base import PrecisionRecipe
    from miles.settings.model import MilesSettings, TrainSettings
    from miles.training.batch import TrainBatch

__all__ = ["DiffusionTrainer", "DiffusionTrainerSettings"]

log = logging.getLogger(__name__)

_WEIGHTS = "diffusion_pytorch_model.safetensors"


class DiffusionTrainerSettings(ComponentSettings):
    """Options of the diffusion trainer (``[train.backend] name = "diffusion"``)."""

    max_pairs_per_micro_batch: int = Field(16, ge=1)
    """``(x_t -> x_t')`` pairs per transformer forward (whole trajectories; a longer one runs alone)."""
    reshard_after_forward: bool = True
    """Free each block's gathered parameters after its forward (ZeRO-3); ``False`` keeps them to the backward."""
    activation_checkpointing: bool = False
    """Recompute the transformer blocks' activations in the backward pass (diffusers' gradient checkpointing)."""


class DiffusionTrainer(Trainer[DiffusionTrainerSettings]):
    """FSDP2 over a diffusers flow-matching transformer, trained on recorded denoising steps."""

    name: ClassVar[str] = "diffusion"

    def __init__(
        self,
        train: TrainSettings,
        options: DiffusionTrainerSettings | None,
        precision: PrecisionRecipe,
        dist: DistContext,
    ) -> None:
        super().__init__(train, options if options is not None else DiffusionTrainerSettings(), precision, dist)
        self.step = 0
        self.actor: Any = None
        self.ref: Any = None
        self.pipe: Any = None
        self.optimizer: Any = None
        self.scheduler: Any = None
        self._mesh: Any = None

    @classmethod
    def check_settings(cls, options: DiffusionTrainerSettings, settings: MilesSettings) -> None:
        """Refuse runs whose samples are not image trajectories, or that sample with a temperature."""
        if settings.rollout.function_name != "diffusion":
            raise SettingsError(
                f'rollout.function: the diffusion trainer needs the "diffusion" rollout function (it keeps each '
                f"trajectory's latents), got {settings.rollout.function_name!r}"
            )
        if settings.rollout.temperature != 1.0:
            raise SettingsError("rollout.temperature: diffusion sampling has no temperature; leave it at 1.0")
        path = settings.train.model_path
        if path is not None and Path(path).exists() and not (Path(path) / "model_index.json").exists():
            raise SettingsError(f"train.model_path: {path} is not a diffusers pipeline directory (no model_index.json)")

    # -- setup -------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        import torch

        return torch.device("cuda", self.dist.local_rank) if self.dist.device == "cuda" else torch.device("cpu")

    def _sharded_transformer(self, *, trainable: bool) -> Any:
        from miles.precision.dtypes import torch_dtype
        from miles_diffusion.policy import load_transformer
        from miles_fsdp.model import shard_model

        assert self.train_settings.model_path is not None
        model = load_transformer(self.train_settings.model_path)
        if trainable and self.options.activation_checkpointing:
            model.enable_gradient_checkpointing()
        if not trainable:
            model.requires_grad_(False)
            model.eval()
        return shard_model(
            model,
            self._mesh,
            param_dtype=torch_dtype(self.precision.param_dtype),
            reduce_dtype=torch_dtype(self.precision.reduce_dtype),
            reshard_after_forward=self.options.reshard_after_forward,
            cpu_offload=False,
            activation_checkpointing=False,
        )

    def setup(self, *, need_ref: bool = False, need_values: bool = False) -> None:
        """Load the frozen text encoders and the sharded transformer (and the reference when asked); AdamW."""
        import torch
        from torch.distributed.device_mesh import init_device_mesh

        from miles_diffusion.policy import load_pipeline
        from miles_fsdp.optim import build_optimizer, build_scheduler

        train = self.train_settings
        if not train.model_path:
            raise SettingsError("train.model_path: the diffusion trainer needs a diffusers pipeline directory")
        if need_values:
            raise TypeError("trainer 'diffusion' has no value head; pick an algorithm that needs no critic")
        if self.dist.device == "cuda":
            torch.cuda.set_device(self.device)
        self._mesh = init_device_mesh(self.device.type, (self.dist.world_size,))
        self.pipe = load_pipeline(train.model_path, device=str(self.device), transformer=False, vae=False)
        for encoder in (self.pipe.text_encoder, self.pipe.text_encoder_2, self.pipe.text_encoder_3):
            if encoder is not None:
                encoder.requires_grad_(False)
        self.actor = self._sharded_transformer(trainable=True)
        self.pipe.transformer = self.actor  # encode_prompt reads its config (the T5 width without a T5)
        self.optimizer = build_optimizer(self.actor.parameters(), train)
        self.scheduler = build_scheduler(self.optimizer, train)
        if need_ref:
            self.ref = self._sharded_transformer(trainable=False)
        log.info(
            "diffusion trainer ready on %s x%d (params %s)",
            self.dist.device,
            self.dist.world_size,
            self.precision.param_dtype,
        )

    def _require_setup(self) -> None:
        if self.actor is None:
            raise RuntimeError("DiffusionTrainer.setup() must be called first")

    def _ensure_ref(self, algorithm: Algorithm[Any]) -> None:
        """Load the reference (the initial transformer) the first time an algorithm with a KL trains."""
        if self.ref is None and getattr(algorithm, "kl_coef", 0.0) > 0.0:
            log.info("loading the reference transformer from %s", self.train_settings.model_path)
            self.ref = self._sharded_transformer(trainable=False)

    # -- the trainer interface ---------------------------------------------------------------------
    def compute_logprobs(
        self,
        batch: TrainBatch,
        *,
        model: Literal["actor", "ref"] = "actor",
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> LogprobOutput:
        """Per SDE step: the log-probability of the recorded next latent under the actor (or reference)."""
        import torch

        from miles_diffusion.trainer.pairs import encode_batch_prompts, plan_micro_batches, step_distribution

        self._require_setup()
        module = self.actor if model == "actor" else self.ref
        if module is None:
            raise RuntimeError("compute_logprobs(model='ref') needs the reference (setup(need_ref=True))")
        offsets = batch.response_offsets
        out = torch.zeros(batch.num_response_tokens, dtype=torch.float32)
        with torch.no_grad():
            prompts = encode_batch_prompts(self.pipe, self.pipe.tokenizer, batch, self.device)
            for mb in plan_micro_batches(batch, self.options.max_pairs_per_micro_batch, self.device):
                logprobs = step_distribution(module, batch, mb, prompts, self.device).logprobs
                if mb.is_empty:
                    continue
                for i, part in zip(mb.indices, logprobs.split(mb.response_lengths), strict=True):
                    out[offsets[i] : offsets[i + 1]] = part.float().cpu()
        return LogprobOutput(logprobs=out, entropy=None)

    def train_step(self, batch: TrainBatch, algorithm: Algorithm[Any], *, temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step over this rank's trajectories with ``algorithm``'s per-step loss."""
        from miles_diffusion.trainer.step import StepContext, run_train_step

        self._require_setup()
        self._ensure_ref(algorithm)
        ctx = StepContext(
            device=self.device,
            actor=self.actor,
            ref=self.ref,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            pipe=self.pipe,
            train=self.train_settings,
            max_pairs=self.options.max_pairs_per_micro_batch,
        )
        metrics = run_train_step(ctx, batch, algorithm)
        self.step += 1
        return metrics

    def iter_weights(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """The transformer's full weights in diffusers naming, gathered into buckets on rank 0."""
        from miles_fsdp.weights import iter_full_weights

        self._require_setup()
        yield from iter_full_weights(self.actor, bucket_bytes, rank=self.dist.rank)

    def save_checkpoint(self, path: str) -> None:
        """Sharded DCP checkpoint of the transformer and AdamW, the scheduler, RNG states and step."""
        from miles_fsdp.checkpoint import save_sharded

        self._require_setup()
        save_sharded(path, {"actor": (self.actor, self.optimizer, self.scheduler)}, step=self.step, rank=self.dist.rank)

    def load_checkpoint(self, path: str) -> None:
        """Resume exactly from a :meth:`save_checkpoint` directory."""
        from miles_fsdp.checkpoint import is_dcp_checkpoint, load_sharded

        self._require_setup()
        if not is_dcp_checkpoint(path):
            raise FileNotFoundError(
                f"{path}: not a checkpoint of the diffusion trainer (no .metadata / trainer_state.json)"
            )
        self.step = load_sharded(path, {"actor": (self.actor, self.optimizer, self.scheduler)}, rank=self.dist.rank)

    def export_hf(self, path: str) -> None:
        """Write a complete diffusers pipeline directory: the policy's, with the trained transformer."""
        import torch.distributed as dist
        from safetensors.torch import save_file

        self._require_setup()
        assert self.train_settings.model_path is not None
        out = Path(path)
        weights: dict[str, Any] = {}
        for bucket in self.iter_weights(1 << 30):
            weights.update({name: t.detach().cpu().contiguous() for name, t in bucket})
        if self.dist.rank == 0:
            from safetensors.torch import load_file

            source = Path(self.train_settings.model_path)
            # persistent buffers (the positional embedding) are not trained: keep the policy's
            original = load_file(str(source / "transformer" / _WEIGHTS))
            weights.update({name: t for name, t in original.items() if name not in weights})
            if out.exists():
                shutil.rmtree(out)
            trained_dir = str(source / "transformer")

            def skip_trained(folder: str, names: list[str]) -> list[str]:
                return [_WEIGHTS] if Path(folder) == Path(trained_dir) and _WEIGHTS in names else []

            shutil.copytree(source, out, ignore=skip_trained)
            save_file(weights, str(out / "transformer" / _WEIGHTS), metadata={"format": "pt"})
            log.info("exported the trained pipeline to %s", out)
        if dist.is_initialized():
            dist.barrier()

    def close(self) -> None:
        """Drop the models and the optimizer (no collective: close also runs after a failure)."""
        self.actor = self.ref = self.pipe = self.optimizer = self.scheduler = None
