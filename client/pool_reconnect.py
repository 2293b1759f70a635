"""Surviving a daemon restart: a pool re-registers and moves its pages to the new daemon.

While no daemon runs, the pool's pages stay mapped (this process holds their
handles), so the engine keeps reading and writing its KV; only growing fails.
When a daemon answers on the same directory again, the agent:

1. registers the tenant again (same name, spec, virtual size and limits) and
   attaches a new lease;
2. grows the same logical pages from the new daemon;
3. for each page and segment: maps the new page at a staging slot, copies the
   bytes, and swaps it in at the segment's address (unmap old, map new), all
   under the pool's lock and with the engine held between steps (the pool's
   quiesce and resume hooks, as for a sleep: a page is briefly unmapped), so
   block ids, addresses and bytes are unchanged;
4. releases the old pages (the dead daemon's memory goes back to the OS).

If the new daemon has too little room, the pool keeps its old pages and tries
again on the next tick. Cost: one page copy per page and segment.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvdaemon.errors import DaemonUnreachable, KVDaemonError

if TYPE_CHECKING:
    from kvdaemon.client.lease import Lease
    from kvdaemon.client.pool import KVPool

log = logging.getLogger("kvdaemon.client.pool")
PROBE_TIMEOUT_S = 0.5


def try_reconnect(pool: KVPool) -> bool:
    """One attempt; True once the pool is registered with a live daemon again."""
    client = pool.lease.client
    probe = type(client)(client.dir, timeout_s=PROBE_TIMEOUT_S)
    try:
        probe.hello()
    except DaemonUnreachable:
        return False
    finally:
        probe.close()
    try:
        lease = client.lease(
            pool.name, pool.spec, num_virtual_pages=pool.num_virtual_pages, **pool.register_args
        )
    except KVDaemonError as exc:
        log.warning("pool %s: re-registering failed: %s", pool.name, exc)
        return False
    if pool.quiesce_hook is not None:
        pool.quiesce_hook()
    try:
        with pool.lock:
            _move_pages(pool, lease)
    except KVDaemonError as exc:
        log.warning("pool %s: moving pages to the new daemon failed: %s", pool.name, exc)
        lease.close()
        return False
    finally:
        if pool.resume_hook is not None:
            pool.resume_hook()
    old, pool.lease = pool.lease, lease
    lease.on_notice = pool.agent.on_notice
    old.abandon()
    log.info("pool %s: re-registered with the new daemon, %d pages moved", pool.name, len(pool._pages))
    return True


def _move_pages(pool: KVPool, lease: Lease) -> None:
    if pool.sleep_mode is not None:  # its warm copy died with the old daemon: wake empty
        log.warning("pool %s: asleep when its daemon died; it wakes empty", pool.name)
        pool.allocator = type(pool.allocator)(pool.num_virtual_pages, pool.page_bytes,
                                              pool.spec.block_bytes)  # fmt: skip
        pool.sleeping_allocator = None
        pool.sleep_mode = None
        pool.num_block_losses += 1
        pool.awake.set()
    lps = sorted(pool._pages)
    granted = lease.grow(lps) if lps else {}
    staging = pool.backend.reserve(pool.page_bytes)
    try:
        for lp in lps:
            pool._pages[lp] = _swap_in(pool, lp, granted[lp], staging)
    finally:
        pool.backend.free_range(staging)
    pool.backend.prune_imports()


def _swap_in(pool: KVPool, lp: int, fresh: list[Any], staging: int) -> list[Any]:
    import torch

    offset = lp * pool.page_bytes
    for base, old, new in zip(pool._bases, pool._pages[lp], fresh):
        pool.backend.map_page(staging, new)
        target = pool.backend.tensor(staging, pool.page_bytes, torch.uint8)
        target.copy_(pool.backend.tensor(base + offset, pool.page_bytes, torch.uint8))
        pool.backend.unmap(staging, pool.page_bytes)
        pool.backend.unmap(base + offset, pool.page_bytes)
        pool.backend.map_page(base + offset, new)
        pool.backend.release_page(old)
    return fresh
