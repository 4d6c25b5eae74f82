"""TITO sessions: token-exact multi-turn agentic rollouts behind an OpenAI-compatible chat API.

An agent (any OpenAI-compatible client or framework) talks to the **session server**
(:mod:`miles.sessions.server`) as if it were a chat model. The server keeps, per session, the exact token
ids the engines consumed and produced: each request's new messages are tokenised as a suffix of the
stored sequence (:mod:`miles.sessions.session`), the model's tokens stay exactly as sampled, and
everything the policy did not sample is loss-masked. A chat template is accepted only when it renders
conversations append-only (:mod:`miles.sessions.append_only`). The finished episodes come out as
:class:`~miles.types.Sample` objects; :class:`~miles.sessions.rollout.SessionRollout` turns an agent
episode into a rollout function.

This package imports nothing heavy at import time (its settings model, :mod:`miles.settings.sessions`, is
part of the settings tree).
"""

from __future__ import annotations

__all__: list[str] = []
