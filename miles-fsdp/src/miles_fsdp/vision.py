"""Vision-language actors (transformers' Qwen2-VL family): the forward inputs of a micro-batch with images.

The model's own forward runs the vision tower (FSDP gathers its blocks as it gathers the decoder's) and puts
the image features at the placeholder tokens; this module gives it, per packed micro-batch, the sequences'
pixel values and grids, M-RoPE positions equal to the engine's (:func:`miles.training.vision.mrope_positions`),
and restricts the placeholders that take features to the prompts' and, in a multi-turn session's sample, to
the later user turns' (:func:`miles.training.vision.image_placeholders`: a placeholder token the policy
sampled into a response is an ordinary token, as it was in the engine).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from miles.training.request_spans import REQUEST_INDEX
from miles.training.vision import image_placeholders, image_rows, mrope_positions

if TYPE_CHECKING:
    from torch import nn

    from miles.training.batch import TrainBatch
    from miles_fsdp.microbatch import PackedMicroBatch

__all__ = ["VisionInputs", "is_vision_config"]


def is_vision_config(config: Any) -> bool:
    """Whether a Hugging Face config is a vision-language model's (it has a vision tower)."""
    return getattr(config, "vision_config", None) is not None


class VisionInputs:
    """Installed on a vision-language actor (before it is sharded): builds each micro-batch's image inputs
    and limits the model's image placeholders to the prompts'."""

    def __init__(self, model: nn.Module, *, train_vision_tower: bool) -> None:
        inner: Any = model.model
        self.rope_index = inner.get_rope_index
        self.image_token_id = int(model.config.image_token_id)
        self.allowed: torch.Tensor | None = None
        """``[1, L]`` placeholders of the next forward that take image features (``None``: all)."""
        self.attach(model)
        if not train_vision_tower:
            inner.visual.requires_grad_(False)

    def attach(self, model: nn.Module) -> None:
        """Limit ``model``'s image placeholders (the actor's, or its frozen reference's) to :attr:`allowed`."""
        inner: Any = model.model
        original = inner.get_placeholder_mask

        def placeholder_mask(
            input_ids: torch.Tensor, inputs_embeds: torch.Tensor, image_features: Any = None, video_features: Any = None
        ) -> tuple[torch.Tensor, torch.Tensor]:
            image, video = original(input_ids, inputs_embeds=inputs_embeds, video_features=video_features)
            if self.allowed is not None:
                image = image & self.allowed[..., None].to(image.device)
            if image_features is not None and int(image.sum()) != image_features.shape[0]:
                raise ValueError(
                    f"{int(image.sum())} image placeholders for {image_features.shape[0]} image feature rows"
                )
            return image, video

        inner.get_placeholder_mask = placeholder_mask

    def annotate(self, mb: PackedMicroBatch, batch: TrainBatch, device: torch.device) -> None:
        """Set ``mb``'s image inputs (the model's ``pixel_values``, ``image_grid_thw`` and M-RoPE
        ``position_ids``); a prompt with placeholders but no images in the batch is an error naming it."""
        if mb.is_empty:
            return
        sequences = [batch.sequence(i) for i in mb.indices]
        prompts = [int(batch.prompt_lengths[i]) for i in mb.indices]
        masks = [
            image_placeholders(tokens, prompt, batch.response_tensor_rows(REQUEST_INDEX, [i]), self.image_token_id)
            for i, tokens, prompt in zip(mb.indices, sequences, prompts, strict=True)
        ]
        grids = []
        for i, mask in zip(mb.indices, masks, strict=True):
            rows = image_rows(batch, [i])
            if rows is None and bool(mask.any()):
                raise ValueError(
                    f"TrainBatch sequence {i}: its prompt holds image placeholders but the batch carries no images "
                    "for it (a text-only batch for a vision-language policy: attach them with "
                    "miles.training.vision.attach_images)"
                )
            grids.append(None if rows is None else rows[1])
        # always the four rows: the first, each sequence's own positions, is what the attention mask of a
        # packed row is built from (with three, the model would let the sequences see each other)
        positions = mrope_positions(self.rope_index, sequences, prompts, grids, masks)
        mb.model_inputs = {"position_ids": positions.to(device)}
        images = image_rows(batch, mb.indices)
        if images is not None:
            mb.model_inputs.update(pixel_values=images[0].to(device), image_grid_thw=images[1].to(device))
            mb.image_mask = torch.cat(masks)[None].to(device)
