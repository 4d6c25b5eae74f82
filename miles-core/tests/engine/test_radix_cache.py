"""The radix prefix cache in-process: insert, longest-prefix match with KV, node splits, LRU eviction
under the token bound, flush."""

from __future__ import annotations

import torch

from miles.engine.radix_cache import RadixCache

LAYERS, HEADS, DIM = 2, 2, 3


def kv_of(tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A recognisable KV: every vector of token ``t`` at position ``p`` holds ``t * 1000 + p``."""
    n = len(tokens)
    base = torch.tensor([t * 1000 + p for p, t in enumerate(tokens)], dtype=torch.float32)
    k = base[None, None, :, None].expand(LAYERS, HEADS, n, DIM).clone()
    return k, -k


def test_match_returns_longest_prefix_with_its_kv() -> None:
    cache = RadixCache(1000)
    seq = [1, 2, 3, 4, 5]
    assert cache.insert(seq, *kv_of(seq)) == 5
    hit = cache.match([1, 2, 3, 9, 9])
    assert hit.length == 3
    assert torch.equal(hit.k, kv_of(seq)[0][:, :, :3]) and torch.equal(hit.v, kv_of(seq)[1][:, :, :3])
    assert cache.match([7, 1, 2]).length == 0
    assert cache.match(seq, limit=2).length == 2
    assert cache.match([*seq, 6]).length == 5


def test_insert_splits_nodes_and_stores_only_new_tokens() -> None:
    cache = RadixCache(1000)
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8]
    cache.insert(a, *kv_of(a))
    assert cache.insert(b, *kv_of(b)) == 2
    assert cache.num_tokens == 8
    for seq in (a, b):
        hit = cache.match(seq)
        assert hit.length == len(seq)
        assert torch.equal(hit.k, kv_of(seq)[0])
    assert cache.insert(a[:4], *kv_of(a[:4])) == 0


def test_routed_experts_travel_with_the_prefix() -> None:
    cache = RadixCache(1000)
    seq = [4, 5, 6, 7]
    experts = torch.arange(len(seq) * 2 * 2, dtype=torch.int32).reshape(len(seq), 2, 2)
    cache.insert(seq, *kv_of(seq), experts)
    cache.insert([*seq[:2], 9], *kv_of([*seq[:2], 9]), experts[:3])
    hit = cache.match(seq)
    assert torch.equal(hit.experts, experts)


def test_lru_eviction_keeps_the_bound_and_the_recent_prefixes() -> None:
    cache = RadixCache(10)
    old, recent = [1, 2, 3, 4], [5, 6, 7, 8]
    cache.insert(old, *kv_of(old))
    cache.insert(recent, *kv_of(recent))
    cache.match(recent)  # touch
    newest = [9, 10, 11, 12]
    cache.insert(newest, *kv_of(newest))
    assert cache.num_tokens <= 10
    assert cache.match(recent).length == 4 and cache.match(newest).length == 4
    assert cache.match(old).length < 4  # the least recently used one lost its tail (or all of it)
    hit = cache.match(old)
    if hit.length:
        assert torch.equal(hit.k, kv_of(old)[0][:, :, : hit.length])


def test_zero_capacity_disables_and_flush_empties() -> None:
    off = RadixCache(0)
    assert off.insert([1, 2], *kv_of([1, 2])) == 0 and off.match([1, 2]).length == 0
    cache = RadixCache(100)
    cache.insert([1, 2, 3], *kv_of([1, 2, 3]))
    cache.match([1, 2, 3])
    assert cache.hit_rate > 0
    cache.flush()
    assert cache.num_tokens == 0 and cache.match([1, 2, 3]).length == 0


def test_exact_prefix_cache_hits_whole_sequences_only() -> None:
    """Deterministic inference's cache: a hit is exactly the inserted sequence (its own KV, copied), never
    a prefix or an extension of one; LRU eviction of whole entries under the bound; flush."""
    from miles.engine.radix_cache import ExactPrefixCache

    cache = ExactPrefixCache(10)
    a, b = [1, 2, 3, 4], [1, 2, 3, 4, 5, 6]
    k, v = kv_of(a)
    assert cache.insert(a, k, v) == 4
    k.fill_(0)  # the cache holds a copy
    hit = cache.match(a)
    assert hit.length == 4 and torch.equal(hit.k, kv_of(a)[0]) and torch.equal(hit.v, kv_of(a)[1])
    assert cache.match(a[:3]).length == 0  # a prefix of an entry is not a hit
    assert cache.match(b).length == 0  # nor an extension
    assert cache.match(a, limit=3).length == 0  # the limit must allow the whole entry
    assert cache.insert(a, *kv_of(a)) == 0  # already cached
    assert cache.insert(b, *kv_of(b)) == 6 and cache.num_tokens == 10
    cache.match(a)  # a is now the most recently used: inserting c evicts b
    c = [9, 9]
    assert cache.insert(c, *kv_of(c)) == 2
    assert cache.match(b).length == 0 and cache.match(a).length == 4 and cache.match(c).length == 2
    assert cache.num_tokens == 6
    assert cache.insert(list(range(11)), *kv_of(list(range(11)))) == 0  # larger than the whole bound
    cache.flush()
    assert cache.num_tokens == 0 and cache.match(a).length == 0
    assert 0.0 < cache.hit_rate < 1.0
