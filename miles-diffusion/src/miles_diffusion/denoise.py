"""The policy's forward: prompts to embeddings, and the velocity the transformer predicts (with CFG).

Engine and trainer both call these, so both see exactly the distribution the pipeline defines. Prompts
arrive as token ids of the pipeline's prompt tokenizer (the core tokenises data once); they are decoded
and handed to the pipeline's own ``encode_prompt``, which tokenises them for every text encoder (the two
CLIP encoders share one vocabulary in SD3; T5, when present, has its own).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["PromptEmbeddings", "encode_prompts", "prompt_texts", "velocity"]


@dataclass
class PromptEmbeddings:
    """Per prompt: the joint text embedding ``[B, L, D]`` and the pooled one ``[B, P]``; with
    classifier-free guidance also those of the negative (empty) prompt."""

    embeds: torch.Tensor
    pooled: torch.Tensor
    negative_embeds: torch.Tensor | None = None
    negative_pooled: torch.Tensor | None = None

    def select(self, index: torch.Tensor) -> PromptEmbeddings:
        """The rows at ``index`` (one per denoising pair)."""
        neg, neg_pooled = self.negative_embeds, self.negative_pooled
        return PromptEmbeddings(
            self.embeds[index],
            self.pooled[index],
            None if neg is None else neg[index],
            None if neg_pooled is None else neg_pooled[index],
        )


def prompt_texts(tokenizer: Any, ids: Sequence[Sequence[int]]) -> list[str]:
    """The prompts as text (the pipeline's ``encode_prompt`` tokenises them again, for each encoder)."""
    return [str(tokenizer.decode(list(row), skip_special_tokens=True)) for row in ids]


def encode_prompts(
    pipe: Any, texts: Sequence[str], *, guidance_scale: float, max_sequence_length: int, device: Any
) -> PromptEmbeddings:
    """The pipeline's ``encode_prompt`` for ``texts`` (no gradient); negatives (``""``) when ``guidance_scale > 1``."""
    import torch

    cfg = guidance_scale > 1.0
    with torch.no_grad():
        embeds, negative, pooled, negative_pooled = pipe.encode_prompt(
            prompt=list(texts),
            prompt_2=None,
            prompt_3=None,
            device=device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=cfg,
            negative_prompt=[""] * len(texts) if cfg else None,
            max_sequence_length=max_sequence_length,
        )
    return PromptEmbeddings(embeds, pooled, negative if cfg else None, negative_pooled if cfg else None)


def velocity(
    transformer: Any, latents: torch.Tensor, timesteps: torch.Tensor, prompts: PromptEmbeddings, guidance_scale: float
) -> torch.Tensor:
    """The transformer's velocity for ``latents`` (``[B, C, H, W]``) at ``timesteps`` (``[B]``), guided as
    the pipeline does (``uncond + g (cond - uncond)``, the unconditional half first) when ``guidance_scale > 1``."""
    import torch

    dtype = prompts.embeds.dtype
    x, t, embeds, pooled = latents.to(dtype), timesteps, prompts.embeds, prompts.pooled
    cfg = guidance_scale > 1.0
    if cfg:
        if prompts.negative_embeds is None or prompts.negative_pooled is None:
            raise ValueError(f"guidance_scale {guidance_scale} needs the negative prompt's embeddings")
        x, t = torch.cat([x, x]), torch.cat([t, t])
        embeds = torch.cat([prompts.negative_embeds, embeds])
        pooled = torch.cat([prompts.negative_pooled, pooled])
    out = transformer(
        hidden_states=x, timestep=t, encoder_hidden_states=embeds, pooled_projections=pooled, return_dict=False
    )[0]
    if cfg:
        uncond, cond = out.chunk(2)
        out = uncond + guidance_scale * (cond - uncond)
    return out
