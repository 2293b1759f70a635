"""``KVPool``: one tenant's KV cache over reserved virtual ranges, backed on demand.

Each segment (K and V of every layer, layer-major) is one reserved range of
``num_virtual_pages`` pages, viewed as a tensor
``[num_blocks, block_size, num_kv_heads, head_dim]`` that never moves: block ids
and the tensors stay valid for the life of the pool. Physical pages are mapped
under the views only while blocks need them:

- ``alloc(n)`` takes blocks from mapped pages (``BlockAllocator``: fullest page
  first); when too few are free it asks the daemon for the missing logical
  pages in one grow, plus ``num_prefetch_pages`` ahead when the limit allows.
  If the daemon refuses, ``PoolExhausted`` is raised and nothing is allocated.
  A grow the free pages cannot serve waits for other tenants to give pages
  back up to ``grow_wait_s`` (``None``: the daemon's 2 s; ``0``: refuse at once).
- ``free(ids)`` returns blocks; pages no live block touches are *spare*, and
  spare pages beyond ``num_spare_pages`` go back to the daemon at once.
- A daemon ``reclaim`` notice (a lowered limit) is answered by a background
  thread, even while the engine is idle, by returning spare pages.

A lock guards the allocator; the engine's ``alloc``/``free`` pay one
uncontended acquire. Cost: ``alloc``/``free`` are O(blocks) with no daemon
round trip unless pages must be mapped or returned.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvdaemon.client.allocator import BlockAllocator
from kvdaemon.client.lease import Lease
from kvdaemon.client.pool_agent import PoolAgent
from kvdaemon.client.spec import KVSpec
from kvdaemon.errors import (
    Asleep,
    BackendError, BadRequest, DaemonUnreachable, KVDaemonError, NoMemory, OverLimit, PoolExhausted,
)

if TYPE_CHECKING:
    import torch


class KVPool:
    """A registered tenant's paged KV cache (see the module docstring)."""

    def __init__(
        self,
        lease: Lease,
        spec: KVSpec,
        num_virtual_pages: int,
        num_spare_pages: int = 2,
        num_prefetch_pages: int = 1,
        auto_wake: bool = False,
        register_args: dict[str, Any] | None = None,
    ) -> None:
        self.lease = lease
        self.register_args = register_args or {}  # max/min bytes, weight: for re-registering
        self.auto_wake = auto_wake
        # How long a grow may wait for other tenants' pages (None: the daemon's 2 s; 0: fail at once).
        self.grow_wait_s: float | None = None
        self.quiesce_hook: Callable[[], None] | None = None  # returns once the engine is between steps
        self.resume_hook: Callable[[], None] | None = None  # after a sleep: the engine may step again
        self.num_block_losses = 0  # times every block was dropped (cold sleep, waking empty after a restart)
        self.reclaim_hook: Callable[[int], int] | None = None  # evicts up to N cache-only blocks
        self.owed_pages = 0  # asked back but still in use: returned as their blocks are freed
        self.sleep_mode: str | None = None  # "warm"/"cold" while asleep
        self.sleeping_allocator: BlockAllocator | None = None  # a warm sleeper's blocks
        self.awake = threading.Event()
        self.awake.set()
        self.spec = spec
        self.name = lease.name
        self.backend = lease.backend
        self.page_bytes = lease.page_size_bytes
        self.num_virtual_pages = num_virtual_pages
        self.num_spare_pages = num_spare_pages
        self.num_prefetch_pages = min(num_prefetch_pages, num_spare_pages)
        self.allocator = BlockAllocator(num_virtual_pages, self.page_bytes, spec.block_bytes)
        self.num_blocks = self.allocator.num_blocks
        self.block_size = spec.block_size
        self.blocks_per_page = self.allocator.blocks_per_page
        self.lock = threading.Lock()  # guards the allocator and the page tables
        self._acquire, self._release = self.lock.acquire, self.lock.release
        self._bases: list[int] = []
        self._caches: list[torch.Tensor] = []
        self._pages: dict[int, list[Any]] = {}
        self._pending_return: set[int] = set()  # unmapped here, shrink not yet confirmed
        self._closed = False
        self.agent = PoolAgent(self)

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> None:
        """Reserve the ranges, build the tensor views, start the background agent."""
        import torch

        dtype = getattr(torch, self.spec.segment_dtype_name)
        span = self.num_virtual_pages * self.page_bytes
        view_bytes = self.num_blocks * self.spec.block_bytes
        shape = self.spec.segment_shape(self.num_blocks)
        try:
            for _ in range(self.spec.num_segments):
                self._bases.append(self.backend.reserve(span))
                self._caches.append(self.backend.tensor(self._bases[-1], view_bytes, dtype).view(shape))
        except BackendError:
            self._free_ranges()
            raise
        self.lease.on_notice = self.agent.on_notice
        self.agent.start()

    def close(self) -> None:
        """Give every page back, unregister, and free the ranges. The tensors die with it."""
        if self._closed:
            return
        self._closed = True
        self.agent.stop()
        try:
            with self.lock:
                self.drop_all_pages()
                self.lease.close()
        finally:
            with self.lock:
                self._caches.clear()
                self._free_ranges()
            self.lease.client.pool_closed(self)

    def drop_all_pages(self) -> None:
        """Unmap every page here (without telling the daemon) and empty the allocator.

        Later ``alloc`` calls take the slow path, where a closed or revoked pool
        raises. Call with the lock held.
        """
        for lp in list(self._pages):
            self._unmap(lp)
        self._pages.clear()
        self.allocator = BlockAllocator(self.num_virtual_pages, self.page_bytes, self.spec.block_bytes)

    def _free_ranges(self) -> None:
        for base in self._bases:
            self.backend.free_range(base)
        self._bases.clear()

    def __enter__(self) -> KVPool:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- tensors ---------------------------------------------------------------

    def key_cache(self, layer: int) -> torch.Tensor:
        """K of ``layer``: ``[num_blocks, block_size, num_kv_heads, head_dim]``, fixed address."""
        return self._caches[self.spec.key_segment(layer)]

    def value_cache(self, layer: int) -> torch.Tensor:
        """V of ``layer``, same shape as ``key_cache``."""
        return self._caches[self.spec.value_segment(layer)]

    def segment(self, index: int) -> torch.Tensor:
        """Segment ``index``'s view (``spec.segment_shape``), fixed address; block b is row b."""
        if not 0 <= index < len(self._caches):
            raise BadRequest(f"segment {index} is outside the pool's {len(self._caches)} segments")
        return self._caches[index]

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy K and V of every layer from blocks ``src`` to blocks ``dst`` (all live)."""
        import torch

        device = self._caches[0].device
        src_t = torch.tensor(src, dtype=torch.long, device=device)
        dst_t = torch.tensor(dst, dtype=torch.long, device=device)
        for cache in self._caches:
            cache.index_copy_(0, dst_t, cache.index_select(0, src_t))

    # -- blocks ----------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Free blocks on mapped pages (more can be mapped on demand)."""
        return self.allocator.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.allocator.num_live

    @property
    def used_bytes(self) -> int:
        return self.allocator.num_live * self.spec.block_bytes * self.spec.num_segments

    @property
    def mapped_bytes(self) -> int:
        return len(self._pages) * self.page_bytes * self.spec.num_segments

    def alloc(self, num_blocks: int) -> list[int]:
        """``num_blocks`` block ids over mapped memory; ``PoolExhausted`` with nothing taken."""
        if type(num_blocks) is not int or num_blocks < 0:
            raise BadRequest(f"cannot allocate {num_blocks!r} blocks")
        self._acquire()  # bound acquire/release: a third of a `with` block's cost
        try:
            if num_blocks > self.allocator.num_free:
                if self._closed or self.agent.revoked:
                    raise PoolExhausted(f"pool {self.name!r} is closed or its lease was revoked")
                if self.sleep_mode is not None:
                    return self._alloc_asleep(num_blocks)
                self._grow_for(num_blocks)
            return self.allocator.alloc(num_blocks)
        finally:
            self._release()

    def _alloc_asleep(self, num_blocks: int) -> list[int]:
        """Asleep: raise ``Asleep``, or with ``auto_wake`` wake the pool and allocate."""
        if not self.auto_wake:
            raise Asleep(f"pool {self.name!r} is sleeping ({self.sleep_mode}); wake it first")
        self._release()  # the agent maps the wake grant under this lock
        try:
            self.wake()
        finally:
            self._acquire()
        if num_blocks > self.allocator.num_free:
            self._grow_for(num_blocks)
        return self.allocator.alloc(num_blocks)

    def wake(self) -> None:
        """Wake this pool (its own lease asks the daemon); returns once its pages are mapped.

        A no-op when awake. Raises ``Asleep`` if the wake is not done within the
        control timeout, or the daemon's error (``NoMemory``...). Call without the lock.
        """
        if self.awake.is_set() and self.sleep_mode is None:
            return
        try:
            self.lease.wake()
        except BadRequest:
            pass  # the daemon has it awake already (someone else woke it): its wake notice is on the way
        if not self.awake.wait(self.lease.control.timeout_s):
            raise Asleep(f"pool {self.name!r} did not wake in time")

    def free(self, block_ids: list[int]) -> None:
        """Return blocks; spare pages past ``num_spare_pages`` go back to the daemon."""
        self._acquire()
        try:
            if self.sleeping_allocator is not None:  # warm sleep: the blocks live on
                self.sleeping_allocator.free(block_ids)
                return
            self.allocator.free(block_ids)
            spare = self.allocator.spare
            extra = len(spare) - self.num_spare_pages
            if self.owed_pages and spare:
                owed = min(len(spare), self.owed_pages)
                self.owed_pages -= owed
                extra = max(extra, owed)
            if extra > 0:
                self._return(self.allocator.spare_pages()[:extra])
        finally:
            self._release()

    # -- pages -----------------------------------------------------------------

    def _grow_for(self, num_blocks: int) -> None:
        """Map pages until ``num_blocks`` are free, in as few grows as the geometry allows.

        Raises ``DaemonUnreachable`` at once while the daemon is known to be gone.
        """
        if self.lease.lost.is_set():
            raise DaemonUnreachable(f"pool {self.name!r}: the daemon is gone; no new pages until one runs again")
        while num_blocks > self.allocator.num_free:
            missing = num_blocks - self.allocator.num_free
            needed = -(-missing // self.blocks_per_page)
            wanted = self.allocator.unmapped_pages(
                needed + self.num_prefetch_pages, skip=self._pending_return
            )
            if len(wanted) < needed:
                raise PoolExhausted(
                    f"pool {self.name!r} has {self.num_blocks} blocks of virtual capacity; "
                    f"{num_blocks} free wanted"
                )
            try:
                granted = self._grow(wanted)
            except (NoMemory, OverLimit) as exc:
                if len(wanted) == needed:
                    raise PoolExhausted(f"daemon refused {needed} page(s): {exc.message}") from exc
                try:
                    granted = self._grow(wanted[:needed])
                except (NoMemory, OverLimit) as again:
                    raise PoolExhausted(f"daemon refused {needed} page(s): {again.message}") from again
            self._map(granted)
            self.owed_pages = 0  # the daemon granted more: it no longer wants pages back

    def _grow(self, wanted: list[int]) -> dict[int, list[Any]]:
        """One grow; if its reply never came, try to give the pages back so both sides agree."""
        try:
            return self.lease.grow(wanted, self.grow_wait_s)
        except DaemonUnreachable:
            if not self.lease.lost.is_set():
                with contextlib.suppress(KVDaemonError):
                    self.lease.shrink(wanted)
            raise

    def _map(self, granted: dict[int, list[Any]]) -> None:
        """Map granted pages into every segment; on a backend error undo and give all back."""
        done: list[int] = []
        try:
            for lp, pages in granted.items():
                offset = lp * self.page_bytes
                mapped = 0
                try:
                    for base, page in zip(self._bases, pages):
                        self.backend.map_page(base + offset, page)
                        mapped += 1
                except BackendError:
                    for base in self._bases[:mapped]:
                        self.backend.unmap(base + offset, self.page_bytes)
                    raise
                self._pages[lp] = pages
                self.allocator.add_page(lp)
                done.append(lp)
        except BackendError:
            rest = [lp for lp in granted if lp not in done]
            for lp in rest:
                for page in granted[lp]:
                    self.backend.release_page(page)
            with contextlib.suppress(KVDaemonError):
                self.lease.shrink(rest)
            raise

    def _unmap(self, lp: int) -> None:
        offset = lp * self.page_bytes
        for base, page in zip(self._bases, self._pages[lp]):
            self.backend.unmap(base + offset, self.page_bytes)
            self.backend.release_page(page)

    def _return(self, lps: list[int]) -> None:
        """Unmap spare logical pages here and give them back to the daemon.

        Until the daemon confirms, the pages stay out of ``alloc``'s reach; the
        agent retries an unconfirmed return.
        """
        for lp in lps:
            self.allocator.remove_page(lp)
            self._unmap(lp)
            del self._pages[lp]
        self._pending_return.update(lps)
        self.retry_returns()

    def retry_returns(self) -> None:
        """Tell the daemon about pages unmapped here. Call with the lock held."""
        if self._pending_return:
            lps = sorted(self._pending_return)
            self.lease.shrink(lps)
            self._pending_return.difference_update(lps)

    def return_spare(self, num_pages: int) -> int:
        """Give back up to ``num_pages`` spare pages now (the agent's answer to a reclaim)."""
        with self.lock:
            spare = self.allocator.spare_pages()[:num_pages]
            if spare and not self._closed:
                self._return(spare)
            return len(spare)
