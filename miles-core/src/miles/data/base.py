"""The data-source interface: an endless, resumable stream of prompts."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from miles.components import Component, SettingsT

__all__ = ["DataSource", "Prompt", "content_text"]


def content_text(content: Any) -> str:
    """A chat message's OpenAI content as text: a string, ``None`` or a list of parts (their text, joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))


@dataclass
class Prompt:
    """One row of a data set, ready for the rollout manager."""

    prompt: str | list[dict[str, Any]]
    """Plain text, or chat messages (``[{"role": ..., "content": ...}]``) for the chat template."""
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    """Where the row came from (``file.jsonl:12``), for error messages."""
    prompt_ids: list[int] | None = None
    """Token ids after the chat template (set once by the data pipeline; never re-tokenised)."""

    @property
    def text(self) -> str:
        """The prompt as text: itself, or for chat messages the last user message's text (the question a
        reward or a log line means by "the prompt")."""
        if isinstance(self.prompt, str):
            return self.prompt
        for message in reversed(self.prompt):
            if message.get("role") == "user":
                return content_text(message.get("content"))
        return ""

    @property
    def messages(self) -> list[dict[str, Any]] | None:
        """The chat messages (copies), or ``None`` for a plain-text prompt."""
        return None if isinstance(self.prompt, str) else [dict(m) for m in self.prompt]


class DataSource(Component[SettingsT], ABC):
    """A prompt stream. Registered with ``miles_register_data_sources``.

    Iteration is endless across epochs and deterministic given the seed; :meth:`state_dict` captures
    the position exactly so a resumed run sees the same prompts.
    """

    def __init__(
        self,
        settings: SettingsT,
        *,
        path: str,
        seed: int,
        shuffle: bool,
        prompt_key: str = "prompt",
        label_key: str = "label",
        pipeline: Callable[[list[Prompt]], list[Prompt]] | None = None,
    ) -> None:
        """:param pipeline: applied once to every prompt when the data is loaded (tokenising, filtering);
        see :class:`miles.data.pipeline.PromptPipeline`."""
        super().__init__(settings)
        self.path = path
        self.seed = seed
        self.shuffle = shuffle
        self.prompt_key = prompt_key
        self.label_key = label_key
        self.pipeline = pipeline
        self.prepare()

    def prepare(self) -> None:
        """Called at the end of the constructor: read the data (the default reads nothing)."""

    @abstractmethod
    def next_batch(self, n: int) -> list[Prompt]:
        """The next ``n`` prompts (wrapping to the next epoch, reshuffled, when one ends)."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The position (epoch, offset, RNG), JSON-serialisable."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
