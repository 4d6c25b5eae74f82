"""The tokenising pipeline: the chat template applied once, when the data is loaded.

Every prompt leaves here with :attr:`Prompt.prompt_ids` set; nothing downstream tokenises the prompt
again (the engines receive ``input_ids``). Prompts longer than ``max_prompt_tokens`` are dropped and
counted.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from miles.data.base import Prompt
from miles.errors import DataError, SettingsError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from miles.settings.model import DataSettings

__all__ = ["PromptPipeline"]

log = logging.getLogger(__name__)

Messages = list[dict[str, Any]]


class PromptPipeline:
    """Turns validated prompts into token ids.

    :param tokenizer: a Hugging Face tokenizer (the policy's).
    :param apply_chat_template: chat messages (and plain-text prompts, as one user message) go through
        ``tokenizer.apply_chat_template(..., add_generation_prompt=True)``; when false, plain text is
        tokenised as is (with the tokenizer's special tokens, e.g. a BOS) and chat messages are an error.
    :param system_prompt: a system message put first, unless the prompt already starts with one.
    :param max_prompt_tokens: drop longer prompts (``None``: keep all).
    :param batch_size: prompts tokenised per tokenizer call.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        apply_chat_template: bool = True,
        system_prompt: str | None = None,
        max_prompt_tokens: int | None = None,
        batch_size: int = 256,
    ) -> None:
        if apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise SettingsError(
                "data.apply_chat_template: the tokenizer has no chat template; "
                "set data.apply_chat_template = false for plain-text prompts"
            )
        if system_prompt is not None and not apply_chat_template:
            raise SettingsError("data.system_prompt: needs data.apply_chat_template = true")
        self.tokenizer = tokenizer
        self.apply_chat_template = apply_chat_template
        self.system_prompt = system_prompt
        self.max_prompt_tokens = max_prompt_tokens
        self.batch_size = batch_size
        self.dropped = 0
        """Prompts dropped for length by the last call."""

    @classmethod
    def from_settings(cls, settings: DataSettings, tokenizer: PreTrainedTokenizerBase) -> PromptPipeline:
        """The pipeline the ``data`` section describes."""
        return cls(
            tokenizer,
            apply_chat_template=settings.apply_chat_template,
            system_prompt=settings.system_prompt,
            max_prompt_tokens=settings.max_prompt_tokens,
        )

    def messages(self, prompt: Prompt) -> Messages:
        """The conversation the template receives: the prompt's messages, after the system prompt."""
        messages: Messages = (
            [{"role": "user", "content": prompt.prompt}] if isinstance(prompt.prompt, str) else list(prompt.prompt)
        )
        if self.system_prompt is not None and (not messages or messages[0].get("role") != "system"):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def _encode(self, chunk: Sequence[Prompt]) -> list[list[int]]:
        if self.apply_chat_template:
            conversations = [self.messages(p) for p in chunk]
            try:
                out = self.tokenizer.apply_chat_template(
                    conversations, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            except Exception as exc:  # a template error on one row: find and name it
                for prompt, conversation in zip(chunk, conversations, strict=False):
                    try:
                        self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
                    except Exception as row_exc:
                        raise DataError(f"{prompt.source}: chat template failed: {row_exc}") from row_exc
                raise DataError(f"{chunk[0].source}..{chunk[-1].source}: chat template failed: {exc}") from exc
            if isinstance(out, Mapping):
                out = out["input_ids"]
            return [list(map(int, ids)) for ids in out]
        texts: list[str] = []
        for prompt in chunk:
            if not isinstance(prompt.prompt, str):
                raise DataError(
                    f"{prompt.source}: chat messages need data.apply_chat_template = true (or a plain-text prompt)"
                )
            texts.append(prompt.prompt)
        return [list(map(int, ids)) for ids in self.tokenizer(texts)["input_ids"]]

    def __call__(self, prompts: list[Prompt]) -> list[Prompt]:
        """Tokenise ``prompts``; return those within ``max_prompt_tokens``, in order, ``prompt_ids`` set."""
        kept: list[Prompt] = []
        self.dropped = 0
        for start in range(0, len(prompts), self.batch_size):
            chunk = prompts[start : start + self.batch_size]
            for prompt, ids in zip(chunk, self._encode(chunk), strict=False):
                if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
                    self.dropped += 1
                    continue
                text_or_messages: str | Messages = prompt.prompt
                if self.apply_chat_template and self.system_prompt is not None:
                    text_or_messages = self.messages(prompt)
                kept.append(replace(prompt, prompt=text_or_messages, prompt_ids=ids))
        if self.dropped:
            log.warning(
                "dropped %d of %d prompts longer than data.max_prompt_tokens=%d",
                self.dropped,
                len(prompts),
                self.max_prompt_tokens,
            )
        return kept
