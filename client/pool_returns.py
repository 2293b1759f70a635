"""Pages and blocks a pool's agent gives back by itself: a lowered limit's debt, a collected
cache's blocks, and the return gate every page return of the agent goes through.

- ``returning(core)``: whether spare pages may go back now. An engine that counts
  the pool's free blocks and takes them later (vLLM's scheduler) sets
  ``return_gate`` and holds it across the two; the agent enters it around each
  return (never while a hook runs: a hook may wait for the engine, which may
  wait for the gate), and a return it does not allow goes at a later wake-up
  or is owed.
- ``pay_limit_debt(core)``: pages mapped past a limit lowered under them go
  back: spare ones at once, then those the engine's cache-only blocks hold.
- ``free_orphans(core)``: blocks handed over by ``KVPool.free_later`` (a cache
  collected without ``close()``) are freed on the agent's thread.

All run on the agent's thread; each takes the pool's lock only for its own work.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from kvdaemon.client.pool_core import PoolCore
from kvdaemon.client.pool_state import PoolState

log = logging.getLogger("kvdaemon.client.pool")


@contextmanager
def returning(core: PoolCore) -> Iterator[bool]:
    """Whether spare pages may go back now: inside the engine's ``return_gate`` where it set
    one, else always (see the module docstring)."""
    gate = core.return_gate
    if gate is None:
        yield True
        return
    with gate() as may_return:
        yield may_return


def return_spare(core: PoolCore, num_pages: int) -> int:
    """Give back up to ``num_pages`` spare pages, inside the return gate; how many went."""
    with returning(core) as may_return:
        return core.return_spare(num_pages) if may_return else 0


def pay_limit_debt(core: PoolCore) -> None:
    """Pages mapped past a limit lowered under them go back: spare ones at once, then those
    the engine's cache-only blocks hold (its reclaim hook evicts the debt's worth of blocks,
    whole pages first, then every cache-only block while a page is still over: a page goes
    back only once each of its blocks is free, and an idle engine frees none by itself).
    Blocks of running requests go back as they are freed; while over its limit the pool
    keeps no cache. Cost: O(1) within the limit; over it, one or two hook calls, O(cached
    blocks), per wake-up."""
    over = core.pages_over_limit()
    if over <= 0 or core.state is not PoolState.ACTIVE:
        return
    over -= return_spare(core, over)
    for num_blocks in (over * core.allocator.blocks_per_page, core.allocator.num_blocks):
        hook = core.reclaim_hook
        if over <= 0 or hook is None:
            return
        hook(num_blocks)
        over -= return_spare(core, over)


def free_orphans(core: PoolCore) -> None:
    """Free the blocks handed over by ``KVPool.free_later``, but those no longer live, or
    handed over before the pool lost every block (their ids may be someone else's now).
    O(blocks)."""
    batches = []
    while core.orphaned:
        batches.append(core.orphaned.pop())  # list.pop: safe beside a finalizer's append
    with core.lock:
        if core.cell.ended:
            return
        allocator = core.allocator if core.sleeping_allocator is None else core.sleeping_allocator
        ids = [b for losses, batch in batches if losses == core.num_block_losses for b in batch]
        live = [b for b in dict.fromkeys(ids) if allocator.is_live(b)]
        if live:
            allocator.free(live)
    log.info("pool %s: freed %d block(s) of a cache collected without close()", core.name, len(live))
