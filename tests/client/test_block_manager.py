"""BlockManager over a fake BlockSource: tables, slots, fork, eviction, all-or-nothing, a state machine.

``FakeSource`` stores each slot's token id in its K tensor (and the negated id
in V), as an engine's ``store_kv`` would store KV, so a test can read back
what a sequence's slots hold and compare it with the sequence's tokens.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvdaemon.client import prefix_cache
from kvdaemon.client.block_manager import BlockManager
from kvdaemon.errors import Asleep, BadRequest, DaemonUnreachable, PoolExhausted


class FakeSource:
    """A BlockSource over plain tensors ``[num_layers, num_blocks, block_size]``; lowest free id first."""

    def __init__(
        self, num_blocks: int = 16, block_size: int = 4, blocks_per_page: int = 4, num_layers: int = 2
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks_per_page = blocks_per_page
        self.allocated: set[int] = set()
        self.key = torch.zeros(num_layers, num_blocks, block_size, dtype=torch.float64)
        self.value = torch.zeros_like(self.key)
        self.alloc_calls: list[int] = []

    def alloc(self, n: int) -> list[int]:
        self.alloc_calls.append(n)
        free = [b for b in range(self.num_blocks) if b not in self.allocated]
        if n > len(free):
            raise PoolExhausted(f"{n} blocks asked, {len(free)} free")
        self.allocated.update(free[:n])
        return free[:n]

    def free(self, block_ids: list[int]) -> None:
        if len(set(block_ids)) != len(block_ids) or not self.allocated.issuperset(block_ids):
            raise BadRequest(f"double free or unknown block in {block_ids}")
        self.allocated.difference_update(block_ids)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        self.key[:, dst] = self.key[:, src]
        self.value[:, dst] = self.value[:, src]

    def write(self, slots: list[int], token_ids: Sequence[int]) -> None:
        """What ``store_kv`` would do: K holds the token id, V its negation, in every layer."""
        data = torch.tensor(list(token_ids), dtype=torch.float64)
        self.key.view(self.key.shape[0], -1)[:, slots] = data
        self.value.view(self.value.shape[0], -1)[:, slots] = -data

    def read(self, slots: list[int]) -> list[int]:
        """Token ids stored at ``slots``; asserts every layer and V agree."""
        keys = self.key.view(self.key.shape[0], -1)[:, slots]
        assert torch.equal(keys, -self.value.view(self.value.shape[0], -1)[:, slots])
        assert all(torch.equal(keys[0], layer) for layer in keys)
        return [int(x) for x in keys[0]]


def add_and_write(manager: BlockManager, source: FakeSource, seq_id: Hashable, tokens: list[int]) -> int:
    """``add_sequence`` plus the engine's write of the tokens it had to compute."""
    cached = manager.add_sequence(seq_id, tokens)
    source.write(manager.slot_mapping(seq_id, cached, len(tokens)), tokens[cached:])
    return cached


def append_and_write(
    manager: BlockManager, source: FakeSource, seq_id: Hashable, tokens: list[int]
) -> None:
    start = manager.num_tokens(seq_id)
    manager.append_tokens(seq_id, tokens)
    source.write(manager.slot_mapping(seq_id, start, start + len(tokens)), tokens)


def stored_tokens(manager: BlockManager, source: FakeSource, seq_id: Hashable) -> list[int]:
    return source.read(manager.slot_mapping(seq_id, 0, manager.num_tokens(seq_id)))


def snapshot(manager: BlockManager, source: FakeSource, seq_ids: Sequence[Hashable]) -> dict[str, Any]:
    """Everything an all-or-nothing call must leave unchanged when it raises."""
    return {
        "allocated": set(source.allocated),
        "tables": {s: manager.block_table(s) for s in seq_ids if s in manager},
        "tokens": {s: manager.num_tokens(s) for s in seq_ids if s in manager},
        "refs": {b: manager.cache.ref_count(b) for b in manager.cache.held_block_ids()},
        "evictable": set(manager.cache.evictable_block_ids()),
        "live": len(manager),
    }


def check_invariants(
    manager: BlockManager, source: FakeSource, tables: dict[Hashable, list[int]]
) -> None:
    """Each allocated block is held xor evictable; refs count holders; free blocks are unknown."""
    held = set(manager.cache.held_block_ids())
    evictable = manager.cache.evictable_block_ids()
    assert len(evictable) == len(set(evictable))
    assert not held & set(evictable)
    assert held | set(evictable) == source.allocated
    holders = Counter(b for table in tables.values() for b in table)
    assert {b: manager.cache.ref_count(b) for b in held} == dict(holders)
    for table in tables.values():
        assert len(table) == len(set(table))
    for block in range(source.num_blocks):
        if block not in source.allocated:
            assert manager.cache.ref_count(block) == 0 and not manager.cache.is_cached(block)


# -- tables and slots ----------------------------------------------------------


def test_tables_slots_and_growth() -> None:
    source = FakeSource(block_size=4)
    manager = BlockManager(source)
    assert manager.add_sequence("a", [1, 2, 3, 4, 5]) == 0
    table = manager.block_table("a")
    assert len(table) == 2 and manager.num_tokens("a") == 5
    assert manager.slot_mapping("a", 3, 5) == [table[0] * 4 + 3, table[1] * 4]
    manager.append_tokens("a", [6, 7, 8])
    assert manager.block_table("a") == table
    manager.append_tokens("a", [9])
    assert len(manager.block_table("a")) == 3 and manager.num_tokens("a") == 9
    manager.append_tokens("a", [])
    assert manager.num_tokens("a") == 9
    assert manager.add_sequence("empty", []) == 0 and manager.block_table("empty") == []
    check_invariants(manager, source, {s: manager.block_table(s) for s in ("a", "empty")})


def test_free_keeps_full_blocks_cached_and_returns_partial_ones() -> None:
    source = FakeSource(block_size=4)
    manager = BlockManager(source)
    manager.add_sequence("a", list(range(10)))
    full, partial = manager.block_table("a")[:2], manager.block_table("a")[2]
    manager.free_sequence("a")
    assert source.allocated == set(full) and partial not in source.allocated
    assert manager.cache.evictable_block_ids() == full[::-1]  # released tail first
    assert manager.num_held_blocks == 0 and manager.num_evictable_blocks == 2 and len(manager) == 0


def test_without_prefix_cache_everything_returns_to_the_source() -> None:
    source = FakeSource(block_size=4)
    manager = BlockManager(source, enable_prefix_cache=False)
    tokens = list(range(9))
    assert manager.add_sequence("a", tokens) == 0
    manager.free_sequence("a")
    assert source.allocated == set()
    assert manager.add_sequence("b", tokens) == 0 and manager.num_evictable_blocks == 0


def test_clear_errors() -> None:
    manager = BlockManager(FakeSource(block_size=4))
    manager.add_sequence("a", [1, 2, 3])
    with pytest.raises(BadRequest, match="already exists"):
        manager.add_sequence("a", [1])
    with pytest.raises(BadRequest, match="already exists"):
        manager.fork("a", "a")
    for call in (manager.block_table, manager.free_sequence, manager.num_tokens):
        with pytest.raises(BadRequest, match="unknown sequence 'zz'"):
            call("zz")
    with pytest.raises(BadRequest, match="unknown sequence"):
        manager.append_tokens("zz", [1])
    with pytest.raises(BadRequest, match="unknown sequence"):
        manager.fork("zz", "b")
    with pytest.raises(BadRequest, match="outside"):
        manager.slot_mapping("a", 2, 4)
    with pytest.raises(BadRequest, match="outside"):
        manager.slot_mapping("a", 2, 1)
    for bad in (["x"], [2**70], [1.5]):
        with pytest.raises(BadRequest, match="int64"):
            manager.add_sequence("b", bad)
        with pytest.raises(BadRequest, match="int64"):
            manager.append_tokens("a", bad)
    assert "b" not in manager and manager.num_tokens("a") == 3


def test_bad_ids_counts_and_headroom_are_refused_and_change_nothing() -> None:
    source = FakeSource(block_size=4)
    manager = BlockManager(source)
    manager.add_sequence("a", [1, 2, 3, 4, 5])
    manager.free_sequence("a")  # one full block stays cached
    before = snapshot(manager, source, [])
    with pytest.raises(BadRequest, match=r"sequence id must be hashable, got list \['x'\]"):
        manager.add_sequence(["x"], [1])  # type: ignore[arg-type]
    manager.add_sequence("b", [1])
    with pytest.raises(BadRequest, match="sequence id must be hashable, got dict"):
        manager.fork("b", {})  # type: ignore[arg-type]
    for call in (manager.block_table, manager.free_sequence, manager.num_tokens):
        with pytest.raises(BadRequest, match=r"unknown sequence \['x'\]"):
            call(["x"])  # type: ignore[arg-type]
    assert ["x"] not in manager  # type: ignore[comparison-overlap]
    manager.free_sequence("b")
    for bad in (-3, 1.5, True, "2", None):
        with pytest.raises(BadRequest, match=f"headroom_blocks must be an integer >= 0, got {bad!r}"):
            manager.add_sequence("c", [1, 2], headroom_blocks=bad)  # type: ignore[arg-type]
    for bad in (-1, "x", 2.0, False, None):
        with pytest.raises(BadRequest, match=f"evict_cached takes a count of blocks >= 0, got {bad!r}"):
            manager.evict_cached(bad)  # type: ignore[arg-type]
    with pytest.raises(BadRequest, match="int64"):
        manager.num_cached_tokens(None)  # type: ignore[arg-type]
    assert "c" not in manager and snapshot(manager, source, []) == before
    assert manager.num_evictable_blocks == 1 and manager.evict_cached(0) == 0 and manager.evict_cached(5) == 1


# -- fork ----------------------------------------------------------------------


def test_fork_shares_full_blocks_and_copies_the_partial_one() -> None:
    source = FakeSource(block_size=4)
    manager = BlockManager(source)
    tokens = list(range(100, 110))
    add_and_write(manager, source, "a", tokens)
    manager.fork("a", "b")
    a, b = manager.block_table("a"), manager.block_table("b")
    assert a[:2] == b[:2] and a[2] != b[2]
    assert [manager.cache.ref_count(x) for x in a] == [2, 2, 1] and manager.cache.ref_count(b[2]) == 1
    assert torch.equal(source.key[:, b[2]], source.key[:, a[2]])
    assert torch.equal(source.value[:, b[2]], source.value[:, a[2]])
    assert stored_tokens(manager, source, "b") == tokens
    append_and_write(manager, source, "a", [1, 2])
    append_and_write(manager, source, "b", [7, 8, 9])
    assert stored_tokens(manager, source, "a") == tokens + [1, 2]
    assert stored_tokens(manager, source, "b") == tokens + [7, 8, 9]
    # b's third block became full: registered under b's own chain, so a prompt of it hits
    assert add_and_write(manager, source, "c", tokens + [7, 8, 5]) == 12
    check_invariants(manager, source, {s: manager.block_table(s) for s in "abc"})
    for s in "abc":
        manager.free_sequence(s)
    check_invariants(manager, source, {})


def test_fork_of_block_aligned_and_empty_sequences_copies_nothing() -> None:
    source = FakeSource(block_size=4)
    manager = BlockManager(source)
    manager.add_sequence("a", list(range(8)))
    calls = len(source.alloc_calls)
    manager.fork("a", "b")
    manager.add_sequence("e", [])
    manager.fork("e", "f")
    assert len(source.alloc_calls) == calls
    assert manager.block_table("b") == manager.block_table("a") and manager.block_table("f") == []
    assert all(manager.cache.ref_count(x) == 2 for x in manager.block_table("a"))


# -- running out of blocks -----------------------------------------------------


def test_exhausted_source_evicts_cached_blocks_and_retries() -> None:
    source = FakeSource(num_blocks=4, block_size=2, blocks_per_page=2)
    manager = BlockManager(source)
    add_and_write(manager, source, "a", [1, 2, 3, 4, 5, 6])  # 3 full blocks
    manager.free_sequence("a")
    assert manager.num_evictable_blocks == 3 and len(source.allocated) == 3
    # 4 blocks needed, 1 free in the source, 3 evictable: take the free one, evict 3
    del source.alloc_calls[:]
    assert add_and_write(manager, source, "b", [9] * 7) == 0
    assert source.alloc_calls == [4, 1, 3]
    assert manager.num_evictable_blocks == 0 and len(source.allocated) == 4
    assert stored_tokens(manager, source, "b") == [9] * 7
    check_invariants(manager, source, {"b": manager.block_table("b")})


class UnreachableSource(FakeSource):
    """A source whose daemon is down: what it has free serves; a grow past that cannot."""

    def alloc(self, n: int) -> list[int]:
        try:
            return super().alloc(n)
        except PoolExhausted:
            raise DaemonUnreachable("no kvdaemon running") from None


def test_a_source_that_cannot_reach_its_daemon_serves_from_its_evicted_cache() -> None:
    source = UnreachableSource(num_blocks=4, block_size=2, blocks_per_page=2)
    manager = BlockManager(source)
    add_and_write(manager, source, "a", [1, 2, 3, 4, 5, 6])
    manager.free_sequence("a")
    assert add_and_write(manager, source, "b", [9] * 7) == 0  # 1 free + 3 evicted
    assert stored_tokens(manager, source, "b") == [9] * 7
    with pytest.raises(DaemonUnreachable):
        manager.append_tokens("b", [9, 9])  # nothing left to evict: unchanged
    assert manager.num_tokens("b") == 7
    check_invariants(manager, source, {"b": manager.block_table("b")})


@pytest.mark.parametrize("error", [Asleep, DaemonUnreachable, PoolExhausted])
def test_a_refused_admission_keeps_none_of_its_cache_hits(error: type[Exception]) -> None:
    source = FakeSource(num_blocks=4, block_size=2, blocks_per_page=2)
    manager = BlockManager(source)
    add_and_write(manager, source, "a", [1, 2, 3, 4, 5, 6])
    manager.free_sequence("a")
    assert manager.num_evictable_blocks == 3

    def refuse(n: int) -> list[int]:
        raise error("the source cannot give blocks now")

    source.alloc = refuse  # type: ignore[method-assign]
    with pytest.raises(error):
        manager.add_sequence("b", [1, 2, 3, 4, 5, 6, 7])  # 3 hits, 1 fresh block wanted
    assert manager.num_evictable_blocks == 3 and "b" not in manager, "a hit stayed pinned"


def test_cache_hits_are_not_evicted_to_make_room_for_their_own_sequence() -> None:
    source = FakeSource(num_blocks=4, block_size=2, blocks_per_page=2)
    manager = BlockManager(source)
    add_and_write(manager, source, "a", [1, 2, 3, 4])
    manager.free_sequence("a")
    add_and_write(manager, source, "x", [7, 7, 7, 7])  # the other two blocks, held
    hit = manager.block_table("x")
    manager.free_sequence("x")
    # [1,2] hits; its tail needs 2 fresh blocks: both must come from x's cached blocks
    assert add_and_write(manager, source, "b", [1, 2, 5, 6, 7]) == 2
    assert set(manager.block_table("b")[1:]) == set(hit)
    assert stored_tokens(manager, source, "b") == [1, 2, 5, 6, 7]


@pytest.mark.parametrize("scarce", [None, 0, 1, 3, -5, "2", 1.5])
def test_own_cache_first_while_the_source_is_scarce(scarce: object) -> None:
    """While the source says its provider is short (the blocks free without asking, an int),
    a shortfall the cache holds is evicted before allocating; anything else keeps the cache."""
    source = FakeSource(num_blocks=16, block_size=2, blocks_per_page=2)
    manager = BlockManager(source, scarce_free_blocks=lambda: scarce)  # type: ignore[arg-type, return-value]
    add_and_write(manager, source, "a", [1, 2, 3, 4, 5, 6])  # 3 full blocks, cached once freed
    manager.free_sequence("a")
    assert manager.num_evictable_blocks == 3
    add_and_write(manager, source, "b", [9] * 7)  # 4 fresh blocks
    short = 4 - max(0, scarce) if type(scarce) is int else 0
    evicted = short if 0 < short <= 3 else 0  # a shortfall past the cache goes the ordinary way
    assert manager.num_evictable_blocks == 3 - evicted
    assert len(source.allocated) == 3 - evicted + 4
    assert stored_tokens(manager, source, "b") == [9] * 7
    check_invariants(manager, source, {"b": manager.block_table("b")})


def test_own_cache_first_changes_nothing_when_the_free_part_fails() -> None:
    source = FakeSource(num_blocks=6, block_size=2, blocks_per_page=2)
    manager = BlockManager(source, scarce_free_blocks=lambda: 3)  # stale: only 1 is free
    add_and_write(manager, source, "a", [1, 2, 3, 4])  # 2 cached once freed
    manager.free_sequence("a")
    add_and_write(manager, source, "d", [7] * 6)  # 3 held: 1 block free
    before = snapshot(manager, source, ["a", "b", "d"])
    with pytest.raises(PoolExhausted):
        manager.add_sequence("b", [5] * 9)  # 5 blocks: 3 "free" first (fails), then 2 from the cache
    assert snapshot(manager, source, ["a", "b", "d"]) == before, "the cache was evicted for a failed call"


def test_own_cache_first_keeps_cache_hits_of_the_new_sequence() -> None:
    source = FakeSource(num_blocks=16, block_size=2, blocks_per_page=2)
    manager = BlockManager(source, scarce_free_blocks=lambda: 0)
    add_and_write(manager, source, "a", [1, 2, 3, 4])
    manager.free_sequence("a")
    assert add_and_write(manager, source, "b", [1, 2, 3, 4, 5]) == 4  # both cached blocks hit
    assert manager.num_held_blocks == 3 and stored_tokens(manager, source, "b") == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("op", ["add", "append", "fork"])
def test_pool_exhausted_changes_nothing(op: str) -> None:
    source = FakeSource(num_blocks=6, block_size=2, blocks_per_page=2)
    manager = BlockManager(source)
    add_and_write(manager, source, "a", [1, 2, 3])  # blocks 0, 1
    add_and_write(manager, source, "c", [5, 6, 7, 8])  # blocks 2, 3
    manager.free_sequence("c")  # 2 and 3 cached, evictable
    add_and_write(manager, source, "d", [4, 4, 4])  # blocks 4, 5: the source is full
    assert len(source.allocated) == 6 and manager.num_evictable_blocks == 2
    if op == "fork":
        add_and_write(manager, source, "e", [9, 9, 9])  # evicts both cached blocks
        assert manager.num_evictable_blocks == 0
    before = snapshot(manager, source, ["a", "b", "d", "e"])
    with pytest.raises(PoolExhausted):
        if op == "add":
            manager.add_sequence("b", [5, 6, 1, 1, 1, 1, 1])  # 1 hit, 3 fresh, 1 evictable left
        elif op == "append":
            manager.append_tokens("a", [1] * 7)  # 3 more blocks, 2 evictable
        else:
            manager.fork("a", "b")  # 1 block for the partial copy, nothing evictable
    assert snapshot(manager, source, ["a", "b", "d", "e"]) == before
    check_invariants(manager, source, {s: manager.block_table(s) for s in "ade" if s in manager})


def test_failed_copy_during_fork_gives_the_block_back() -> None:
    source = FakeSource(block_size=4)
    manager = BlockManager(source)
    manager.add_sequence("a", [1, 2, 3])
    before = snapshot(manager, source, ["a", "b"])
    with mock.patch.object(source, "copy_blocks", side_effect=RuntimeError("device lost")):
        with pytest.raises(RuntimeError, match="device lost"):
            manager.fork("a", "b")
    assert snapshot(manager, source, ["a", "b"]) == before


# -- a state machine against a model ---------------------------------------------

TOKENS = st.lists(st.integers(0, 2), max_size=7)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random add/append/fork/free against a model: the token list of each live sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.source = FakeSource(num_blocks=12, block_size=2, blocks_per_page=3)
        self.manager = BlockManager(self.source, salt=b"model")
        self.model: dict[int, list[int]] = {}
        self.next_id = 0

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _all_or_nothing(self, call: Any, *args: Any) -> bool:
        """Run a manager call; on PoolExhausted check nothing changed. True when it succeeded."""
        before = snapshot(self.manager, self.source, list(self.model))
        try:
            result = call(*args)
        except PoolExhausted:
            assert snapshot(self.manager, self.source, list(self.model)) == before
            event("pool exhausted")
            return False
        cache = self.manager.cache
        still_cached = set(cache.evictable_block_ids()) | set(cache.held_block_ids())
        if before["evictable"] - still_cached:
            event("cached blocks evicted")
        if call is add_and_write:
            event("prefix hit" if result else "no prefix hit")
        return True

    @rule(tokens=TOKENS)
    def add(self, tokens: list[int]) -> None:
        seq_id = self._new_id()
        if self._all_or_nothing(add_and_write, self.manager, self.source, seq_id, tokens):
            self.model[seq_id] = list(tokens)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tokens=TOKENS)
    def append(self, data: st.DataObject, tokens: list[int]) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.model)))
        if self._all_or_nothing(append_and_write, self.manager, self.source, seq_id, tokens):
            self.model[seq_id] += tokens

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.model)))
        new_id = self._new_id()
        if self._all_or_nothing(self.manager.fork, seq_id, new_id):
            self.model[new_id] = list(self.model[seq_id])

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.model)))
        self.manager.free_sequence(seq_id)
        del self.model[seq_id]

    @invariant()
    def blocks_are_accounted_once_and_hold_the_right_tokens(self) -> None:
        tables = {s: self.manager.block_table(s) for s in self.model}
        check_invariants(self.manager, self.source, tables)
        assert len(self.manager) == len(self.model)
        for seq_id, tokens in self.model.items():
            assert self.manager.num_tokens(seq_id) == len(tokens)
            assert len(tables[seq_id]) == -(-len(tokens) // self.source.block_size)
            assert stored_tokens(self.manager, self.source, seq_id) == tokens


class CollidingBlockManagerMachine(BlockManagerMachine):
    """The same machine with every block hash equal: verification alone keeps data right."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = mock.patch.object(prefix_cache, "block_hash", lambda *args: bytes(16))
        self.patch.start()

    def teardown(self) -> None:
        self.patch.stop()


MACHINE_SETTINGS = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = MACHINE_SETTINGS
TestCollidingBlockManagerMachine = CollidingBlockManagerMachine.TestCase
TestCollidingBlockManagerMachine.settings = MACHINE_SETTINGS
