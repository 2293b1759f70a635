"""``PooledFreeQueue``: vLLM's free-block queue, backed by a kvdaemon pool.

vLLM's ``BlockPool`` keeps every block it does not hold in one queue, fresh
blocks first and prefix-cached blocks (still holding KV worth a hit) last, in
LRU order. This queue keeps the same contract over a ``KVPool``:

- *held* blocks are vLLM's (ref count > 0, or the null block);
- *spare* blocks were taken from the pool ahead of need (``ensure_free``) and
  are handed out first (what is left goes back after each ``schedule``);
- *cached* blocks were freed by vLLM with their KV kept (prefix cache, or
  ``unpin_blocks``): they stay allocated in the pool, so their pages stay
  mapped, and are handed out (evicted) oldest first, or given back to the pool
  when the daemon reclaims pages (``BlockPool.release_free``);
- blocks freed without KV go straight back to the pool (its empty pages to
  the daemon);
- anything else is unmapped or mapped-but-free in the pool, taken on demand.

``num_free_blocks`` is what vLLM could get now: spare + the pool's free mapped
blocks it may allocate (``num_allocatable_blocks``: not those on pages mapped past
a lowered limit) + cached + what the daemon could still grant (``Headroom``).

After the pool lost its blocks (a cold sleep), ``forget`` drops every block it
took from the pool; frees of blocks from before then are ignored.

Not thread-safe: the engine gate serialises the engine and the pool's agent.
Cost: O(blocks moved) per call, plus a daemon round trip when pages are mapped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from kvdaemon.errors import KVDaemonError, PoolExhausted, Unsupported

if TYPE_CHECKING:
    from kvdaemon.client import KVPool
    from kvdaemon.integrations.vllm.headroom import Headroom

log = logging.getLogger("kvdaemon.integrations.vllm")


def take_block_zero(pool: KVPool) -> None:
    """Allocate block 0 of a fresh (or emptied) pool for vLLM's null block; ``Unsupported`` otherwise.

    vLLM pads block tables with block 0 and its warm-up reads it, so its page
    is mapped before the first forward pass and stays mapped while held.
    """
    ids = pool.alloc(1)
    if ids != [0]:
        pool.free(ids)
        raise Unsupported(
            f"pool {pool.name!r} handed out block {ids[0]} first, not block 0: "
            "vLLM's null block must be block 0 (register a fresh tenant for the engine)"
        )


class PooledFreeQueue:
    """The free blocks of a pooled ``BlockPool`` (see the module docstring)."""

    def __init__(self, pool: KVPool, headroom: Headroom, blocks: list[Any]) -> None:
        self.pool = pool
        self.headroom = headroom
        self.blocks = blocks  # vLLM's KVCacheBlock per block id
        self.spare: list[int] = []
        self.cached: dict[int, Any] = {}  # block id -> block, oldest first
        self.owned = bytearray(len(blocks))  # taken from the pool since the last loss
        self.owned[0] = 1  # vLLM's null block: the tenant took it at registration
        self.num_held = 1  # blocks vLLM holds; the null block is held for good
        self._unheld_view = False

    # -- counts ----------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """What vLLM could get now (see the module docstring)."""
        if self._unheld_view:
            return len(self.blocks) - self.num_held
        return self.num_backed + self.headroom.blocks()

    @property
    def num_backed(self) -> int:
        """Free blocks that need no grant: spare, free in the pool's mapped pages, cached."""
        return len(self.spare) + self.pool.num_allocatable_blocks + len(self.cached)

    @contextmanager
    def counting_unheld(self) -> Iterator[None]:
        """Within: ``num_free_blocks`` counts every block vLLM does not hold, as vLLM's own queue would."""
        self._unheld_view = True
        try:
            yield
        finally:
            self._unheld_view = False

    # -- taking from the pool ----------------------------------------------------

    def retake_null_block(self) -> None:
        """Take block 0 from the pool again after a loss (vLLM's null block; its page stays mapped)."""
        take_block_zero(self.pool)
        self.owned[0] = 1

    def ensure_free(self, num_blocks: int) -> None:
        """Map pages now so that ``num_blocks`` blocks can be handed out without evicting.

        Asks the daemon only when the headroom allows a grow; a refusal is
        recorded (``Headroom.refused``), never raised: vLLM then sees fewer
        free blocks and preempts or waits.
        """
        wanted = num_blocks - len(self.spare)
        if wanted <= self.pool.num_allocatable_blocks or not self.headroom.may_grow():
            return
        try:
            self._take(self.pool.alloc(wanted))
        except KVDaemonError as exc:
            level = logging.DEBUG if isinstance(exc, PoolExhausted) else logging.WARNING
            log.log(level, "pool %s: no grow for %d blocks: %s", self.pool.name, wanted, exc)
            self.headroom.refused()

    def _take(self, ids: list[int]) -> None:
        for block_id in ids:
            self.owned[block_id] = 1
        self.spare.extend(ids)

    # -- vLLM's queue ------------------------------------------------------------

    def popleft(self) -> Any:
        return self.popleft_n(1)[0]

    def popleft_n(self, num_blocks: int) -> list[Any]:
        """Hand ``num_blocks`` blocks to vLLM: spare, mapped free, oldest cached, then newly granted."""
        if num_blocks <= 0:
            return []
        if num_blocks > len(self.spare):
            from_pool = min(num_blocks - len(self.spare), self.pool.num_allocatable_blocks)
            if from_pool:
                try:  # free and mapped, within the limit: no grow
                    self._take(self.pool.alloc(from_pool))
                except PoolExhausted:  # a limit lowered since the count: cached blocks, then a grant
                    pass
        ids = self.spare[:num_blocks]
        del self.spare[:num_blocks]
        out = [self.blocks[block_id] for block_id in ids]
        while len(out) < num_blocks and self.cached:
            out.append(self.cached.pop(next(iter(self.cached))))
        if len(out) < num_blocks:
            out += self._grant(num_blocks - len(out), out)
        self.num_held += num_blocks
        return out

    def _grant(self, num_blocks: int, taken: list[Any]) -> list[Any]:
        try:
            ids = self.pool.alloc(num_blocks) if self.headroom.may_grow() else []
        except KVDaemonError as exc:
            self.headroom.refused()
            ids, reason = [], str(exc)
        else:
            reason = "no grow allowed now (a refusal since the last refresh, or the limit)"
        if len(ids) < num_blocks:
            self._restore(taken)
            raise ValueError(f"no free blocks: {num_blocks} more wanted from pool {self.pool.name!r}; {reason}")
        for block_id in ids:
            self.owned[block_id] = 1
        return [self.blocks[block_id] for block_id in ids]

    def _restore(self, taken: list[Any]) -> None:
        """Undo a failed ``popleft_n``: blocks go back to where they came from (cached ones last)."""
        for block in taken:
            if block.block_hash is not None:
                self.cached[block.block_id] = block
            else:
                self.spare.append(block.block_id)

    def remove(self, block: Any) -> None:
        """vLLM takes back a cached block (a prefix-cache hit)."""
        if self.cached.pop(block.block_id, None) is None:
            raise RuntimeError(f"remove() called on block {block.block_id}, which is not in the free queue")
        self.num_held += 1

    def append(self, block: Any) -> None:
        self.append_n([block])

    def append_n(self, blocks: list[Any]) -> None:
        """vLLM frees blocks whose KV stays worth reading: keep them mapped, newest last."""
        for block in blocks:
            if self.owned[block.block_id]:
                self.cached[block.block_id] = block
        self.num_held -= len(blocks)

    def prepend_n(self, blocks: list[Any]) -> None:
        """vLLM frees blocks without KV worth keeping: back to the pool at once."""
        ids = [block.block_id for block in blocks if self.owned[block.block_id]]
        self.num_held -= len(blocks)
        self._give_back(ids)

    def get_all_free_blocks(self) -> list[Any]:
        """The blocks vLLM could take without a grant: spare, then cached oldest first."""
        return [self.blocks[block_id] for block_id in self.spare] + list(self.cached.values())

    def iter_blocks_after(self, cursor: Any) -> Iterator[Any]:
        """``get_all_free_blocks`` after ``cursor`` (from the start for None)."""
        blocks = self.get_all_free_blocks()
        start = 0 if cursor is None else next((i + 1 for i, b in enumerate(blocks) if b is cursor), len(blocks))
        yield from blocks[start:]

    # -- giving back ---------------------------------------------------------------

    def pop_spare(self, num_blocks: int) -> list[int]:
        """Up to ``num_blocks`` spare block ids, removed from the queue (to give back)."""
        ids = self.spare[-num_blocks:] if num_blocks > 0 else []
        del self.spare[len(self.spare) - len(ids):]
        return ids

    def pop_cached(self, num_blocks: int) -> list[Any]:
        """Up to ``num_blocks`` cached blocks, oldest first, removed from the queue."""
        out = []
        while self.cached and len(out) < num_blocks:
            out.append(self.cached.pop(next(iter(self.cached))))
        return out

    def give_back(self, ids: list[int]) -> None:
        """Return blocks taken out with ``pop_spare``/``pop_cached`` to the pool."""
        self._give_back([block_id for block_id in ids if self.owned[block_id]])

    def _give_back(self, ids: list[int]) -> None:
        if ids:
            for block_id in ids:
                self.owned[block_id] = 0
            self.pool.free(ids)

    def forget(self) -> None:
        """The pool lost every block (a cold sleep): drop spare, cached and ownership."""
        self.spare.clear()
        self.cached.clear()
        self.owned = bytearray(len(self.blocks))
