"""Build the data source a run's ``data`` section selects, with its tokenising pipeline."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from miles.data.base import DataSource
from miles.data.pipeline import PromptPipeline
from miles.data.vision import VisionPromptPipeline, image_token_id, is_vision_model, load_image_processor
from miles.errors import SettingsError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from miles.settings.model import DataSettings

__all__ = ["create_data_source"]


def create_data_source(
    make: Callable[..., DataSource],
    settings: DataSettings,
    *,
    tokenizer: PreTrainedTokenizerBase | None,
    model_path: str | None = None,
) -> DataSource:
    """The ``data.source`` component over ``data.path``; with a tokenizer, every prompt gets ``prompt_ids``.

    :param make: the resolved ``data.source`` component (called with the source's arguments).
    :param model_path: the policy's checkpoint: a vision-language one renders each row's images
        (:class:`~miles.data.vision.VisionPromptPipeline`).

    Without a tokenizer prompts stay text (``max_prompt_tokens`` and ``system_prompt`` then are errors,
    since neither can be honoured).
    """
    if settings.path is None:
        raise SettingsError("data.path: not set (the prompt file or data set directory)")
    pipeline: PromptPipeline | None = None
    if tokenizer is not None and model_path is not None and is_vision_model(model_path):
        pipeline = VisionPromptPipeline(
            tokenizer,
            image_processor=load_image_processor(model_path),
            image_token_id=image_token_id(model_path),
            image_key=settings.image_key,
            base_dir=os.path.dirname(os.path.abspath(settings.path))
            if os.path.isfile(settings.path)
            else settings.path,
            max_image_pixels=settings.max_image_pixels,
            apply_chat_template=settings.apply_chat_template,
            system_prompt=settings.system_prompt,
            max_prompt_tokens=settings.max_prompt_tokens,
        )
    elif tokenizer is not None:
        pipeline = PromptPipeline.from_settings(settings, tokenizer)
    elif settings.max_prompt_tokens is not None or settings.system_prompt is not None:
        field = "data.max_prompt_tokens" if settings.max_prompt_tokens is not None else "data.system_prompt"
        raise SettingsError(f"{field}: needs a tokenizer (the policy's), none was given")
    source: DataSource = make(
        path=settings.path,
        seed=settings.seed,
        shuffle=settings.shuffle,
        prompt_key=settings.prompt_key,
        label_key=settings.label_key,
        pipeline=pipeline,
    )
    return source
