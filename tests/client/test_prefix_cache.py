"""Prefix cache: stable chained hashes, verified hits, forced collisions, page-aware LRU eviction.

Unit tests drive ``PrefixCache`` with explicit block ids; the end-to-end ones go
through a ``BlockManager`` over the fake source of ``test_block_manager`` and
check the tokens stored in the blocks a sequence ends up with.
"""

from __future__ import annotations

import hashlib
from array import array

import pytest

from kvdaemon.client import prefix_cache
from kvdaemon.client.block_manager import BlockManager
from kvdaemon.client.prefix_cache import ROOT, PrefixCache, block_hash
from kvdaemon.errors import BadRequest

from .test_block_manager import (
    FakeSource,
    add_and_write,
    append_and_write,
    check_invariants,
    stored_tokens,
)


@pytest.fixture
def colliding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block hash is the same 16 bytes."""
    monkeypatch.setattr(prefix_cache, "block_hash", lambda *args: bytes(16))


def cache_of(blocks: dict[int, tuple[int, ...]], blocks_per_page: int) -> PrefixCache:
    """A cache holding ``blocks`` (id -> token ids), each a one-block prefix, ref count 1."""
    cache = PrefixCache(blocks_per_page)
    cache.adopt(list(blocks))
    for block_id, tokens in blocks.items():
        cache.register(block_id, ROOT, tokens)
    return cache


def distinct(block_ids: range) -> dict[int, tuple[int, ...]]:
    return {b: (b, b) for b in block_ids}


# -- hashing -------------------------------------------------------------------


def test_block_hash_is_blake2b_over_a_fixed_encoding() -> None:
    parent = bytes(range(16))
    expected = hashlib.blake2b(
        (5).to_bytes(8, "little") + b"llama" + parent + array("q", [1, -2, 3]).tobytes(), digest_size=16
    ).digest()
    assert block_hash(parent, [1, -2, 3], b"llama") == expected  # no per-process salt: stable everywhere
    assert block_hash(parent, (1, -2, 3), b"llama") == expected


def test_block_hash_depends_on_parent_tokens_and_salt() -> None:
    base = block_hash(ROOT.hash, [1, 2], b"a")
    assert base != block_hash(bytes([1]) * 16, [1, 2], b"a")
    assert base != block_hash(ROOT.hash, [2, 1], b"a")
    assert base != block_hash(ROOT.hash, [1, 2], b"b")
    # the salt is length-prefixed, so salt and parent cannot trade bytes
    assert block_hash(ROOT.hash, [1], b"ab") != block_hash(ROOT.hash, [1], b"a")
    with pytest.raises(BadRequest, match="int64"):
        block_hash(ROOT.hash, [1, 2**64], b"")


# -- the index -------------------------------------------------------------------


def test_match_follows_the_chain_and_verifies_tokens() -> None:
    cache = PrefixCache(blocks_per_page=4, salt=b"m")
    cache.adopt([0, 1])
    first = cache.register(0, ROOT, [1, 2])
    second = cache.register(1, first, [3, 4])
    assert first.hash == block_hash(ROOT.hash, [1, 2], b"m") and first.serial != second.serial
    assert second.hash == block_hash(first.hash, [3, 4], b"m")
    assert cache.match(ROOT, [1, 2]) == (0, first)
    assert cache.match(first, [3, 4]) == (1, second)
    assert cache.match(ROOT, [3, 4]) is None  # same tokens, other position
    assert cache.match(first, [3, 5]) is None
    assert PrefixCache(4, salt=b"other").match(ROOT, [1, 2]) is None


def test_registering_an_already_cached_prefix_keeps_the_block_private() -> None:
    cache = PrefixCache(blocks_per_page=4)
    cache.adopt([0, 1])
    link = cache.register(0, ROOT, [1, 2])
    assert cache.register(1, ROOT, [1, 2]) == link
    assert not cache.is_cached(1)
    assert cache.release(1) is True  # uncached: back to the source
    assert cache.release(0) is False and cache.evictable_block_ids() == [0]
    with pytest.raises(BadRequest, match="not held"):
        cache.release(0)
    with pytest.raises(BadRequest, match="neither held nor cached"):
        cache.acquire(7)


def test_forced_collisions_are_misses(colliding: None) -> None:
    cache = PrefixCache(blocks_per_page=4)
    cache.adopt([0, 1, 2])
    first = cache.register(0, ROOT, [1, 2])
    other = cache.register(1, ROOT, [5, 6])
    child = cache.register(2, first, [3, 4])
    assert first.hash == other.hash == child.hash  # one bucket for everything
    assert cache.match(ROOT, [1, 2]) == (0, first)
    assert cache.match(ROOT, [5, 6]) == (1, other)
    assert cache.match(ROOT, [3, 4]) is None
    assert cache.match(other, [3, 4]) is None  # same tokens, different (colliding) parent
    assert cache.match(first, [3, 4]) == (2, child)


def test_a_child_outliving_its_parent_is_never_matched_under_a_new_parent() -> None:
    cache = PrefixCache(blocks_per_page=1)
    cache.adopt([0, 1])
    parent = cache.register(0, ROOT, [1, 2])
    cache.register(1, parent, [3, 4])
    cache.release(0)
    cache.release(1)
    assert cache.evict(1) == [0]
    cache.adopt([2])
    again = cache.register(2, ROOT, [1, 2])
    assert again.hash == parent.hash and again.serial != parent.serial
    assert cache.match(again, [3, 4]) is None  # the stale child is unverifiable: a miss, not a guess


# -- ref counts and eviction ---------------------------------------------------------


def test_eviction_is_lru_when_every_page_is_clean() -> None:
    cache = cache_of(distinct(range(4)), blocks_per_page=1)
    for block_id in (2, 0, 3, 1):
        cache.release(block_id)
    cache.acquire(0)  # a hit: no longer evictable...
    assert cache.evictable_block_ids() == [2, 3, 1]
    cache.release(0)  # ...and now the most recently used
    assert cache.evict(3) == [2, 3, 1]
    assert cache.evict(5) == [0]
    assert cache.num_cached == 0 and cache.evict(1) == []


def test_eviction_is_lru_when_no_page_is_clean() -> None:
    cache = cache_of(distinct(range(5)), blocks_per_page=8)  # one page, block 4 stays held
    for block_id in (3, 1, 0, 2):
        cache.release(block_id)
    assert cache.evict(2) == [3, 1]
    assert cache.evict(9) == [0, 2]
    assert cache.ref_count(4) == 1 and cache.num_held == 1


def test_eviction_empties_whole_pages_first() -> None:
    # pages of 4: page 0 = blocks 0-3, page 1 = 4-7, page 2 = 8-11
    cache = cache_of(distinct(range(12)), blocks_per_page=4)
    for block_id in (1, 2, 3, 4, 5, 8, 9, 10, 11, 6):  # 0 and 7 stay held
        cache.release(block_id)
    cache.release(7)  # page 1 turns clean now, after page 2
    # page 2 (clean first), then page 1 (its own LRU order), then the LRU of the rest
    assert cache.evict(4) == [8, 9, 10, 11]
    assert cache.evict(2) == [4, 5]
    assert cache.evict(3) == [6, 7, 1]
    assert cache.evict(9) == [2, 3]
    assert cache.held_block_ids() == [0]


def test_a_hit_on_a_clean_page_makes_it_unclean() -> None:
    cache = cache_of(distinct(range(8)), blocks_per_page=4)
    for block_id in range(1, 8):  # block 0 holds page 0; page 1 is clean
        cache.release(block_id)
    cache.acquire(5)
    assert cache.evict(2) == [1, 2]  # plain LRU now: no clean page left
    cache.release(5)  # page 1 clean again
    assert cache.evict(2) == [4, 6]


# -- end to end through the manager ----------------------------------------------------


def test_prompt_hits_after_its_sequence_was_freed() -> None:
    source = FakeSource(block_size=4)
    manager = BlockManager(source, salt=b"m")
    prompt = list(range(10, 20))
    assert add_and_write(manager, source, "a", prompt) == 0
    table = manager.block_table("a")
    manager.free_sequence("a")
    assert add_and_write(manager, source, "b", prompt + [7]) == 8
    assert manager.block_table("b")[:2] == table[:2]
    assert stored_tokens(manager, source, "b") == prompt + [7]


def test_blocks_filled_by_append_are_shared_while_in_use() -> None:
    source = FakeSource(block_size=4)
    manager = BlockManager(source)
    add_and_write(manager, source, "a", [1, 2, 3])
    append_and_write(manager, source, "a", [4, 5, 6, 7, 8, 9])
    assert add_and_write(manager, source, "b", [1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8
    assert manager.block_table("b")[:2] == manager.block_table("a")[:2]
    assert [manager.cache.ref_count(x) for x in manager.block_table("a")] == [2, 2, 1]
    check_invariants(manager, source, {s: manager.block_table(s) for s in "ab"})


def test_a_fully_cached_prompt_still_leaves_one_block_to_compute() -> None:
    source = FakeSource(block_size=4)
    manager = BlockManager(source)
    add_and_write(manager, source, "a", list(range(8)))
    assert add_and_write(manager, source, "b", list(range(8))) == 4
    assert manager.block_table("b")[0] == manager.block_table("a")[0]
    assert manager.block_table("b")[1] != manager.block_table("a")[1]
    assert stored_tokens(manager, source, "b") == list(range(8))


def test_misses_on_divergence_and_on_a_different_prefix() -> None:
    source = FakeSource(num_blocks=32, block_size=2)
    manager = BlockManager(source)
    prompts = {"a": [1, 1, 2, 2, 3, 3, 9], "b": [1, 1, 2, 2, 4, 4, 9], "c": [0, 0, 2, 2, 3, 3, 9]}
    add_and_write(manager, source, "a", prompts["a"])
    assert add_and_write(manager, source, "b", prompts["b"]) == 4  # diverges in block 2
    assert add_and_write(manager, source, "c", prompts["c"]) == 0  # same later blocks, other start
    for seq_id, tokens in prompts.items():
        assert stored_tokens(manager, source, seq_id) == tokens


def test_forced_collisions_through_the_manager_keep_data_right(colliding: None) -> None:
    source = FakeSource(block_size=4)
    manager = BlockManager(source)
    prompt = list(range(1, 10))
    add_and_write(manager, source, "a", prompt)
    manager.free_sequence("a")
    other = list(range(11, 20))
    assert add_and_write(manager, source, "b", other) == 0
    assert stored_tokens(manager, source, "b") == other
    # block 1 holds b's block 1 tokens: same (constant) hash, same tokens, other parent
    assert add_and_write(manager, source, "c", [1, 2, 3, 4, 15, 16, 17, 18, 0]) == 4
    assert add_and_write(manager, source, "d", prompt) == 8  # the real prefix still hits, verified
    for seq_id, tokens in {"b": other, "c": [1, 2, 3, 4, 15, 16, 17, 18, 0], "d": prompt}.items():
        assert stored_tokens(manager, source, seq_id) == tokens
