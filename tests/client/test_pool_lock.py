"""PoolLock: the lock shuts the block gate; the engine's alloc/free never wait on the agent's round trips."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator

import pytest
import torch

from kvdaemon.client import KVClient, KVPool, KVSpec
from kvdaemon.client.pool_lock import PoolLock
from kvdaemon.client.pool_state import PoolState, PoolStateCell

from tests.conftest import PAGE_BYTES, RunningDaemon, running_daemon, wait_until

SPEC = KVSpec(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)
BLOCKS_PER_PAGE = PAGE_BYTES // SPEC.block_bytes


@pytest.fixture
def kvd() -> Iterator[RunningDaemon]:
    with running_daemon("64MiB") as running:
        yield running


def register(kvd: RunningDaemon, **kwargs: object) -> tuple[KVClient, KVPool]:
    client = kvd.client()
    return client, client.register("a", SPEC, **kwargs)


def in_thread(work: object) -> tuple[threading.Thread, threading.Event]:
    """Run ``work()`` on a thread; the event is set once it returned."""
    done = threading.Event()

    def run() -> None:
        work()  # type: ignore[operator]
        done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, done


def test_the_lock_shuts_the_gate_and_open_gate_lets_the_fast_path_in() -> None:
    lock = PoolLock()
    assert lock.try_enter(), "a free lock leaves the gate open"
    lock.leave()
    with lock:
        assert not lock.try_enter(), "a lock holder owns the blocks"
        with lock.open_gate():
            assert lock.try_enter(), "inside open_gate the engine may take the blocks"
            lock.leave()
        assert not lock.try_enter(), "the gate shuts again after open_gate"
    assert lock.try_enter()
    lock.leave()


def test_acquiring_the_lock_waits_for_a_fast_path_to_leave() -> None:
    lock = PoolLock()
    assert lock.try_enter()  # an engine inside alloc/free
    thread, acquired = in_thread(lock.acquire)
    assert not acquired.wait(0.2), "the lock was taken while the engine held the blocks"
    lock.leave()
    assert acquired.wait(10), "the lock never came once the engine left"
    assert not lock.try_enter()
    lock.release()
    thread.join(10)


def test_a_condition_over_the_lock_waits_and_wakes() -> None:
    lock = PoolLock()
    cell = PoolStateCell(lock)
    with lock:
        assert not cell.wait_for(lambda s: s.ended, 0.05), "nothing moved the state"
        assert not lock.try_enter(), "the wait gives the lock and the gate back"
    _, waited = in_thread(lambda: _wait_closed(lock, cell))
    with lock:
        cell.move(PoolState.CLOSED)
    assert waited.wait(10), "the waiter never saw the move"
    assert cell.ended


def _wait_closed(lock: PoolLock, cell: PoolStateCell) -> None:
    with lock:
        assert cell.wait_for(lambda s: s.ended, 10)


def test_alloc_and_free_go_on_while_the_agent_waits_for_a_page_return(kvd: RunningDaemon) -> None:
    client, pool = register(kvd, num_spare_pages=0, num_prefetch_pages=0)
    kept = pool.alloc(1)  # page 0 (kept for the pool's life)
    extra = pool.alloc(BLOCKS_PER_PAGE)  # spills onto page 1
    core = pool.core
    shrink = core.lease.shrink
    entered, release = threading.Event(), threading.Event()

    def slow_shrink(lps: list[int]) -> None:
        entered.set()
        release.wait(30)  # a daemon slow to confirm the return
        shrink(lps)

    core.lease.shrink = slow_shrink  # type: ignore[method-assign]
    try:
        pool.free(extra)  # page 1 is spare now; the agent gives it back at its next tick
        assert entered.wait(10), "the agent never returned the spare page"
        assert core.lock.locked(), "the agent waits holding the pool lock"
        _, done = in_thread(lambda: pool.free(pool.alloc(4)))
        assert done.wait(10), "alloc/free waited for the agent's round trip"
    finally:
        release.set()
    wait_until(lambda: not core.pending_return, 10, "the return was never confirmed")
    with core.lock:
        core.allocator.check()
        assert sorted(core.segments.pages) == [0]
    pool.free(kept)
    pool.close()
    client.close()


def test_engine_and_agent_racing_keep_every_live_block_mapped(kvd: RunningDaemon) -> None:
    client, pool = register(kvd, num_spare_pages=0, num_prefetch_pages=0)
    core = pool.core
    stop = threading.Event()
    errors: list[BaseException] = []

    def engine() -> None:
        rng = random.Random(7)
        held: list[int] = []
        try:
            while not stop.is_set():
                if held and (rng.random() < 0.5 or len(held) > 2 * BLOCKS_PER_PAGE):
                    rng.shuffle(held)
                    num = rng.randint(1, len(held))
                    pool.free(held[:num])
                    del held[:num]
                else:
                    held += pool.alloc(rng.choice((1, 3, BLOCKS_PER_PAGE // 2, BLOCKS_PER_PAGE + 5)))
                for block in held[:4]:
                    pool.key_cache(0)[block] = 1.0  # segfaults if the page went away under it
            pool.free(held)
        except BaseException as exc:  # reported to the test's thread
            errors.append(exc)

    thread = threading.Thread(target=engine, daemon=True)
    thread.start()
    for _ in range(300):  # the agent's housekeeping, as fast as it can go
        with core.lock:
            core.return_excess()
            core.allocator.check()
    stop.set()
    thread.join(30)
    assert not errors, errors
    with core.lock:
        core.allocator.check()
        assert core.allocator.num_live == 0
    pool.close()
    client.close()
