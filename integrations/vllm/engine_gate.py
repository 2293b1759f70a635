"""``EngineGate``: the engine's steps and the pool agent's sleeps and evictions, one at a time.

vLLM's engine thread schedules and runs its model over the pool's views; the
pool's agent thread answers the daemon (reclaim, sleep, wake). The gate is one
re-entrant lock between them:

- the engine holds it around every scheduler call that touches blocks and
  around each engine step (``hold``), so a sleep never unmaps pages under a
  running step and a reclaim never evicts a cached block between vLLM's
  prefix-cache lookup and its use;
- a sleep holds it from ``quiesce`` to ``resume`` (the pool's hooks): vLLM
  finishes its step, the next one waits, and the pool unmaps in between. A
  CUDA unmap synchronises the device first, so work an asynchronous step left
  in flight completes before its memory goes;
- a reclaim (``reclaim``, the pool's hook) takes it for as long as evicting
  cached blocks takes, or gives up after ``reclaim_timeout_s`` (then the pages
  are owed and go back at the engine's next step);
- the pool's agent gives spare pages back only outside a schedule (``returning``,
  the pool's return gate; a lock of its own, held by the engine inside the gate
  for each schedule): vLLM counts the pool's free mapped blocks, then takes
  them, and a page returned in between would make it take blocks that are gone.

On entering, the engine catches up with what happened while it was away: a
pool that lost its blocks (cold sleep) makes vLLM preempt its running
requests and drop its prefix cache (their KV is gone); a sleeping pool is
woken before a step that needs memory; owed pages are given back.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from kvdaemon.errors import KVDaemonError

if TYPE_CHECKING:
    from kvdaemon.client import KVPool

log = logging.getLogger("kvdaemon.integrations.vllm")
RECLAIM_TIMEOUT_S = 1.0
WAKE_RETRY_S = 0.5


class EngineGate:
    """One lock between a vLLM engine and its pool's agent (see the module docstring)."""

    def __init__(self, pool: KVPool, reclaim_timeout_s: float = RECLAIM_TIMEOUT_S) -> None:
        self.pool = pool
        self.reclaim_timeout_s = reclaim_timeout_s
        self.lock = threading.RLock()
        self._counting = threading.RLock()  # a schedule: the pool's free blocks stay (``returning``)
        self.block_pool: Any = None  # the scheduler's PooledBlockPool, once built
        self.scheduler: Any = None  # the scheduler, once it called in
        self._num_losses = pool.num_block_losses
        self._retry = threading.Event()  # never set: a wait with a timeout between wake attempts

    # -- engine side -------------------------------------------------------------

    @contextmanager
    def hold(self, scheduler: Any = None, needs_memory: bool = False) -> Iterator[None]:
        """Hold the gate for one engine call; catch up first (see the module docstring).

        After a call that ``needs_memory`` (a schedule), blocks taken ahead of
        need and not used go back to the pool.
        """
        with self.lock, self._counting if needs_memory else contextlib.nullcontext():
            if scheduler is not None:
                self.scheduler = scheduler
            self._catch_up(needs_memory)
            yield
            if needs_memory:
                self.pool.note_activity()  # the engine scheduled: busy, for idle time
            if needs_memory and self.block_pool is not None and self.pool.sleep_mode is None:
                self.block_pool.release_spare()

    def _catch_up(self, needs_memory: bool) -> None:
        if needs_memory and self.pool.sleep_mode is not None:
            self._wake()
        if self.pool.num_block_losses != self._num_losses:  # after the wake: it may find them gone
            self._drop_lost_blocks()
        block_pool = self.block_pool
        if block_pool is None or self.pool.sleep_mode is not None:
            return
        queue = block_pool.free_block_queue
        if not queue.owned[0]:
            queue.retake_null_block()
        if self.pool.owed_pages:
            block_pool.release_free(self.pool.owed_pages * self.pool.blocks_per_page)

    def _drop_lost_blocks(self) -> None:
        """The pool lost every block: vLLM forgets their KV (running requests are recomputed)."""
        self._num_losses = self.pool.num_block_losses
        if self.block_pool is None:
            return
        log.warning("pool %s lost its KV (cold sleep): preempting running requests", self.pool.name)
        self.block_pool.free_block_queue.forget()
        if self.scheduler is not None:
            self.scheduler.reset_prefix_cache(reset_running_requests=True)
        else:
            self.block_pool.reset_prefix_cache()

    def _wake(self) -> None:
        """Wake the sleeping pool; retries until the daemon grants its pages back."""
        while True:
            try:
                self.pool.wake()
                return
            except KVDaemonError as exc:
                log.warning("pool %s: wake failed (%s); retrying", self.pool.name, exc)
            self._retry.wait(WAKE_RETRY_S)

    # -- agent side (the pool's hooks) -------------------------------------------------

    def quiesce(self) -> None:
        """Return once the engine is between steps; it takes no other until ``resume``."""
        self.lock.acquire()

    def resume(self) -> None:
        """The pool is asleep (or awake again): drop lost KV now, then let the engine step."""
        try:
            if self.pool.num_block_losses != self._num_losses:
                self._drop_lost_blocks()
        finally:
            self.lock.release()

    @contextmanager
    def returning(self) -> Iterator[bool]:
        """The pool's return gate: yields True once no schedule runs (none starts until the
        block ends), False after ``reclaim_timeout_s`` of one running (pages go back later)."""
        if not self._counting.acquire(timeout=self.reclaim_timeout_s):
            yield False
            return
        try:
            yield True
        finally:
            self._counting.release()

    def reclaim(self, num_blocks: int) -> int:
        """Give up to ``num_blocks`` unheld blocks back to the pool; returns how many."""
        if not self.lock.acquire(timeout=self.reclaim_timeout_s):
            return 0
        try:
            if self.block_pool is None or self.pool.sleep_mode is not None:
                return 0
            return self.block_pool.release_free(num_blocks)
        finally:
            self.lock.release()
