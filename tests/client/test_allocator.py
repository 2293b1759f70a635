"""BlockAllocator against a simple model: random alloc/free/map/unmap, invariants each step."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvdaemon.client.allocator import BlockAllocator
from kvdaemon.errors import BadRequest, PoolExhausted

# (page_bytes, block_bytes): aligned, and one where blocks straddle page boundaries.
GEOMETRIES = [(1024, 128), (1000, 96)]


def make(num_pages: int = 6, geometry: tuple[int, int] = (1024, 128)) -> BlockAllocator:
    page_bytes, block_bytes = geometry
    return BlockAllocator(num_pages, page_bytes, block_bytes)


def map_all(allocator: BlockAllocator) -> None:
    for page in range(allocator.num_pages):
        allocator.add_page(page)


class AllocatorModel(RuleBasedStateMachine):
    """The model: a set of live blocks and a set of mapped pages."""

    @initialize(geometry=st.sampled_from(GEOMETRIES))
    def setup(self, geometry: tuple[int, int]) -> None:
        self.alloc = make(6, geometry)
        self.live: set[int] = set()
        self.mapped: set[int] = set()

    def pages_of(self, block: int) -> set[int]:
        a = self.alloc
        first = block * a.block_bytes // a.page_bytes
        last = ((block + 1) * a.block_bytes - 1) // a.page_bytes
        return set(range(first, last + 1))

    def usable_free(self) -> int:
        return sum(
            1 for b in range(self.alloc.num_blocks)
            if b not in self.live and self.pages_of(b) <= self.mapped
        )

    @rule(page=st.integers(0, 5))
    def map_page(self, page: int) -> None:
        if page in self.mapped:
            with pytest.raises(BadRequest):
                self.alloc.add_page(page)
        else:
            self.alloc.add_page(page)
            self.mapped.add(page)

    @rule(page=st.integers(0, 5))
    def unmap_page(self, page: int) -> None:
        busy = any(page in self.pages_of(b) for b in self.live)
        if page not in self.mapped or busy:
            with pytest.raises(BadRequest):
                self.alloc.remove_page(page)
        else:
            self.alloc.remove_page(page)
            self.mapped.discard(page)

    @rule(n=st.integers(0, 20))
    def alloc_blocks(self, n: int) -> None:
        if n > self.usable_free():
            with pytest.raises(PoolExhausted):
                self.alloc.alloc(n)
            return
        got = self.alloc.alloc(n)
        assert len(got) == n == len(set(got))
        assert not set(got) & self.live, "a live block was handed out again"
        for block in got:
            assert self.pages_of(block) <= self.mapped, "block over an unmapped page"
        self.live |= set(got)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free_blocks(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.live)), unique=True, max_size=10))
        self.alloc.free(chosen)
        self.live -= set(chosen)

    @rule(block=st.integers(-1, 70))
    def free_bad(self, block: int) -> None:
        if block in self.live:
            return
        with pytest.raises(BadRequest):
            self.alloc.free([block])

    @invariant()
    def consistent(self) -> None:
        self.alloc.check()
        assert self.alloc.num_live == len(self.live)
        assert self.alloc.num_free == self.usable_free()
        spare = {p for p in self.mapped if not any(p in self.pages_of(b) for b in self.live)}
        assert set(self.alloc.spare_pages()) == spare


TestAllocatorModel = AllocatorModel.TestCase
TestAllocatorModel.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_blocks_come_from_the_fullest_page() -> None:
    alloc = make(3)
    map_all(alloc)
    per_page = alloc.blocks_per_page
    first = alloc.alloc(per_page)  # fills one page
    alloc.free([first[0], first[1]])  # page A: 2 free, pages B and C: all free (spare)
    again = alloc.alloc(2)
    assert sorted(again) == sorted(first[:2]), "the partly used page must be filled first"
    assert len(alloc.spare_pages()) == 2


def test_freed_space_gathers_in_whole_pages() -> None:
    alloc = make(4)
    map_all(alloc)
    blocks = alloc.alloc(3 * alloc.blocks_per_page)
    alloc.free(blocks[: alloc.blocks_per_page])
    assert len(alloc.spare_pages()) == 2  # the one just emptied and the untouched fourth


def test_double_free_and_repeats_are_refused_without_change() -> None:
    alloc = make(1)
    map_all(alloc)
    blocks = alloc.alloc(3)
    alloc.free([blocks[0]])
    with pytest.raises(BadRequest, match=f"block {blocks[0]} is not allocated .freed already"):
        alloc.free([blocks[1], blocks[0]])
    assert alloc.is_live(blocks[1]), "a refused free must free nothing"
    with pytest.raises(BadRequest, match=f"block {blocks[1]} appears twice in one free"):
        alloc.free([blocks[1], blocks[1]])
    assert alloc.is_live(blocks[1]), "a refused free must free nothing"
    alloc.check()


def test_exhausted_allocation_takes_nothing() -> None:
    alloc = make(2)
    alloc.add_page(0)
    free_before = alloc.num_free
    with pytest.raises(PoolExhausted):
        alloc.alloc(free_before + 1)
    assert alloc.num_free == free_before and alloc.num_live == 0


def test_straddling_block_needs_both_pages() -> None:
    alloc = make(3, (1000, 96))
    alloc.add_page(0)
    straddler = alloc.first_block(1) - 1
    assert (straddler + 1) * 96 > 1000
    got = alloc.alloc(alloc.num_free)
    assert straddler not in got
    alloc.add_page(1)
    assert straddler in alloc.alloc(alloc.num_free)
    with pytest.raises(BadRequest):
        alloc.remove_page(1)  # the straddler is live and touches page 1
    alloc.check()


def test_a_block_larger_than_a_page_is_refused() -> None:
    with pytest.raises(BadRequest, match="does not fit in a page"):
        BlockAllocator(4, 1024, 2048)
