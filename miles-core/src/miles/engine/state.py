"""What the local engine's HTTP routes share: the scheduler, the tokenizer and the server's options."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from miles.engine.weight_paths import WeightDirs

if TYPE_CHECKING:
    from miles.engine.scheduler import Scheduler

__all__ = ["EngineState"]


@dataclass
class EngineState:
    """What the routes need: the scheduler, the tokenizer and the server's arguments."""

    scheduler: Scheduler
    tokenizer: Any
    model_path: str
    api_key: str | None = None
    server_args: dict[str, Any] = field(default_factory=dict)
    return_original_logprob: bool = False
    on_randomize: list[Callable[[int], None]] = field(default_factory=list)
    """Called with the seed by ``/debug/randomize_weights`` (on the scheduler thread): more weight memory
    to overwrite, such as the receive buffers of point-to-point sessions."""
    weight_dirs: WeightDirs | None = None
    """Where weight routes may load from (default: the model's directory only)."""
    generate_requests: int = 0
    """``/generate`` calls answered so far (``/server_info`` reports it: which engine served how much)."""
    generated_samples: int = 0
    """Completions those calls asked for (a call with ``n = 4`` counts 4)."""
    instance: str = field(default_factory=lambda: uuid.uuid4().hex)
    """This engine process's identity, in every ``/health`` answer (the ``x-miles-instance`` header): a
    client tells an engine restarted at the same URL from the one it knew, even if it never saw it die."""

    def __post_init__(self) -> None:
        if self.weight_dirs is None:
            self.weight_dirs = WeightDirs([self.model_path])

    def weight_path(self, path: str, *, field: str) -> str:
        """``path`` resolved, if a weight route may load from it (else :class:`PermissionError`)."""
        assert self.weight_dirs is not None
        return str(self.weight_dirs.check(path, field=field))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode_each(self, ids: list[int]) -> list[str]:
        return list(self.tokenizer.batch_decode([[t] for t in ids]))
