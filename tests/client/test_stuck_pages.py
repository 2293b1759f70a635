"""A map the OS refuses whose rollback it refuses too: the pages some slot still maps stay the
pool's (``SegmentMap.stuck``), never given back to be granted again, until they can be unmapped;
meanwhile the pool maps nothing more and refuses to sleep, and a close leaves its pages held."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from kvdaemon.client import KVClient, KVPool, KVSpec
from kvdaemon.client.pool_state import PoolState
from kvdaemon.errors import BackendError, Conflict, PoolExhausted

from tests.conftest import (
    PAGE_BYTES, RunningDaemon, running_daemon, short_dir, start_daemon, tenant_rows, wait_until,
)

SPEC = KVSpec(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)
BLOCKS_PER_PAGE = PAGE_BYTES // SPEC.block_bytes
LOGICAL = SPEC.num_segments * PAGE_BYTES
CAPACITY = 64 << 20


@pytest.fixture
def kvd() -> Iterator[RunningDaemon]:
    with running_daemon(f"{CAPACITY}B") as running:
        yield running


def register(client: KVClient) -> KVPool:
    """Tenant ``a``: no pages mapped ahead, spare ones kept (the agent returns none meanwhile)."""
    return client.register("a", SPEC, num_prefetch_pages=0, num_spare_pages=8)


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
    refused meanwhile: the first page ends stuck, the second goes back unmapped (an engine sees
    ``PoolExhausted``). Returns the stuck page and its slot in segment 0."""
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
        with pytest.raises(PoolExhausted, match="mmap failed"):
            pool.alloc(2 * BLOCKS_PER_PAGE)
    (lp,) = pool.core.segments.stuck
    return lp, pool.core.segments.bases[0] + lp * PAGE_BYTES


def test_a_stuck_page_stays_the_pools_and_stops_its_grows_and_sleeps_until_it_can_be_unmapped(
    kvd: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = kvd.client()
    pool = register(client)
    pool.quiesce_hook = lambda: None
    first = pool.alloc(1)  # logical page 0
    lp, slot = stick_a_page(pool, monkeypatch)
    assert pool.backend.is_mapped(slot) and lp not in pool.core.segments.pages
    # the other granted page went back; the stuck one is still this tenant's on both sides
    assert mapped_bytes(client) == pool.mapped_bytes == 2 * LOGICAL
    refuse_unmaps_of(pool, monkeypatch, slot)
    with pytest.raises(PoolExhausted, match="failed map left mapped cannot be unmapped"):
        pool.alloc(2 * BLOCKS_PER_PAGE)  # no more pages while one is stuck: the fault would pile them up
    with pytest.raises(Conflict, match="refused to sleep: 1 page"):  # the daemon would free a page mapped here
        client.sleep("a", "warm", timeout_s=5)
    assert pool.state is PoolState.ACTIVE and pool.core.segments.stuck.keys() == {lp}
    assert mapped_bytes(client) == 2 * LOGICAL
    monkeypatch.undo()
    blocks = pool.alloc(2 * BLOCKS_PER_PAGE)  # unmapped now: released and given back, then the grow
    assert pool.core.segments.stuck == {} and pool.backend.is_mapped(slot) == (lp in pool.core.segments.pages)
    pool.key_cache(0)[blocks] = 3.0
    client.sleep("a", "warm", timeout_s=5)
    pool.wake()
    assert bool((pool.key_cache(0)[blocks] == 3.0).all())
    assert mapped_bytes(client) == pool.mapped_bytes == 3 * LOGICAL  # page 0 and the two with blocks
    pool.free(first + blocks)
    kvd.check_invariants()
    pool.close()


def test_a_stuck_page_counts_against_the_limit_on_the_fast_path(
    kvd: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = kvd.client()
    pool = register(client)
    pool.alloc(1)
    stick_a_page(pool, monkeypatch)
    client.set_limit("a", max_bytes=LOGICAL)  # one logical page: the stuck one puts the pool over it
    assert pool.core.pages_over_limit() == 1 and pool.core.max_pages == 0
    with pytest.raises(PoolExhausted, match="past its limit"):
        pool.alloc(1)  # page 0's free blocks stay free, to empty and go back
    monkeypatch.undo()
    pool.close()


def test_a_pool_closes_with_a_page_it_cannot_unmap(
    kvd: RunningDaemon, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    client = kvd.client()
    pool = register(client)
    pool.alloc(1)
    lp, slot = stick_a_page(pool, monkeypatch)
    refuse_unmaps_of(pool, monkeypatch, slot)
    with caplog.at_level(logging.ERROR, logger="kvdaemon.client.pool"):
        pool.close()  # the rest goes; the stuck page's range stays reserved, logged
    assert pool.state is PoolState.CLOSED and pool.backend.is_mapped(slot)
    assert "could not be unmapped" in caplog.text and "closes without unregistering" in caplog.text
    wait_until(lambda: "a" not in {t["name"] for t in client.status()["tenants"]}, 5, "a was not removed")
    status = client.status()  # page 0 given back; the stuck page held while this process lives
    assert status["quarantined_bytes"] == LOGICAL and status["free_bytes"] == CAPACITY - LOGICAL
    kvd.check_invariants()
    with caplog.at_level(logging.ERROR, logger="kvdaemon.cuda_vmm"):
        client.close()  # its backend unmaps what it can and keeps the rest reserved, raising nothing
    assert "stays reserved" in caplog.text


@contextmanager
def moved_with_a_stuck_page(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[KVClient, KVPool, list[int], int]]:
    """A pool with a block on page 0 and a stuck page (its unmap refused still), whose daemon was
    SIGKILLed and replaced: it moved to the new one. Yields the client, the pool, the block, the
    stuck page."""
    root = short_dir()
    daemons = [start_daemon(root)]
    client = KVClient(root)
    try:
        pool = register(client)
        blocks = pool.alloc(1)
        pool.key_cache(0)[blocks] = 4.0
        lp, slot = stick_a_page(pool, monkeypatch)
        refuse_unmaps_of(pool, monkeypatch, slot)
        os.kill(daemons[0].pid, signal.SIGKILL)
        daemons[0].wait(10)
        wait_until(lambda: pool.lease.lost.is_set(), 5, "lease not lost")
        daemons.append(start_daemon(root))
        wait_until(lambda: not pool.lease.lost.is_set(), 15, "the pool never joined the new daemon")
        yield client, pool, blocks, lp
    finally:
        for proc in daemons:
            if proc.poll() is None:
                proc.kill()
        client.close()
        shutil.rmtree(root, ignore_errors=True)


def test_stuck_pages_of_a_dead_daemon_are_never_counted_nor_given_back_to_the_next(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with moved_with_a_stuck_page(monkeypatch) as (client, pool, blocks, lp):
        rows = tenant_rows(client)
        assert rows is not None and rows["a"]["mapped_bytes"] == pool.mapped_bytes == LOGICAL  # page 0 moved
        assert pool.core.old_stuck == {lp} and bool((pool.key_cache(0)[blocks] == 4.0).all())
        monkeypatch.undo()
        with caplog.at_level(logging.INFO, logger="kvdaemon.client.pool"):
            more = pool.alloc(2 * BLOCKS_PER_PAGE)  # the stuck page unmaps, released here, not given back
        assert pool.core.segments.stuck == {} and pool.core.old_stuck == set()
        assert "already given back" not in caplog.text
        rows = tenant_rows(client)
        assert rows is not None and rows["a"]["mapped_bytes"] == pool.mapped_bytes == 3 * LOGICAL
        pool.free(blocks + more)
        pool.close()


def test_a_pool_stuck_only_with_a_dead_daemons_page_sleeps_and_wakes(monkeypatch: pytest.MonkeyPatch) -> None:
    with moved_with_a_stuck_page(monkeypatch) as (client, pool, blocks, lp):
        pool.quiesce_hook = lambda: None
        client.sleep("a", "warm", timeout_s=5)  # the new daemon frees none of the pages mapped here
        pool.wake()
        assert bool((pool.key_cache(0)[blocks] == 4.0).all()) and pool.core.old_stuck == {lp}
        monkeypatch.undo()
        pool.close()


def test_a_pool_stuck_only_with_a_dead_daemons_page_closes_by_unregistering(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with moved_with_a_stuck_page(monkeypatch) as (client, pool, _, lp):
        pool.close()  # the new daemon never granted the stuck page: it frees the pool's pages at once
        assert pool.core.segments.stuck.keys() == {lp}
        status = client.status()
        assert status["tenants"] == [] and status["quarantined_bytes"] == 0
        monkeypatch.undo()


def test_an_idle_pool_that_refuses_to_sleep_says_why_and_is_not_asked_again_at_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with running_daemon(f"{CAPACITY}B", idle_sleep_s=0.5) as kvd:
        client = kvd.client()
        pool = register(client)
        pool.quiesce_hook = lambda: None
        pool.alloc(1)
        with caplog.at_level(logging.WARNING, logger="kvdaemon.sleep"):
            _, slot = stick_a_page(pool, monkeypatch)
            refuse_unmaps_of(pool, monkeypatch, slot)
            wait_until(lambda: "refused to sleep" in caplog.text, 10, "the idle policy never asked")
            time.sleep(3)  # six idle periods: asked once, not again within SLEEP_REFUSED_S
        refusals = [r.getMessage() for r in caplog.records if "refused to sleep" in r.getMessage()]
        assert len(refusals) == 1 and "1 page(s) a failed map left mapped" in refusals[0], refusals
        row = next(t for t in client.status()["tenants"] if t["name"] == "a")
        assert row["state"] == "active" and row["sleepable"], "a reason of its own is not a missing quiesce hook"
        monkeypatch.undo()
        pool.close()


def test_a_pool_whose_pages_the_os_will_not_unmap_at_its_close_ends_its_lease_and_leaves_them_held(
    kvd: RunningDaemon, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    client = kvd.client()
    pool = register(client)
    pool.alloc(2 * BLOCKS_PER_PAGE)  # two logical pages
    refuse_unmaps_of(pool, monkeypatch, None)
    with caplog.at_level(logging.ERROR, logger="kvdaemon.client.pool"):
        pool.close()  # raises nothing; not an unregister, which would free pages mapped here
    assert "could not all be unmapped" in caplog.text and "2 logical page(s) stay mapped" in caplog.text
    assert pool.state is PoolState.CLOSED and pool.core.lease.lost.is_set()
    wait_until(lambda: "a" not in {t["name"] for t in client.status()["tenants"]}, 5, "its lease never ended")
    assert client.status()["quarantined_bytes"] == 2 * LOGICAL
    kvd.check_invariants()
    monkeypatch.undo()


def test_a_sleep_refused_for_a_reason_gone_since_does_not_keep_a_reclaim_from_sleeping_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The idle policy waits after a refusal; a reclaim, memory wanted now, asks again."""
    with running_daemon(f"{CAPACITY}B", reclaim_escalate_s=0.05, reclaim_wait_s=5.0, victim_idle_s=0.0) as kvd:
        client = kvd.client()
        idle = client.register("idle", SPEC, num_spare_pages=0, num_prefetch_pages=0)
        idle.quiesce_hook = lambda: None
        wait_until(lambda: tenant_rows(client)["idle"]["sleepable"], 5, "never sleepable")  # type: ignore[index]
        idle.alloc(12 * BLOCKS_PER_PAGE)  # 48 of the 64 MiB
        refuse_unmaps_of(idle, monkeypatch, None)
        with pytest.raises(Conflict, match="refused to sleep: its pages could not be unmapped"):
            client.sleep("idle", "warm", timeout_s=5)
        monkeypatch.undo()  # the reason is gone
        busy = client.register("busy", SPEC, num_spare_pages=0, num_prefetch_pages=0)
        busy.alloc(6 * BLOCKS_PER_PAGE)  # 24 MiB: only by sleeping idle
        assert tenant_rows(client)["idle"]["state"] == "sleeping-warm"  # type: ignore[index]
        busy.close()
        idle.close()
