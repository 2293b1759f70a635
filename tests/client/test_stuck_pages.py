"""A map the OS refuses whose rollback it refuses too: the pages some slot still maps stay the
pool's (``SegmentMap.stuck``), never given back to be granted again, until they can be unmapped."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

from kvdaemon.client import KVClient, KVPool, KVSpec
from kvdaemon.client.pool_state import PoolState
from kvdaemon.errors import BackendError, Conflict

from tests.conftest import PAGE_BYTES, RunningDaemon, running_daemon

SPEC = KVSpec(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)
BLOCKS_PER_PAGE = PAGE_BYTES // SPEC.block_bytes
LOGICAL = SPEC.num_segments * PAGE_BYTES


@pytest.fixture
def kvd() -> Iterator[RunningDaemon]:
    with running_daemon("64MiB") as running:
        yield running


def mapped_bytes(client: KVClient) -> int:
    return next(t for t in client.status()["tenants"] if t["name"] == "a")["mapped_bytes"]


def refuse_unmaps_of(pool: KVPool, monkeypatch: pytest.MonkeyPatch, slot: int | None) -> None:
    """Make the backend refuse every unmap covering ``slot`` (every unmap when ``None``)."""
    real = pool.backend.unmap

    def unmap(addr: int, size_bytes: int) -> None:
        if slot is None or addr <= slot < addr + size_bytes:
            raise BackendError("munmap failed: out of memory (a test)")
        real(addr, size_bytes)

    monkeypatch.setattr(pool.backend, "unmap", unmap)


def stick_a_page(pool: KVPool, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """Grow the pool by two pages through a map refused at its second slot, with every unmap
    refused meanwhile: the first page ends stuck. Returns it and its slot in segment 0."""
    real_map_page, calls = pool.backend.map_page, [0]

    def map_page(addr: int, page: object) -> None:
        calls[0] += 1
        if calls[0] == 2:
            raise BackendError("mmap failed: out of memory (a test)")
        real_map_page(addr, page)

    def map_pages(addr: int, pages: list) -> None:
        raise BackendError("mmap failed: out of memory (a test)")

    with monkeypatch.context() as patch:
        patch.setattr(pool.backend, "map_page", map_page)
        patch.setattr(pool.backend, "map_pages", map_pages)
        refuse_unmaps_of(pool, patch, None)
        with pytest.raises(BackendError, match="mmap failed"):
            pool.alloc(2 * BLOCKS_PER_PAGE)
    (lp,) = pool.core.segments.stuck
    return lp, pool.core.segments.bases[0] + lp * PAGE_BYTES


def test_a_stuck_page_stays_the_pools_until_a_sleep_can_unmap_it_and_gives_it_back(
    kvd: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = kvd.client()
    pool = client.register("a", SPEC, num_prefetch_pages=0, num_spare_pages=8)
    pool.quiesce_hook = lambda: None
    first = pool.alloc(1)  # logical page 0
    lp, slot = stick_a_page(pool, monkeypatch)
    assert pool.backend.is_mapped(slot) and lp not in pool.core.segments.pages
    # the other granted page went back; the stuck one is still this tenant's on both sides
    assert mapped_bytes(client) == pool.mapped_bytes == 2 * LOGICAL
    refuse_unmaps_of(pool, monkeypatch, slot)
    blocks = pool.alloc(2 * BLOCKS_PER_PAGE)  # a grow asks for other pages than the stuck one
    assert lp not in pool.core.segments.pages and mapped_bytes(client) == 4 * LOGICAL
    pool.key_cache(0)[blocks] = 3.0
    with pytest.raises(Conflict):  # a sleep would let the daemon free a page this process maps
        client.sleep("a", "warm", timeout_s=5)
    assert pool.state is PoolState.ACTIVE and pool.core.segments.stuck.keys() == {lp}
    monkeypatch.undo()
    client.sleep("a", "warm", timeout_s=5)  # unmapped now: released and given back first
    assert pool.core.segments.stuck == {} and not pool.backend.is_mapped(slot)
    pool.wake()
    assert bool((pool.key_cache(0)[blocks] == 3.0).all())
    assert mapped_bytes(client) == pool.mapped_bytes == 3 * LOGICAL  # page 0 and the two with blocks
    pool.free(first + blocks)
    kvd.check_invariants()
    pool.close()


def test_a_pool_closes_with_a_page_it_cannot_unmap(
    kvd: RunningDaemon, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    client = kvd.client()
    pool = client.register("a", SPEC, num_prefetch_pages=0, num_spare_pages=8)
    pool.alloc(1)
    lp, slot = stick_a_page(pool, monkeypatch)
    refuse_unmaps_of(pool, monkeypatch, slot)
    with caplog.at_level(logging.ERROR, logger="kvdaemon.client.pool"):
        pool.close()  # the rest goes; the stuck page's range stays reserved, logged
    assert pool.state is PoolState.CLOSED and pool.backend.is_mapped(slot)
    assert "could not be unmapped" in caplog.text
    assert "a" not in {t["name"] for t in client.status()["tenants"]}
    kvd.check_invariants()
