"""Settings of the TITO session server (``[rollout.sessions]``; ``miles sessions serve`` takes the same;
the server is :mod:`miles.sessions`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["SessionSettings"]


class SessionSettings(BaseModel):
    """The TITO session server agents talk to (OpenAI's chat API; see ``docs/how-to/agents.md``).

    A rollout function built on :class:`miles.sessions.rollout.SessionRollout` starts one on loopback when
    the first rollout begins (or uses ``url``) and stops it with the run.
    """

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    url: str | None = None
    """Use a session server started elsewhere (``miles sessions serve``) instead of starting one."""
    host: str = "127.0.0.1"
    """Address the server binds (loopback by default)."""
    port: int = Field(0, ge=0, le=65535)
    """Port the server listens on (0: any free port)."""
    chat_template: str | None = None
    """The template sessions render with: a ``.jinja`` file or a fixed template's name (``qwen3``);
    default the tokenizer's. A template that fails the append-only check is refused."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Template variables for every render (e.g. ``{enable_thinking = false}``); a request's
    ``chat_template_kwargs`` add to them."""
    tool_parser: Literal["auto", "hermes", "llama3_json", "none"] = "auto"
    """How replies are read as tool calls (``auto``: from the template)."""
    reasoning_parser: Literal["auto", "think", "none"] = "auto"
    """How thinking is split from the answer (``auto``: ``think`` when the template knows ``</think>``)."""
    end_tokens: list[str] = Field(default_factory=lambda: ["<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>"])
    """Tokens that end an assistant turn besides the tokenizer's EOS (those missing from the vocabulary are
    ignored)."""
    max_tokens: int = Field(1024, ge=1)
    """A turn's ``max_tokens`` when the request sets none."""
    context_length: int | None = Field(None, ge=2)
    """Longest session (prompt + every turn); default: the engine's. A turn that would pass it finishes
    with ``length``."""
    live_check: bool = True
    """At start, run a short session and check its tokens and logprobs equal a direct ``/generate`` on
    the same ids."""
    live_check_tolerance: float = Field(1e-4, ge=0.0)
    """Largest logprob difference the live check accepts."""
    return_routed_experts: bool = False
    """Ask the engines for routed experts (MoE routing replay) and keep them per token."""
    affinity: bool = True
    """Route every turn of a session to one engine (consistent hashing on its routing key) so its
    history stays in that engine's prefix cache; false: the least-loaded engine per turn."""
    max_image_pixels: int = Field(4096 * 4096, ge=1)
    """A vision-language policy: the most pixels (width x height) an image of a request may have, checked
    before decoding (a larger one is a 400 naming the message and part)."""
    max_sessions: int = Field(100_000, ge=1)
    """Open sessions at most (a create beyond answers 503)."""
