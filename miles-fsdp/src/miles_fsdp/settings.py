"""Settings of the ``fsdp`` trainer backend: the keys of ``[train.backend]`` besides ``name``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from miles.components import ComponentSettings

__all__ = ["FSDPSettings"]


class FSDPSettings(ComponentSettings):
    """Options of the FSDP2 trainer (``[train.backend] name = "fsdp"``)."""

    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass (less memory, ~30% more compute)."""
    cpu_offload_optimizer: bool = False
    """GPU only: keep sharded parameters, gradients and AdamW state on the CPU (FSDP2 ``CPUOffloadPolicy``);
    the optimizer step runs on the CPU. Ignored (with a warning) when the trainer runs on the CPU."""
    reshard_after_forward: bool = True
    """Free the gathered parameters of each layer after its forward (ZeRO-3); ``False`` keeps them until the
    backward (ZeRO-2 like: more memory, fewer all-gathers)."""
    attn_implementation: Literal["auto", "packed_sdpa", "sdpa", "eager", "flash_attention_2"] = "auto"
    """Attention kernel of the Hugging Face model. Packed micro-batches rely on ``position_ids`` restarting
    at 0 for each sequence. ``packed_sdpa`` (:mod:`miles_fsdp.packed_attention`) runs SDPA on each
    sequence of the packed row alone, where ``sdpa`` computes the whole row against a block-diagonal mask (the
    same values to float32 rounding; on 8 sequences of 64 tokens, an eighth of the attention arithmetic), and
    lets sequences share their prompt (``share_prefixes``); on CUDA it is one variable-length flash-attention
    call per layer (PyTorch's ``varlen_attn``); ``auto``: ``packed_sdpa`` unless the model uses
    sliding windows or soft-capped attention logits, then ``sdpa``; ``flash_attention_2`` needs the
    ``flash-attn`` package and a GPU."""
    value_head_init_std: float = Field(0.0, ge=0.0)
    """PPO critic: standard deviation of the value head's initial weights (0: start from zero values)."""
    ref_reshard_after_forward: bool = True
    """Free the frozen reference model's gathered parameters after each layer's forward."""
    empty_cache_between_steps: bool = False
    """Release cached GPU memory after each optimizer step (helps colocated engines; no effect on CPU)."""
    critic_lr: float | None = Field(None, gt=0.0)
    """PPO critic: peak learning rate of the value model's own AdamW (``None``: ``train.lr``)."""
    fused_logprobs: bool = False
    """Compute token logprobs and entropy from the last hidden states chunk by chunk (fused LM head + log-softmax
    + gather, forward and backward), never holding the ``[T, vocab]`` logits at once (2.9x less memory at 2,048
    tokens on SmolLM2's head). Off (and always for models whose logits are transformed after the head,
    ``train.true_on_policy`` and top-k distillation): the full logits. Off by default until its step time is
    measured on an idle machine."""
    fused_logprobs_chunk_tokens: int = Field(1024, ge=1)
    """Tokens per chunk of the fused logprobs (one chunk's float32 logits are ``chunk x vocab x 4`` bytes)."""
    wrap_single_rank: bool = False
    """Shard with FSDP2 even at world size 1. Off (the default): one rank trains the plain module (no DTensors,
    all-gather copies or per-layer reductions, fused AdamW; the same weights, checkpoints and HF exports; bf16
    by autocast with float32 master weights)."""
    onednn_linear: bool = True
    """CPU ranks: every ``nn.Linear``'s forward and backward GEMMs run on oneDNN
    (:mod:`miles_fsdp.onednn_linear`): float32 at oneDNN's speed instead of MKL's sgemm (2-2.5x on this
    project's AMD hosts), and under bf16 autocast the weights cast once per optimizer step instead of once per
    forward. Equal to ``F.linear`` to float32 rounding. Ignored on CUDA."""
    share_prefixes: bool = True
    """With ``attn_implementation = "packed_sdpa"``: sequences of a micro-batch with the same prompt (a GRPO
    group's samples) hold it once in the packed row, each response attending to it as its own copy would
    (:mod:`miles_fsdp.packed_attention`): the same logprobs and gradients to float32 rounding, the prompt's
    forward and backward computed once per group instead of once per sample. Off: every sequence whole."""
    skip_zero_advantage_backward: bool = True
    """Sequences whose trained tokens all have advantage 0 (a GRPO group whose samples all scored alike), under
    an algorithm whose loss is then 0 (``Algorithm.zero_advantage_trains_nothing``: the surrogate alone, no KL
    in the loss, entropy, SFT, distillation or critic term), are scored in micro-batches of their own without
    a backward pass: their gradient is exactly 0, and their loss, entropy and mismatch metrics still count. The
    same update to float32 rounding (the other sequences' micro-batches are packed without them). Not with a
    vision-language actor (its vision tower runs only where a micro-batch has images, so ranks would gather
    different parameters). ``false``: every sequence takes the backward pass."""
    train_vision_tower: bool = True
    """A vision-language actor (Qwen2-VL family): train its vision tower with the rest; ``False`` freezes it
    (its weights are still pushed to the engines and verified with the others)."""
