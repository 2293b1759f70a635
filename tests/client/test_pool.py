"""KVPool against a real daemon: views, on-demand pages, spare bounds, reclaim."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import random
import resource
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvdaemon.client import KVClient, KVPool, KVSpec, Lease, PoolExhausted, pool_agent
from kvdaemon.client.block_manager import BlockManager
from kvdaemon.errors import Asleep, BackendError, BadRequest
from kvdaemon.wire.messages import LimitNotice, Notice

from tests.conftest import PAGE_BYTES, RunningDaemon, running_daemon, wait_until

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)
BLOCKS_PER_PAGE = PAGE_BYTES // SPEC.block_bytes  # 512
LOGICAL_PAGE_BYTES = SPEC.num_segments * PAGE_BYTES  # 8 MiB
MiB = 1 << 20


@pytest.fixture
def kvd() -> Iterator[RunningDaemon]:
    with running_daemon("64MiB") as running:  # 8 logical pages of SPEC
        yield running


def register(kvd: RunningDaemon, name: str = "a", **kwargs: object) -> tuple[KVClient, KVPool]:
    client = kvd.client()
    return client, client.register(name, SPEC, **kwargs)


def tenant_row(client: KVClient, name: str) -> dict:
    return next(t for t in client.status()["tenants"] if t["name"] == name)


def wait_mapped(client: KVClient, name: str, num_bytes: int) -> None:
    """Wait until the daemon counts ``num_bytes`` mapped by ``name`` (returns run on the agent)."""
    wait_until(lambda: tenant_row(client, name)["mapped_bytes"] == num_bytes, 5, f"{name} never held {num_bytes}")


def test_views_have_the_public_shape(kvd: RunningDaemon) -> None:
    client, pool = register(kvd)
    assert pool.num_blocks == 8 * BLOCKS_PER_PAGE
    for layer in range(SPEC.num_layers):
        for cache in (pool.key_cache(layer), pool.value_cache(layer)):
            assert cache.shape == (pool.num_blocks, 16, 2, 64) and cache.dtype == torch.float16
    assert tenant_row(client, "a")["mapped_bytes"] == 0, "nothing is mapped before alloc"
    pool.close()


def test_alloc_maps_pages_on_demand_and_writes_land(kvd: RunningDaemon) -> None:
    client, pool = register(kvd, num_prefetch_pages=0)
    blocks = pool.alloc(BLOCKS_PER_PAGE + 1)  # needs two logical pages
    assert tenant_row(client, "a")["mapped_bytes"] == 2 * LOGICAL_PAGE_BYTES
    for layer in range(SPEC.num_layers):
        pool.key_cache(layer)[blocks] = layer + 1
        pool.value_cache(layer)[blocks] = -(layer + 1)
    assert float(pool.key_cache(1)[blocks[-1]].mean()) == 2.0
    assert float(pool.value_cache(0)[blocks[0]].mean()) == -1.0
    kvd.check_invariants()
    pool.close()


def test_prefetch_and_spare_bounds(kvd: RunningDaemon) -> None:
    client, pool = register(kvd, num_spare_pages=1, num_prefetch_pages=1)
    blocks = pool.alloc(1)
    assert tenant_row(client, "a")["mapped_bytes"] == 2 * LOGICAL_PAGE_BYTES  # one + prefetch
    more = pool.alloc(3 * BLOCKS_PER_PAGE)
    pool.free(more)
    # only one spare page may stay mapped besides the page holding `blocks`
    wait_mapped(client, "a", 2 * LOGICAL_PAGE_BYTES)
    pool.free(blocks)
    # logical page 0 stays mapped for the pool's life, and counts as the spare page
    wait_mapped(client, "a", LOGICAL_PAGE_BYTES)
    kvd.check_invariants()
    pool.close()


def test_exhaustion_leaves_nothing_behind(kvd: RunningDaemon) -> None:
    client, pool = register(kvd, max_bytes=3 * LOGICAL_PAGE_BYTES, num_prefetch_pages=1)
    held = pool.alloc(2 * BLOCKS_PER_PAGE)
    before = tenant_row(client, "a")["mapped_bytes"]
    with pytest.raises(PoolExhausted, match="limit"):
        pool.alloc(2 * BLOCKS_PER_PAGE)  # over the 3-page limit: refused without asking
    assert pool.num_used_blocks == len(held)
    assert tenant_row(client, "a")["mapped_bytes"] == before
    with pytest.raises(PoolExhausted, match="virtual capacity"):
        pool.alloc(pool.num_blocks + 1)
    last = pool.alloc(BLOCKS_PER_PAGE)  # exactly the limit: works
    assert len(last) == BLOCKS_PER_PAGE
    kvd.check_invariants()
    pool.close()


def test_no_memory_from_the_daemon_is_pool_exhausted(kvd: RunningDaemon) -> None:
    # the hog's guarantee covers what it holds: nothing can be reclaimed from it
    _, hog = register(kvd, "hog", num_prefetch_pages=0, min_bytes=7 * LOGICAL_PAGE_BYTES)
    hog.alloc(7 * BLOCKS_PER_PAGE)
    client, pool = register(kvd, "b", num_prefetch_pages=0)
    pool.alloc(BLOCKS_PER_PAGE)  # the last free logical page
    with pytest.raises(PoolExhausted):
        pool.alloc(BLOCKS_PER_PAGE)
    assert tenant_row(client, "b")["mapped_bytes"] == LOGICAL_PAGE_BYTES
    hog.close()
    pool.close()


def test_double_free_and_unknown_ids(kvd: RunningDaemon) -> None:
    _, pool = register(kvd)
    blocks = pool.alloc(4)
    pool.free(blocks[:1])
    with pytest.raises(BadRequest, match=f"block {blocks[0]} is not allocated .freed already"):
        pool.free(blocks[:1])
    with pytest.raises(BadRequest, match=f"block {pool.num_blocks} is not allocated"):
        pool.free([pool.num_blocks])
    with pytest.raises(BadRequest, match="'x' is not a block id"):
        pool.free(["x"])
    assert pool.num_used_blocks == 3
    pool.close()


def test_returned_page_comes_back_zeroed(kvd: RunningDaemon) -> None:
    client, pool = register(kvd, num_spare_pages=0, num_prefetch_pages=0)
    first = pool.alloc(1)  # logical page 0, which stays mapped
    blocks = pool.alloc(BLOCKS_PER_PAGE)  # the rest of page 0 and one block of page 1
    pool.key_cache(0)[blocks] = 7
    pool.free(blocks)  # page 1 is now spare past the bound: returned
    wait_mapped(client, "a", LOGICAL_PAGE_BYTES)
    regranted = pool.alloc(BLOCKS_PER_PAGE)
    assert not set(regranted) & set(first)
    # the daemon released the page (its memory punched out): no stale bytes
    assert float(pool.key_cache(0)[regranted].abs().sum()) == 0.0
    pool.close()


def test_random_alloc_free_touches_only_mapped_blocks(kvd: RunningDaemon) -> None:
    rng = random.Random(7)
    client, pool = register(kvd, num_spare_pages=1)
    live: list[int] = []
    for step in range(200):
        if live and rng.random() < 0.45:
            rng.shuffle(live)
            cut = rng.randrange(1, len(live) + 1)
            pool.free(live[:cut])
            live = live[cut:]
        else:
            try:
                got = pool.alloc(rng.randrange(1, 600))
            except PoolExhausted:
                continue
            pool.key_cache(step % 2)[got] = 1  # would SIGSEGV over an unmapped page
            live += got
        kvd.check_invariants()
        with pool.core.lock:  # the agent returns pages under this lock: both sides agree here
            pool.core.allocator.check()
            assert tenant_row(client, "a")["mapped_bytes"] == pool.mapped_bytes
    pool.close()
    assert client.status()["free_bytes"] == 64 * 1024 * 1024


def test_lowered_limit_makes_an_idle_pool_return_spare_pages(kvd: RunningDaemon) -> None:
    client, pool = register(kvd, num_spare_pages=8, num_prefetch_pages=0)
    blocks = pool.alloc(4 * BLOCKS_PER_PAGE)
    pool.free(blocks[BLOCKS_PER_PAGE:])  # one page in use, three spare
    assert tenant_row(client, "a")["mapped_bytes"] == 4 * LOGICAL_PAGE_BYTES
    client.set_limit("a", max_bytes=2 * LOGICAL_PAGE_BYTES)
    wait_mapped(client, "a", 2 * LOGICAL_PAGE_BYTES)
    time.sleep(0.3)  # the debt is paid once: no second ask takes a page the limit allows
    assert tenant_row(client, "a")["mapped_bytes"] == 2 * LOGICAL_PAGE_BYTES
    assert pool.num_used_blocks == BLOCKS_PER_PAGE
    assert pool.max_bytes == 2 * LOGICAL_PAGE_BYTES  # the pool was told its new limit
    kvd.check_invariants()
    pool.close()


def test_used_bytes_reach_status(kvd: RunningDaemon) -> None:
    client, pool = register(kvd)
    pool.alloc(10)
    wait_until(lambda: tenant_row(client, "a")["used_bytes"] == 10 * SPEC.block_bytes * SPEC.num_segments)
    pool.close()


def test_copy_blocks_copies_every_layer(kvd: RunningDaemon) -> None:
    _, pool = register(kvd)
    src, dst = pool.alloc(2), pool.alloc(2)
    for layer in range(SPEC.num_layers):
        pool.key_cache(layer)[src] = torch.randn(2, 16, 2, 64).half()
        pool.value_cache(layer)[src] = torch.randn(2, 16, 2, 64).half()
    pool.copy_blocks(src, dst)
    for layer in range(SPEC.num_layers):
        assert torch.equal(pool.key_cache(layer)[dst], pool.key_cache(layer)[src])
        assert torch.equal(pool.value_cache(layer)[dst], pool.value_cache(layer)[src])
    pool.close()


def test_close_returns_everything(kvd: RunningDaemon) -> None:
    client, pool = register(kvd)
    pool.alloc(3 * BLOCKS_PER_PAGE)
    pool.close()
    status = client.status()
    assert status["tenants"] == [] and status["free_bytes"] == status["capacity_bytes"]


@pytest.mark.parametrize("count", [-1, 1.5, "3", True])
def test_bad_counts_are_refused(kvd: RunningDaemon, count: object) -> None:
    _, pool = register(kvd)
    with pytest.raises(BadRequest, match="cannot allocate"):
        pool.alloc(count)  # type: ignore[arg-type]
    assert pool.num_used_blocks == 0
    assert pool.alloc(0) == []
    pool.close()


def test_a_lowered_limit_takes_busy_pages_as_their_blocks_are_freed(kvd: RunningDaemon) -> None:
    client, pool = register(kvd, num_spare_pages=8, num_prefetch_pages=0)
    blocks = pool.alloc(4 * BLOCKS_PER_PAGE)  # four pages, all in use: nothing spare
    client.set_limit("a", max_bytes=2 * LOGICAL_PAGE_BYTES)
    wait_until(lambda: pool.core.owed_pages == 2, 5, "the limit notice was not answered")
    assert tenant_row(client, "a")["mapped_bytes"] == 4 * LOGICAL_PAGE_BYTES  # live blocks stay
    pool.free(blocks[3 * BLOCKS_PER_PAGE :])  # one page empties: it goes back despite the spare bound
    wait_mapped(client, "a", 3 * LOGICAL_PAGE_BYTES)
    pool.free(blocks[2 * BLOCKS_PER_PAGE : 3 * BLOCKS_PER_PAGE])
    wait_mapped(client, "a", 2 * LOGICAL_PAGE_BYTES)
    pool.free(blocks[: 2 * BLOCKS_PER_PAGE])  # within the limit again: spare pages may stay
    pool.agent.nudge()
    wait_until(lambda: not pool.core.has_excess())
    assert tenant_row(client, "a")["mapped_bytes"] == 2 * LOGICAL_PAGE_BYTES
    kvd.check_invariants()
    pool.close()


def test_a_pool_past_a_lowered_limit_allocates_only_past_the_owed_pages_blocks(kvd: RunningDaemon) -> None:
    client, pool = register(kvd, num_spare_pages=8, num_prefetch_pages=0)
    blocks = pool.alloc(4 * BLOCKS_PER_PAGE)  # four pages, all in use
    half = BLOCKS_PER_PAGE // 2
    pool.free([b for page in range(3) for b in blocks[page * BLOCKS_PER_PAGE:][:half]])  # three half-empty
    client.set_limit("a", max_bytes=2 * LOGICAL_PAGE_BYTES)
    wait_until(lambda: pool.core.owed_pages == 2, 5, "the limit notice was not answered")
    assert pool.num_free_blocks == 3 * half  # scattered over three pages: none can go back yet
    with pytest.raises(PoolExhausted, match=r"maps 2 logical page\(s\) past its limit .* so 0 of its"):
        pool.alloc(1)  # the owed pages' worth of blocks stays free, or they would never empty
    assert pool.num_free_blocks == 3 * half, "a refused alloc took blocks"
    live = [b for b in blocks if b not in set(blocks[:half]) | set(blocks[BLOCKS_PER_PAGE:][:half])
            | set(blocks[2 * BLOCKS_PER_PAGE:][:half])]
    pool.free(live[:-BLOCKS_PER_PAGE])  # all but the last page's blocks: the limit holds them
    wait_mapped(client, "a", 2 * LOGICAL_PAGE_BYTES)
    assert pool.owed_pages == 0
    assert len(pool.alloc(BLOCKS_PER_PAGE)) == BLOCKS_PER_PAGE  # within the limit: the free blocks serve again
    kvd.check_invariants()
    pool.close()


def test_a_raised_limit_ends_a_lowered_ones_debt_at_once(kvd: RunningDaemon) -> None:
    client, pool = register(kvd, num_spare_pages=8, num_prefetch_pages=0)
    blocks = pool.alloc(4 * BLOCKS_PER_PAGE)  # four pages, all in use
    client.set_limit("a", max_bytes=2 * LOGICAL_PAGE_BYTES)
    wait_until(lambda: pool.core.owed_pages == 2, 5, "the limit notice was not answered")
    client.set_limit("a", max_bytes=8 * LOGICAL_PAGE_BYTES)
    wait_until(lambda: pool.max_bytes == 8 * LOGICAL_PAGE_BYTES, 5, "the raised limit was not told")
    assert pool.owed_pages == 0, "a raised limit left the lowered one's debt"
    pool.free(blocks[3 * BLOCKS_PER_PAGE :])  # a page empties: the spare allowance keeps it
    pool.agent.nudge()
    time.sleep(0.3)
    assert tenant_row(client, "a")["mapped_bytes"] == 4 * LOGICAL_PAGE_BYTES
    kvd.check_invariants()
    pool.close()


def test_a_raised_limit_holds_for_the_next_alloc_when_the_agent_is_slow(
    kvd: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, pool = register(kvd, num_spare_pages=0, num_prefetch_pages=0)
    client.set_limit("a", max_bytes=2 * LOGICAL_PAGE_BYTES)
    pool.alloc(2 * BLOCKS_PER_PAGE)  # at its limit
    held = threading.Event()
    handle = pool.agent._handle
    monkeypatch.setattr(pool.agent, "_handle", lambda notice: held.wait(5) and handle(notice))
    client.set_limit("a", max_bytes=4 * LOGICAL_PAGE_BYTES)  # its notice waits in the agent
    assert pool.max_bytes == 4 * LOGICAL_PAGE_BYTES
    blocks = pool.alloc(BLOCKS_PER_PAGE)  # past the old limit, within the new one
    assert tenant_row(client, "a")["mapped_bytes"] == 3 * LOGICAL_PAGE_BYTES
    client.set_limit("a", max_bytes=2 * LOGICAL_PAGE_BYTES)  # lowered again before the first notice is handled
    held.set()
    time.sleep(0.3)  # both notices handled: the stale first one changed nothing
    assert pool.max_bytes == 2 * LOGICAL_PAGE_BYTES
    pool.free(blocks)
    wait_mapped(client, "a", 2 * LOGICAL_PAGE_BYTES)  # the lowered limit's excess went back
    kvd.check_invariants()
    pool.close()


def test_limits_older_than_the_known_ones_are_ignored(kvd: RunningDaemon) -> None:
    _, pool = register(kvd)
    core = pool.core
    with core.lock:
        assert core.set_limit({"max_bytes": 5, "revision": core.limit_revision + 2})
        assert not core.set_limit({"max_bytes": 3, "revision": core.limit_revision - 1})
        assert core.max_bytes == 5
        assert core.set_limit({"max_bytes": 4, "revision": 1}, fresh=True)  # a new daemon counts again
        assert (core.max_bytes, core.limit_revision) == (4, 1)
    pool.close()


def test_a_lease_keeps_the_notices_read_before_anyone_listens(kvd: RunningDaemon) -> None:
    client = kvd.client()
    lease = client.lease("bare", SPEC, num_virtual_pages=8)
    client.set_limit("bare", max_bytes=3 * LOGICAL_PAGE_BYTES)
    client.set_limit("bare", max_bytes=2 * LOGICAL_PAGE_BYTES)
    wait_until(lambda: len(lease._early) == 2, 5, "the notices never came")
    heard: list[Notice] = []
    lease.on_notice = heard.append  # the first listener hears them, in order (not on this thread)
    wait_until(lambda: len(heard) == 2, 5, "the early notices were not handed over")
    assert [(n.max_bytes, n.revision) for n in heard if isinstance(n, LimitNotice)] == [
        (3 * LOGICAL_PAGE_BYTES, 1), (2 * LOGICAL_PAGE_BYTES, 2)]
    client.set_limit("bare", max_bytes=LOGICAL_PAGE_BYTES)
    wait_until(lambda: len(heard) == 3, 5, "a notice after it did not reach the listener")
    assert not lease._early
    lease.close()


def test_a_lease_handler_may_unset_itself_and_one_that_raises_ends_nothing(kvd: RunningDaemon) -> None:
    client = kvd.client()
    lease = client.lease("bare", SPEC, num_virtual_pages=8)
    heard: list[int] = []

    def once(notice: Notice) -> None:  # a one-shot handler (run with no lock of the lease held)
        heard.append(notice.revision)  # type: ignore[attr-defined]
        lease.on_notice = None

    lease.on_notice = once
    client.set_limit("bare", max_bytes=3 * LOGICAL_PAGE_BYTES)
    wait_until(lambda: heard == [1], 5, "the one-shot handler never ran")
    mine = threading.Lock()

    def locking(notice: Notice) -> None:  # set under a lock it takes itself: it runs on no caller's thread
        with mine:
            heard.append(notice.revision)  # type: ignore[attr-defined]

    with mine:
        client.set_limit("bare", max_bytes=5 * LOGICAL_PAGE_BYTES)  # read with no handler set: kept
        wait_until(lambda: lease._early, 5, "the notice never came")
        lease.on_notice = locking
    wait_until(lambda: heard == [1, 2], 5, "the early notice was not handed over")

    def broken(notice: Notice) -> None:
        raise RuntimeError("a user's bug")

    lease.on_notice = broken
    client.set_limit("bare", max_bytes=2 * LOGICAL_PAGE_BYTES)  # logged; the reader goes on
    client.set_limit("bare", max_bytes=LOGICAL_PAGE_BYTES)
    time.sleep(0.2)
    lease.on_notice = lambda notice: heard.append(notice.revision)  # type: ignore[attr-defined]
    client.set_limit("bare", max_bytes=4 * LOGICAL_PAGE_BYTES)
    wait_until(lambda: heard == [1, 2, 5], 5, "the reader stopped after a handler raised")
    assert not lease.lost.is_set()
    lease.close()


def test_the_attach_reply_tells_a_limit_set_since_the_registration(kvd: RunningDaemon) -> None:
    client = kvd.client()
    reply = client.call("register", {"name": "late", "spec": SPEC.to_wire(), "num_virtual_pages": 8,
                                     "pid": os.getpid()})  # fmt: skip
    client.set_limit("late", max_bytes=3 * LOGICAL_PAGE_BYTES)  # no lease yet: no notice can reach it
    lease = Lease(client.paths, client.timeout_s, client.backend(), "late", reply)
    assert lease.limit["max_bytes"] != 3 * LOGICAL_PAGE_BYTES
    lease.attach()
    assert (lease.limit["max_bytes"], lease.limit["revision"]) == (3 * LOGICAL_PAGE_BYTES, 1)
    lease.close()


def test_set_limit_on_its_own_pool_does_not_wait_for_a_grow_under_way(kvd: RunningDaemon) -> None:
    client, pool = register(kvd, num_spare_pages=0, num_prefetch_pages=0, grow_wait_s=2.0)
    _, other = register(kvd, "b", num_spare_pages=0, num_prefetch_pages=0)
    held = other.alloc(8 * BLOCKS_PER_PAGE)  # every page: a grow of "a" waits for one to come back
    waiting = concurrent.futures.ThreadPoolExecutor(1)
    try:
        grow = waiting.submit(pool.alloc, BLOCKS_PER_PAGE)
        wait_until(lambda: other.owed_pages > 0, 5, "the grow was not parked (nobody was asked for a page)")
        client.set_limit("a", max_bytes=4 * LOGICAL_PAGE_BYTES)
        assert not grow.done()  # answered while the grow still waits (it held the pool's lock)
        assert pool.max_bytes == 4 * LOGICAL_PAGE_BYTES
        other.free(held[-BLOCKS_PER_PAGE:])  # its last page empties (page 0 always stays)
        assert len(grow.result(10)) == BLOCKS_PER_PAGE
    finally:
        waiting.shutdown()
    other.close()
    pool.close()


def test_a_free_that_empties_an_owed_page_wakes_the_agent_at_once(
    kvd: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, pool = register(kvd, num_spare_pages=8, num_prefetch_pages=0)
    blocks = pool.alloc(4 * BLOCKS_PER_PAGE)
    nudges: list[int] = []
    monkeypatch.setattr(pool.agent, "nudge", lambda: nudges.append(1))
    pool.free(blocks[3 * BLOCKS_PER_PAGE :])  # within its limit: the spare page may stay
    assert not nudges
    client.set_limit("a", max_bytes=2 * LOGICAL_PAGE_BYTES)  # known at once: past it (the agent pays the spare page)
    assert pool.core.pages_over_limit() >= 1
    pool.free(blocks[2 * BLOCKS_PER_PAGE : 3 * BLOCKS_PER_PAGE])
    assert nudges  # the limit's debt: the agent pays now, not at its next tick
    nudges.clear()
    client.set_limit("a", max_bytes=8 * LOGICAL_PAGE_BYTES)
    pool.core.asked_pages = 1  # an urgent reclaim's ask
    pool.free(blocks[BLOCKS_PER_PAGE : 2 * BLOCKS_PER_PAGE])
    assert nudges
    pool.core.asked_pages = 0
    pool.close()


def test_an_idle_engines_cache_pays_a_lowered_limit(kvd: RunningDaemon) -> None:
    client, pool = register(kvd, num_spare_pages=8, num_prefetch_pages=0)
    manager = BlockManager(pool, enable_prefix_cache=True)
    manager.serve_reclaim_for(pool)
    size = SPEC.block_size
    for seq in range(3):  # 3 x 400 full blocks over three pages, then all cached, none in use
        manager.add_sequence(seq, [seq + 1] * (400 * size) + [0])
    for seq in range(3):
        manager.free_sequence(seq)
    assert tenant_row(client, "a")["mapped_bytes"] == 3 * LOGICAL_PAGE_BYTES
    assert manager.cache.num_evictable > 2 * BLOCKS_PER_PAGE
    client.set_limit("a", max_bytes=LOGICAL_PAGE_BYTES)
    wait_mapped(client, "a", LOGICAL_PAGE_BYTES)  # what the cache held went: an idle engine frees nothing
    assert pool.core.pages_over_limit() == 0
    wait_until(lambda: pool.core.owed_pages == 0, 5, "a repeated ask's debt outlived OWED_S")  # nothing past the limit
    assert tenant_row(client, "a")["mapped_bytes"] == LOGICAL_PAGE_BYTES  # logical page 0 stays
    kvd.check_invariants()
    pool.close()


def test_a_lowered_limits_debt_outlives_owed_s(kvd: RunningDaemon, monkeypatch: pytest.MonkeyPatch) -> None:
    client, pool = register(kvd, num_spare_pages=8, num_prefetch_pages=0)
    blocks = pool.alloc(4 * BLOCKS_PER_PAGE)
    client.set_limit("a", max_bytes=2 * LOGICAL_PAGE_BYTES)
    wait_until(lambda: pool.core.owed_pages == 2, 5, "the limit notice was not answered")
    monkeypatch.setattr(pool_agent, "OWED_S", 0.0)  # every wake-up from now on lapses what it may
    checks = []
    housekeep = pool.agent._housekeep
    pool.agent._housekeep = lambda: housekeep() or checks.append(pool.core.owed_pages)  # type: ignore[method-assign]
    pool.agent.nudge()
    wait_until(lambda: checks, 5, "the agent never woke")
    assert pool.core.owed_pages == 2, "the pages past the limit stopped being owed"
    pool.free(blocks[3 * BLOCKS_PER_PAGE :])  # the debt still takes the pages as they empty
    wait_mapped(client, "a", 3 * LOGICAL_PAGE_BYTES)
    pool.free(blocks[2 * BLOCKS_PER_PAGE : 3 * BLOCKS_PER_PAGE])
    wait_mapped(client, "a", 2 * LOGICAL_PAGE_BYTES)
    pool.free(blocks[: 2 * BLOCKS_PER_PAGE])
    pool.close()


def test_copy_blocks_refuses_blocks_that_are_not_live(kvd: RunningDaemon) -> None:
    _, pool = register(kvd, num_prefetch_pages=0)
    live = pool.alloc(2)
    for src, dst in (([live[0]], [pool.num_blocks - 1]), ([10**7], [live[1]]), ([live[0]], [-1])):
        with pytest.raises(BadRequest, match="not a live block"):
            pool.copy_blocks(src, dst)  # an unmapped page would fault; a bad id is no IndexError
    pool.copy_blocks([live[0]], [live[1]])
    pool.close()


def test_copy_blocks_and_free_refuse_what_is_not_a_list_of_ids(kvd: RunningDaemon) -> None:
    _, pool = register(kvd, num_prefetch_pages=0)
    live = pool.alloc(2)
    pool.key_cache(0)[live[1]].fill_(2)
    for src, dst, name in ((live[0], live[1], "src"), ([live[0]], live[1], "dst"), (None, [live[1]], "src")):
        with pytest.raises(BadRequest, match=f"copy_blocks: {name} must be a list of block ids, got "):
            pool.copy_blocks(src, dst)  # type: ignore[arg-type]
    assert pool.key_cache(0)[live[1]].eq(2).all(), "a refused copy copied"
    for bad, hint in ((live[0], "int"), (None, "NoneType"), (np.array(live), r"ndarray \(pass \.tolist\(\)\)"),
                      (torch.tensor(live), r"Tensor \(pass \.tolist\(\)\)"), ({live[0]}, "set")):
        with pytest.raises(BadRequest, match=f"free\\(\\) takes a list of block ids, got {hint}"):
            pool.free(bad)  # type: ignore[arg-type]
    assert pool.num_used_blocks == 2, "a refused free freed"
    pool.free(tuple(live))  # a tuple is a list of ids too
    assert pool.num_used_blocks == 0
    pool.close()


def test_copy_blocks_while_asleep_says_so_or_wakes_with_auto_wake(kvd: RunningDaemon) -> None:
    client = kvd.client()
    for auto_wake in (False, True):
        pool = client.register(f"s{int(auto_wake)}", SPEC, num_prefetch_pages=0, auto_wake=auto_wake)
        live = pool.alloc(2)
        pool.key_cache(1)[live[0]].fill_(3)
        client.sleep(pool.name, "warm")
        with pytest.raises(BadRequest, match="1 sources for 2 destinations"):
            pool.copy_blocks([live[0]], live)  # refused before any wake: the pool sleeps on
        assert pool.state.value == "asleep-warm"
        if not auto_wake:
            with pytest.raises(Asleep, match="copy_blocks: pool 's0' is asleep-warm; wake it first"):
                pool.copy_blocks([live[0]], [live[1]])
            pool.wake()
            assert not pool.key_cache(1)[live[1]].any(), "a refused copy copied"
        pool.copy_blocks([live[0]], [live[1]])  # with auto_wake: wakes first
        assert pool.state.value == "active" and pool.key_cache(1)[live[1]].eq(3).all()
        pool.close()
    client.close()


def test_a_limit_under_one_logical_page_takes_even_page_zero(kvd: RunningDaemon) -> None:
    client, pool = register(kvd, num_prefetch_pages=0)
    pool.free(pool.alloc(1))  # page 0 mapped, spare
    client.set_limit("a", max_bytes=0)
    wait_mapped(client, "a", 0)  # the last page goes too: nothing is owed for good
    assert pool.mapped_bytes == 0 and pool.owed_pages == 0
    pool.close()


def test_requests_the_daemon_could_never_take_are_refused_before_sending(kvd: RunningDaemon) -> None:
    client = kvd.client()
    with pytest.raises(BadRequest, match="cannot be encoded"):
        client.set_limit("a", max_bytes=1 << 70)
    with pytest.raises(BadRequest, match="KVSpec"):
        client.register("a", {"num_layers": 1})  # type: ignore[arg-type]
    with pytest.raises(BadRequest, match="virtual_bytes"):
        client.register("a", SPEC, virtual_bytes=1 << 62)
    with pytest.raises(BadRequest, match="max_str_len"):
        client.register("x" * 5000, SPEC)  # answered by the daemon, under its id: no timeout


@pytest.mark.parametrize("kwargs", [
    {"num_spare_pages": "x"}, {"num_spare_pages": -1}, {"num_prefetch_pages": -5},
    {"num_prefetch_pages": 1.5}, {"num_spare_pages": True}, {"auto_wake": "yes"},
])
def test_bad_register_arguments_are_refused_and_leave_the_name_free(
    kvd: RunningDaemon, kwargs: dict[str, object],
) -> None:
    client = kvd.client()
    with pytest.raises(BadRequest, match=next(iter(kwargs))):
        client.register("a", SPEC, **kwargs)  # type: ignore[arg-type]
    assert client.status()["tenants"] == []
    client.register("a", SPEC).close()  # the name was never taken


def test_a_pool_that_fails_to_start_gives_its_name_back(
    kvd: RunningDaemon, monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken_start(self: KVPool) -> None:
        raise RuntimeError("a bug in the pool's start")

    client = kvd.client()
    with monkeypatch.context() as patched:
        patched.setattr(KVPool, "start", broken_start)
        with pytest.raises(RuntimeError, match="a bug"):
            client.register("a", SPEC)
    wait_until(lambda: client.status()["tenants"] == [], 5, "the failed register kept its name")
    client.register("a", SPEC).close()


def test_an_idle_pool_still_tells_the_daemon_it_lives(kvd: RunningDaemon, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_agent, "IDLE_HEARTBEAT_S", 1.5)  # 5 s in service
    client, pool = register(kvd)
    pool.alloc(10)  # one change told, then nothing changes
    silences = []
    for _ in range(8):  # 4 s: without the idle heartbeat the silence would only grow
        time.sleep(0.5)
        silences.append(tenant_row(client, "a")["silent_seconds"])
    assert max(silences) < 3.0, silences
    assert any(b < a for a, b in zip(silences, silences[1:])), f"never heard again: {silences}"
    pool.close()


def test_a_process_holding_over_1024_fds_still_grows(kvd: RunningDaemon) -> None:
    """Past FD_SETSIZE (1024) select() refuses an fd: the grant channel must not use it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1400:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard}: cannot open 1,100 fds")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1400), hard))
    held: list[int] = []
    try:
        while not held or held[-1] < 1100:  # the next sockets get numbers above these
            held.append(os.open("/dev/null", os.O_RDONLY))
        client, pool = register(kvd)
        blocks = pool.alloc(2 * BLOCKS_PER_PAGE)  # two pages granted over the channel
        assert pool.mapped_bytes >= 2 * LOGICAL_PAGE_BYTES
        pool.free(blocks)
        pool.close()
        client.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_threads_registering_at_once_share_one_backend(
    kvd: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvdaemon.cuda_vmm as cuda_vmm

    opened: list[object] = []
    real_open = cuda_vmm.open_backend

    def slow_open(*args: object, **kwargs: object) -> object:
        time.sleep(0.05)  # a CUDA context takes this long and more: threads overlap here
        backend = real_open(*args, **kwargs)
        opened.append(backend)
        return backend

    monkeypatch.setattr(cuda_vmm, "open_backend", slow_open)
    client = kvd.client()
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as threads:
            seen = list(threads.map(lambda _: client.backend(), range(8)))
        assert len(opened) == 1 and all(backend is opened[0] for backend in seen)
    finally:
        client.close()


def test_a_grow_past_the_processes_mapping_cap_is_refused_before_the_daemon_grants(kvd: RunningDaemon) -> None:
    client, pool = register(kvd, num_prefetch_pages=0)
    book = pool.backend._book
    room = pool.backend._map_cap() - book.num_mappings  # the process's other backends count too
    pool.backend.max_mappings -= room - SPEC.num_segments  # one logical page at the range's start: one each
    assert pool.alloc(BLOCKS_PER_PAGE)  # the first page maps
    with pytest.raises(PoolExhausted, match="vm.max_map_count"):
        pool.alloc(BLOCKS_PER_PAGE)
    assert tenant_row(client, "a")["mapped_bytes"] == LOGICAL_PAGE_BYTES, "the daemon granted nothing more"
    assert book.num_mappings <= pool.backend._map_cap()
    pool.backend.max_mappings += SPEC.num_segments  # raised (a freed page elsewhere, or the sysctl)
    assert pool.alloc(BLOCKS_PER_PAGE)
    wait_mapped(client, "a", 2 * LOGICAL_PAGE_BYTES)
    pool.close()


def test_a_registration_whose_min_the_daemon_clamped_says_so(
    kvd: RunningDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    client = kvd.client()
    client.call("set_limit", {"name": "promised", "min": "48MiB"})  # the operator's promise to another name
    caplog.set_level(logging.WARNING, logger="kvdaemon.client")
    pool = client.register("a", SPEC, min_bytes=32 * MiB)
    assert tenant_row(client, "a")["min_bytes"] == 16 * MiB
    assert [r.getMessage() for r in caplog.records if r.name == "kvdaemon.client"] == [
        "tenant a: min 32.0 MiB clamped to 16.0 MiB (promised by the operator to 'promised')"
    ]
    pool.close()


def test_a_return_the_backend_refuses_to_unmap_keeps_the_pages_spare_and_the_daemon_agreeing(
    kvd: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, pool = register(kvd, num_prefetch_pages=0, num_spare_pages=8)
    blocks = pool.alloc(3 * BLOCKS_PER_PAGE)
    pool.free(blocks[BLOCKS_PER_PAGE:])  # two spare pages, kept (num_spare_pages)
    free_before = pool.num_free_blocks

    def refused(addr: int, size_bytes: int) -> None:
        raise BackendError("munmap failed: out of memory (a test)")

    monkeypatch.setattr(pool.backend, "unmap", refused)
    with pool.core.lock, pytest.raises(BackendError, match="a test"):
        pool.core.return_all_spare()
    monkeypatch.undo()
    assert pool.mapped_bytes == 3 * LOGICAL_PAGE_BYTES and pool.num_free_blocks == free_before
    assert tenant_row(client, "a")["mapped_bytes"] == 3 * LOGICAL_PAGE_BYTES
    again = pool.alloc(2 * BLOCKS_PER_PAGE)  # from the spare pages, mapped all along
    pool.key_cache(1)[again] = 1.0
    assert tenant_row(client, "a")["mapped_bytes"] == 3 * LOGICAL_PAGE_BYTES
    kvd.check_invariants()
    pool.close()


def test_a_grant_of_pages_that_follow_each_other_maps_one_run_per_segment(
    kvd: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, pool = register(kvd, num_prefetch_pages=0, num_spare_pages=8)
    pool.alloc(1)  # logical page 0 first, on its own
    backend, runs, syscalls = pool.backend, [], [0]
    real_map_pages, real_mmap = backend.map_pages, backend._mmap

    def map_pages(addr: int, pages: list) -> None:
        runs.append([p.page_id for p in pages])
        real_map_pages(addr, pages)

    def mmap(*args: object) -> int:
        syscalls[0] += 1
        return real_mmap(*args)

    monkeypatch.setattr(backend, "map_pages", map_pages)
    monkeypatch.setattr(backend, "_mmap", mmap)
    blocks = pool.alloc(3 * BLOCKS_PER_PAGE)  # three more logical pages in one grant
    monkeypatch.undo()
    assert len(runs) == SPEC.num_segments and syscalls[0] == SPEC.num_segments, "a map per page, not per run"
    assert all(run == list(range(run[0], run[0] + 3)) for run in runs), "each segment's pages follow each other"
    for layer in range(SPEC.num_layers):  # every page of the runs is mapped where its blocks are
        pool.key_cache(layer)[blocks] = float(layer + 1)
        assert float(pool.key_cache(layer)[blocks].float().mean()) == layer + 1
    assert tenant_row(client, "a")["mapped_bytes"] == 4 * LOGICAL_PAGE_BYTES
    kvd.check_invariants()
    pool.close()
