"""Sleep and wake of a ``KVPool``, run by its agent thread when the daemon asks.

Sleep: the engine's quiesce hook returns (its step is done, and it takes no
other until the resume hook runs), then, holding the
pool's lock, every page is unmapped from every segment while the handles are
kept, and the daemon is told ``sleep_ready``. If the daemon refuses (the sleep
timed out) the same pages are mapped back and nothing was lost. Otherwise the
handles are released; a warm pool keeps its allocator aside (its block ids
stay valid), a cold one drops it. While asleep the pool's allocator is empty,
so ``alloc`` takes its slow path and raises ``Asleep`` (or wakes the pool, with
``auto_wake``).

Wake: the daemon's grant is imported and mapped at the same logical pages
(same addresses); a warm pool gets its allocator back, a cold one a fresh one.

Cost: one unmap and one map per page and segment, one round trip each way.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvdaemon.client.allocator import BlockAllocator
from kvdaemon.errors import KVDaemonError

if TYPE_CHECKING:
    from kvdaemon.client.pool import KVPool

log = logging.getLogger("kvdaemon.client.pool")


def sleep_pool(pool: KVPool, mode: str, sleep_id: int) -> None:
    """Quiesce, unmap and hand the pages back for sleep ``sleep_id`` (see the module docstring).

    ``pool.resume_hook`` runs once the pool is asleep locally, or awake again
    after a refused sleep: the engine may take its next step (and finds out
    which from ``pool.sleep_mode``).
    """
    if pool.quiesce_hook is not None:
        pool.quiesce_hook()
    try:
        _sleep_quiesced(pool, mode, sleep_id)
    finally:
        if pool.resume_hook is not None:
            pool.resume_hook()


def _sleep_quiesced(pool: KVPool, mode: str, sleep_id: int) -> None:
    with pool.lock:
        pages = dict(pool._pages)
        allocator = pool.allocator
        _unmap_keep(pool, pages)
        # Asleep locally before the daemon answers anyone (a waiting caller, a wake).
        pool._pages.clear()
        pool.sleeping_allocator = allocator if mode == "warm" else None
        pool.allocator = _empty_allocator(pool)
        pool.sleep_mode = mode
        if mode == "cold":
            pool.num_block_losses += 1
        pool.awake.clear()
        try:
            pool.lease.sleep_ready(sleep_id)
        except KVDaemonError:
            pool.allocator, pool.sleeping_allocator, pool.sleep_mode = allocator, None, None
            pool.num_block_losses -= mode == "cold"
            _remap(pool, pages)
            pool.awake.set()
            log.warning("pool %s: sleep %d refused; pages mapped back", pool.name, sleep_id)
            return
        for lp_pages in pages.values():
            for page in lp_pages:
                pool.backend.release_page(page)
    log.info("pool %s is asleep (%s)", pool.name, mode)


def wake_pool(pool: KVPool, mode: str, grant_id: int, pages: list[list[Any]]) -> None:
    """Map the daemon's wake grant at the same logical pages and resume."""
    with pool.lock:
        granted = pool.lease.receive_grant(grant_id, pages) if pages else {}
        _remap(pool, granted)
        if mode == "warm" and pool.sleeping_allocator is not None:
            pool.allocator = pool.sleeping_allocator
        else:
            pool.allocator = _empty_allocator(pool)
            for lp in granted:
                pool.allocator.add_page(lp)
        pool.sleeping_allocator = None
        pool.sleep_mode = None
        pool.awake.set()
    log.info("pool %s is awake (%s)", pool.name, mode)


def _unmap_keep(pool: KVPool, pages: dict[int, list[Any]]) -> None:
    for lp in pages:
        offset = lp * pool.page_bytes
        for base in pool._bases:
            pool.backend.unmap(base + offset, pool.page_bytes)


def _remap(pool: KVPool, pages: dict[int, list[Any]]) -> None:
    for lp, lp_pages in pages.items():
        offset = lp * pool.page_bytes
        for base, page in zip(pool._bases, lp_pages):
            pool.backend.map_page(base + offset, page)
        pool._pages[lp] = lp_pages


def _empty_allocator(pool: KVPool) -> BlockAllocator:
    return BlockAllocator(pool.num_virtual_pages, pool.page_bytes, pool.spec.block_bytes)
