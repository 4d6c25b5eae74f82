"""A session's exact token record: a tree of turns, each the tokens of one request and one reply.

A request's messages are matched against the record (:meth:`Session.match`): the longest stored path
whose messages (request messages, then the reply the server returned, turn after turn) the request
repeats is its *parent*; the rest are its new messages. Only those are tokenised (:meth:`Session.plan`):
the template renders the stored history and the history plus the new messages, the second must extend
the first token for token (else :class:`AppendOnlyViolation`), and what it adds is appended — after the
template's closing of the parent's reply (``\\n`` after ``<|im_end|>``) — to the stored tokens, whose
model part stays exactly as sampled. A request whose parent already has a reply of its own (an edited
or dropped message, a retried turn) starts a new branch; every root-to-leaf path is one trajectory
(:meth:`Session.sample`). A vision-language policy's images are part of their messages (by digest) and of the
turn that brought them; a trajectory's sample carries its images in placeholder order
(:mod:`miles.sessions.images`).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from miles.sessions.append_only import first_difference, offending_message
from miles.sessions.messages import Message, same_message
from miles.sessions.parsers import ReasoningParser, ToolParser, parse_reply
from miles.sessions.templates import ChatRenderer
from miles.types import Sample, SampleStatus, WeightSpan

if TYPE_CHECKING:
    from miles.rollout.protocol import GenerateOutput

__all__ = ["AppendOnlyViolation", "Session", "SessionSampling", "Turn"]


class AppendOnlyViolation(ValueError):
    """The template rendered the stored history differently once new messages arrived."""

    def __init__(self, message: str, *, message_index: int) -> None:
        super().__init__(message)
        self.message_index = message_index


@dataclass
class SessionSampling:
    """Sampling a session applies to every turn. With ``override`` the request's own ``temperature`` /
    ``top_p`` are ignored: in RL the run decides the policy's distribution (the trainer recomputes
    logprobs at that temperature)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = None
    """Cap on every turn's ``max_tokens``."""
    seed: int | None = None
    """Turn ``k`` samples with a seed derived from this and ``k`` (reproducible episodes)."""
    override: bool = False


@dataclass
class Turn:
    """One request and the model's reply to it."""

    id: int
    parent: Turn | None
    key: str
    """Tools and template arguments the turn was rendered with (a root's key holds for its subtree)."""
    messages: list[Message]
    """The request's new messages, template form."""
    prompt_ids: list[int]
    """Tokens appended before generating: the closing of the parent's reply and the new messages."""
    template_ids: list[int]
    """The template's tokens of this turn's whole prompt (history + new messages + generation prompt)."""
    start: int
    """Position of ``prompt_ids[0]`` in the session's token sequence."""
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    reply: Message = field(default_factory=dict)
    """The assistant message the server returned, template form."""
    finish: str = "stop"
    """The engine's finish type: ``stop`` or ``length``."""
    weight_spans: list[WeightSpan] = field(default_factory=list)
    """Weight versions of the output tokens, positions relative to ``output_ids``."""
    routed: bytes | None = None
    routed_shape: tuple[int, int, int] | None = None
    kept: list[list[int]] | None = None
    """Sampling-mask replay (``rollout.replay_sampling_mask``): each output token's kept set under top-k /
    top-p, and ``behaviour`` its logprob under that set renormalised (what the engine sampled from)."""
    behaviour: list[float] | None = None
    images: list[str] = field(default_factory=list)
    """Digests of the images of :attr:`messages`, in placeholder order (:mod:`miles.sessions.images`)."""
    cached_tokens: int = 0
    children: list[Turn] = field(default_factory=list)
    truncated: str = ""
    """Why the next request could not be served (the context length), if that happened."""

    @property
    def end(self) -> int:
        return self.start + len(self.prompt_ids) + len(self.output_ids)

    def path(self) -> list[Turn]:
        out: list[Turn] = []
        node: Turn | None = self
        while node is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def history(self) -> list[Message]:
        """The conversation through this turn's reply (template form, as stored)."""
        return [m for t in self.path() for m in (*t.messages, t.reply)]

    def sequence(self) -> list[int]:
        """The session's tokens through this turn's reply."""
        return [tok for t in self.path() for tok in (*t.prompt_ids, *t.output_ids)]


_ids = itertools.count()


def _version(value: str | None) -> int:
    try:
        return int(value) if value is not None else 0
    except ValueError:
        return 0


class Session:
    """One agent episode (or a tree of them): see the module docstring."""

    def __init__(
        self,
        renderer: ChatRenderer,
        *,
        session_id: str,
        sampling: SessionSampling | None = None,
        routing_key: str | None = None,
        metadata: dict[str, Any] | None = None,
        tool_parser: ToolParser = "hermes",
        reasoning_parser: ReasoningParser = "none",
        image_token_id: int | None = None,
    ) -> None:
        self.id = session_id
        self.image_token_id = image_token_id
        """A vision-language policy's image placeholder token (``None``: a text policy)."""
        self.images: dict[str, str] = {}
        """Every image of the session as a ``data:`` URL, by digest."""
        self.renderer = renderer
        self.tool_parser: ToolParser = tool_parser
        self.reasoning_parser: ReasoningParser = reasoning_parser
        self.sampling = sampling or SessionSampling()
        self.routing_key = routing_key if routing_key is not None else session_id
        self.metadata = dict(metadata or {})
        self.turns: list[Turn] = []
        self.roots: list[Turn] = []
        self.latest: Turn | None = None
        self.branches = 0
        """Requests that did not extend the latest path."""
        self.violations = 0
        """Requests refused because the template was not append-only on them."""
        self.created = time.time()
        self.lock = asyncio.Lock()
        """One turn at a time per session."""

    # -- matching ----------------------------------------------------------------------------------
    def match(self, messages: Sequence[Message], key: str) -> tuple[Turn | None, list[Message], bool]:
        """``(parent, new messages, starts a branch)`` for a request (see the module docstring)."""
        parent: Turn | None = None
        level = [r for r in self.roots if r.key == key]
        pos = 0
        while True:
            found = None
            for child in reversed(level):  # the most recent of identical siblings
                block = [*child.messages, child.reply]
                window = messages[pos : pos + len(block)]
                if len(window) == len(block) and all(same_message(a, b) for a, b in zip(block, window, strict=True)):
                    found = child
                    break
            if found is None:
                break
            parent, pos, level = found, pos + len(found.messages) + 1, found.children
        branch = bool(parent.children) if parent is not None else bool(self.roots)
        return parent, list(messages[pos:]), branch

    # -- tokens ------------------------------------------------------------------------------------
    def plan(
        self,
        parent: Turn | None,
        new: Sequence[Message],
        *,
        tools: Sequence[Any] | None,
        template_kwargs: dict[str, Any] | None,
    ) -> tuple[list[int], list[int]]:
        """``(tokens to append, the template's tokens of the whole prompt)`` for ``new`` after ``parent``.

        Raises :class:`AppendOnlyViolation` when the template does not extend the stored history.
        """
        r = self.renderer
        if parent is None:
            ids = r.ids(new, tools=tools, add_generation_prompt=True, template_kwargs=template_kwargs)
            return ids, ids
        history = parent.history()
        old = r.ids(history, tools=tools, template_kwargs=template_kwargs)
        prompt = parent.template_ids
        i = first_difference(prompt, old)
        if i < len(prompt):
            self.violations += 1
            raise AppendOnlyViolation(
                f"{r.name} renders the assistant reply at messages[{len(history) - 1}] so that its generation "
                f"prompt is no longer a prefix: {r.decode(prompt[i : i + 32])!r} became {r.decode(old[i : i + 32])!r}",
                message_index=len(history) - 1,
            )
        tail = r.closing(old[len(prompt) :], parent.output_ids)
        later = r.ids([*history, *new], tools=tools, add_generation_prompt=True, template_kwargs=template_kwargs)
        i = first_difference(old, later)
        if i < len(old):
            self.violations += 1
            m = offending_message(r, history, later, tools, template_kwargs)
            raise AppendOnlyViolation(
                f"{r.name} is not append-only on this conversation: with the new messages it renders "
                f"messages[{m}] ({history[m]['role']}) differently: {r.decode(old[i : i + 32])!r} became "
                f"{r.decode(later[i : i + 32])!r}; configure an append-only template (rollout.sessions.chat_template)",
                message_index=m,
            )
        return tail + later[len(old) :], later

    def add_turn(
        self,
        parent: Turn | None,
        new: Sequence[Message],
        *,
        key: str,
        prompt_ids: list[int],
        template_ids: list[int],
        branch: bool,
        images: Sequence[str] = (),
    ) -> Turn:
        """Record a turn whose prompt is about to be generated from (its outputs are filled in after);
        ``images``: the digests of the new messages' images (in :attr:`images` already)."""
        turn = Turn(
            next(_ids), parent, key, list(new), prompt_ids, template_ids, parent.end if parent is not None else 0
        )
        turn.images = list(images)
        (parent.children if parent is not None else self.roots).append(turn)
        self.turns.append(turn)
        self.latest = turn
        if branch:
            self.branches += 1
        return turn

    def record(self, turn: Turn, output: GenerateOutput) -> None:
        """Fill a turn with what the engine sampled, and read it as the assistant message to return."""
        ids = list(output.output_ids)
        turn.output_ids = ids
        turn.output_logprobs = [float(v) for v in output.output_logprobs]
        turn.finish = "length" if output.finish_reason.type == "length" else "stop"
        turn.cached_tokens = output.cached_tokens
        if output.weight_version_spans:
            turn.weight_spans = [WeightSpan(a, b, _version(v)) for a, b, v in output.weight_version_spans]
        elif ids:
            turn.weight_spans = [WeightSpan(0, len(ids), _version(output.weight_version))]
        if output.sampling_mask is not None and output.sampling_logprobs is not None:
            turn.kept = [list(k) for k in output.sampling_mask]
            turn.behaviour = [float(v) for v in output.sampling_logprobs]
        shape = output.meta_info.get("routed_experts_shape")
        if output.routed_experts is not None and shape is not None:
            turn.routed = output.routed_experts
            turn.routed_shape = (int(shape[0]), int(shape[1]), int(shape[2]))
        text_ids = ids[:-1] if ids and ids[-1] in self.renderer.end_ids else ids
        text = self.renderer.decode(text_ids)
        matched = output.finish_reason.matched
        if isinstance(matched, str) and matched in text:
            text = text[: text.find(matched)]
        parsed = parse_reply(text, tool_parser=self.tool_parser, reasoning_parser=self.reasoning_parser)
        reply: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            reply["tool_calls"] = [
                {
                    "id": f"call_{turn.id}_{i}",
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for i, c in enumerate(parsed.tool_calls)
            ]
        if parsed.reasoning:
            reply["reasoning_content"] = parsed.reasoning
        turn.reply = reply

    def discard(self, turn: Turn) -> None:
        """Remove a turn whose generation failed (it has no children)."""
        siblings = turn.parent.children if turn.parent is not None else self.roots
        siblings.remove(turn)
        self.turns.remove(turn)
        if self.latest is turn:
            self.latest = self.turns[-1] if self.turns else None

    def image_data(self, turn: Turn) -> list[str]:
        """The images of the conversation through ``turn``'s prompt, in placeholder order (``data:`` URLs)."""
        return [self.images[d] for t in turn.path() for d in t.images]

    # -- samples -----------------------------------------------------------------------------------
    def leaves(self) -> list[Turn]:
        return [t for t in self.turns if not t.children]

    def sample(self, leaf: Turn) -> Sample:
        """The trajectory from the first request to ``leaf``: the first prompt as ``prompt_ids``, every
        later token as response, ``loss_mask`` 1 exactly on the tokens the policy sampled."""
        path = leaf.path()
        response: list[int] = []
        logprobs: list[float] = []
        mask: list[int] = []
        spans: list[WeightSpan] = []
        policy_spans: list[list[int]] = []
        # with sampling-mask replay: every policy token's kept set and behaviour logprob; an empty row for the
        # tokens no request sampled (tool results, user turns, template), whose distribution stays whole
        replay = all(t.kept is not None and t.behaviour is not None for t in path)
        kept: list[list[int]] = []
        for k, turn in enumerate(path):
            if k:
                response += turn.prompt_ids
                logprobs += [0.0] * len(turn.prompt_ids)
                mask += [0] * len(turn.prompt_ids)
                kept += [[] for _ in turn.prompt_ids]
            start = len(response)
            response += turn.output_ids
            logprobs += turn.behaviour if replay and turn.behaviour is not None else turn.output_logprobs
            kept += turn.kept if replay and turn.kept is not None else []
            mask += [1] * len(turn.output_ids)
            spans += [WeightSpan(start + s.start, start + s.end, s.version) for s in turn.weight_spans]
            policy_spans.append([start, len(response)])
        if leaf.truncated:
            status, reason = SampleStatus.TRUNCATED, leaf.truncated
        elif leaf.finish == "length":
            status, reason = SampleStatus.TRUNCATED, f"length {len(leaf.output_ids)}"
        else:
            status, reason = SampleStatus.COMPLETED, ""
        routed, shape = self._routed(path)
        images = self.image_data(leaf)
        vision: dict[str, Any] = {}
        if self.image_token_id is not None:  # what the trainer reads (miles.training.vision): the episode's
            vision = {"images": images, "image_token_id": self.image_token_id}  # images, not its data row's
        prompt_lengths = [t.start + len(t.prompt_ids) for t in path]
        info = {
            "id": self.id,
            "leaf": leaf.id,
            "latest": leaf is self.latest_leaf(),
            "turns": len(path),
            "branches": self.branches,
            "append_only_violations": self.violations,
            "policy_tokens": sum(mask),
            "masked_tokens": len(mask) - sum(mask),
            "tool_calls": sum(len(t.reply.get("tool_calls", [])) for t in path),
            "prompt_tokens": sum(prompt_lengths),
            "cached_tokens": sum(t.cached_tokens for t in path),
            "policy_spans": policy_spans,
        }
        first = path[0]
        return Sample(
            prompt_ids=list(first.prompt_ids),
            response_ids=response,
            rollout_logprobs=logprobs,
            loss_mask=mask,
            status=status,
            status_reason=reason,
            prompt=self.renderer.decode(first.prompt_ids),
            response=self.renderer.decode(response),
            weight_versions=spans,
            request_spans=[(a, b) for a, b in policy_spans],
            routed_experts=routed,
            routed_experts_shape=shape,
            sampling_mask=kept if replay else None,
            metadata={
                **self.metadata,
                "session": info,
                "messages": leaf.history(),
                "cached_tokens": first.cached_tokens,
                "prompt_tokens": len(first.prompt_ids),
                **vision,
            },
        )

    def latest_leaf(self) -> Turn | None:
        """The leaf of the most recent turn's path (the trajectory an agent ended on)."""
        return self.latest

    def samples(self) -> list[Sample]:
        """One sample per leaf, in the order their paths were started; the latest path last."""
        leaves = self.leaves()
        latest = self.latest_leaf()
        ordered = [t for t in leaves if t is not latest] + ([latest] if latest in leaves else [])
        return [self.sample(t) for t in ordered]

    @staticmethod
    def _routed(path: Sequence[Turn]) -> tuple[bytes | None, tuple[int, int, int] | None]:
        """Routed experts of every fed token: each turn contributes the rows its own call computed."""
        if not path or any(t.routed is None or t.routed_shape is None for t in path):
            return None, None
        _, layers, topk = path[0].routed_shape  # type: ignore[misc]
        row = layers * topk * 4
        chunks: list[bytes] = []
        covered = 0
        for turn in path:
            assert turn.routed is not None and turn.routed_shape is not None
            rows = turn.routed_shape[0]
            chunks.append(turn.routed[covered * row : rows * row])
            covered = max(covered, rows)
        data = b"".join(chunks)
        return data, (len(data) // row if row else 0, layers, topk)
