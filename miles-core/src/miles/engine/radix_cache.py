"""A radix tree over token ids that stores the KV (and MoE routing) of cached prefixes.

Each edge holds a run of token ids and, for every token of the run, its key/value vectors of every layer
(``[layers, kv_heads, n, head_dim]``) and optionally its routed experts (``[n, moe_layers, topk]``). A
lookup returns the longest cached prefix of a sequence and the concatenated tensors; an insert adds the
part of a sequence the tree lacks. Capacity is a bound on cached tokens: beyond it, least-recently-used
leaves are evicted. The tree is used from the scheduler thread only, so it takes no locks.
"""

from __future__ import annotations

import itertools
import logging
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["ExactPrefixCache", "PrefixCache", "PrefixMatch", "RadixCache"]

log = logging.getLogger(__name__)


@dataclass
class _Node:
    tokens: tuple[int, ...]
    k: torch.Tensor | None
    """``[layers, kv_heads, len(tokens), head_dim]`` (``None`` at the root)."""
    v: torch.Tensor | None
    experts: torch.Tensor | None
    """``[len(tokens), moe_layers, topk]`` int32 or ``None``."""
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    last_access: int = 0


@dataclass
class PrefixMatch:
    """The longest cached prefix of a query: ``length`` tokens with their KV and routed experts."""

    length: int
    k: torch.Tensor | None
    v: torch.Tensor | None
    experts: torch.Tensor | None


class PrefixCache(ABC):
    """What the scheduler needs of a prefix cache: a bound, a token count and hit statistics."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        """Capacity in tokens (``0`` disables the cache)."""
        self.num_tokens = 0
        self.hit_tokens = 0
        self.query_tokens = 0

    @abstractmethod
    def match(self, tokens: Sequence[int], limit: int | None = None) -> PrefixMatch:
        """The cached prefix of ``tokens`` to reuse (at most ``limit`` tokens)."""

    @abstractmethod
    def insert(
        self, tokens: Sequence[int], k: torch.Tensor, v: torch.Tensor, experts: torch.Tensor | None = None
    ) -> int:
        """Cache ``tokens`` whose KV is ``k``/``v``; returns the number of new tokens."""

    @abstractmethod
    def flush(self) -> None:
        """Empty the cache (after a weight update, or on ``/flush_cache``)."""

    @property
    def hit_rate(self) -> float:
        """Cached tokens / looked-up tokens since start."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class RadixCache(PrefixCache):
    """Prefix cache keyed by token ids, bounded to ``max_tokens`` tokens (``0`` disables it)."""

    def __init__(self, max_tokens: int) -> None:
        super().__init__(max_tokens)
        self._clock = itertools.count(1)
        self._root = _Node((), None, None, None, None)

    # ------------------------------------------------------------------ lookup
    def match(self, tokens: Sequence[int], limit: int | None = None) -> PrefixMatch:
        """The longest cached prefix of ``tokens`` (at most ``limit`` tokens); refreshes its LRU time."""
        import torch

        limit = len(tokens) if limit is None else min(limit, len(tokens))
        node, pos, parts = self._root, 0, []
        now = next(self._clock)
        while pos < limit:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = 0
            run = child.tokens
            while n < len(run) and pos + n < limit and run[n] == tokens[pos + n]:
                n += 1
            child.last_access = now
            parts.append((child, n))
            pos += n
            if n < len(run):
                break
            node = child
        self.query_tokens += len(tokens)
        self.hit_tokens += pos
        if pos == 0:
            return PrefixMatch(0, None, None, None)
        k = torch.cat([c.k[:, :, :n] for c, n in parts], dim=2)  # type: ignore[index]
        v = torch.cat([c.v[:, :, :n] for c, n in parts], dim=2)  # type: ignore[index]
        experts = None
        if all(c.experts is not None for c, _ in parts):
            experts = torch.cat([c.experts[:n] for c, n in parts], dim=0)  # type: ignore[index]
        return PrefixMatch(pos, k, v, experts)

    # ------------------------------------------------------------------ insert
    def insert(
        self,
        tokens: Sequence[int],
        k: torch.Tensor,
        v: torch.Tensor,
        experts: torch.Tensor | None = None,
    ) -> int:
        """Cache ``tokens`` whose KV is ``k``/``v`` (``[layers, kv_heads, len(tokens), head_dim]``).

        Only the part not cached yet is stored (copied). Returns the number of new tokens.
        """
        if self.max_tokens <= 0 or not tokens:
            return 0
        node, pos = self._root, 0
        now = next(self._clock)
        tokens = tuple(int(t) for t in tokens)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                new = _Node(
                    tokens[pos:],
                    k[:, :, pos:].clone(),
                    v[:, :, pos:].clone(),
                    None if experts is None else experts[pos:].clone(),
                    node,
                    last_access=now,
                )
                node.children[tokens[pos]] = new
                added = len(tokens) - pos
                self.num_tokens += added
                self._evict(protect=new)
                return added
            run = child.tokens
            n = 0
            while n < len(run) and pos + n < len(tokens) and run[n] == tokens[pos + n]:
                n += 1
            child.last_access = now
            if n < len(run):
                child = self._split(child, n)
            node, pos = child, pos + n
        return 0

    def _split(self, child: _Node, n: int) -> _Node:
        """Split ``child`` after its first ``n`` tokens; returns the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = _Node(
            child.tokens[:n],
            child.k[:, :, :n],  # type: ignore[index]
            child.v[:, :, :n],  # type: ignore[index]
            None if child.experts is None else child.experts[:n],
            parent,
            {child.tokens[n]: child},
            child.last_access,
        )
        parent.children[child.tokens[0]] = upper
        child.tokens = child.tokens[n:]
        child.k = child.k[:, :, n:]  # type: ignore[index]
        child.v = child.v[:, :, n:]  # type: ignore[index]
        child.experts = None if child.experts is None else child.experts[n:]
        child.parent = upper
        return upper

    # ---------------------------------------------------------------- eviction
    def _leaves(self) -> list[_Node]:
        out, stack = [], [self._root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self._root:
                out.append(node)
        return out

    def _evict(self, protect: _Node | None = None) -> None:
        """Drop least-recently-used leaves until at most ``max_tokens`` tokens stay cached."""
        while self.num_tokens > self.max_tokens:
            leaves = [leaf for leaf in self._leaves() if leaf is not protect] or self._leaves()
            if not leaves:
                return
            victim = min(leaves, key=lambda node: node.last_access)
            over = self.num_tokens - self.max_tokens
            if over < len(victim.tokens):
                # trim the tail of the leaf rather than dropping it whole
                keep = len(victim.tokens) - over
                victim.tokens = victim.tokens[:keep]
                victim.k = victim.k[:, :, :keep].clone()  # type: ignore[index]
                victim.v = victim.v[:, :, :keep].clone()  # type: ignore[index]
                victim.experts = None if victim.experts is None else victim.experts[:keep].clone()
                self.num_tokens -= over
                return
            self._remove(victim)

    def _remove(self, node: _Node) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.tokens[0]]
        self.num_tokens -= len(node.tokens)

    def flush(self) -> None:
        """Empty the cache (after a weight update, or on ``/flush_cache``)."""
        self._root = _Node((), None, None, None, None)
        self.num_tokens = 0


class ExactPrefixCache(PrefixCache):
    """The prefix cache of deterministic inference: whole sequences, looked up by exact equality.

    A radix tree shares the KV of a common prefix between sequences whose KV were computed by different
    forwards (a longer prefill, decode steps), so whether a request hits changes its numerics in the last
    bits. Here an entry is the KV of one prefill of exactly its key, from position 0, and a lookup hits only
    the whole key: a hit gives bit for bit the KV a recomputation would give, so hits and misses (and thus
    timing, batch composition and a restart with an empty cache) cannot change any logprob. The ``n``
    samples of a GRPO group still share their prompt. Same interface as :class:`RadixCache`; LRU eviction
    of whole entries beyond ``max_tokens``.
    """

    def __init__(self, max_tokens: int) -> None:
        super().__init__(max_tokens)
        self._entries: OrderedDict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = (
            OrderedDict()
        )

    def match(self, tokens: Sequence[int], limit: int | None = None) -> PrefixMatch:
        """All of ``tokens`` if exactly they are cached (and ``limit`` allows all of them), else nothing."""
        self.query_tokens += len(tokens)
        key = tuple(int(t) for t in tokens)
        entry = self._entries.get(key)
        if entry is None or (limit is not None and limit < len(key)):
            return PrefixMatch(0, None, None, None)
        self._entries.move_to_end(key)
        self.hit_tokens += len(key)
        return PrefixMatch(len(key), *entry)

    def insert(
        self,
        tokens: Sequence[int],
        k: torch.Tensor,
        v: torch.Tensor,
        experts: torch.Tensor | None = None,
    ) -> int:
        """Cache the KV of exactly ``tokens`` (copied). Returns the number of new tokens."""
        key = tuple(int(t) for t in tokens)
        if self.max_tokens <= 0 or not key or len(key) > self.max_tokens:
            return 0
        if key in self._entries:
            self._entries.move_to_end(key)
            return 0
        self._entries[key] = (k.clone(), v.clone(), None if experts is None else experts.clone())
        self.num_tokens += len(key)
        while self.num_tokens > self.max_tokens:
            old, _ = self._entries.popitem(last=False)
            self.num_tokens -= len(old)
        return len(key)

    def flush(self) -> None:
        """Empty the cache (after a weight update, or on ``/flush_cache``)."""
        self._entries.clear()
        self.num_tokens = 0
