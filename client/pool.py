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
- ``free(ids)`` returns blocks; pages no live block touches are *spare*, and
  spare pages beyond ``num_spare_pages`` go back to the daemon at once.
- A daemon ``reclaim`` notice (a lowered limit) is answered by a background
  thread, even while the engine is idle, by returning spare pages.

A lock guards the allocator; the engine's ``alloc``/``free`` pay one
uncontended acquire. Cost: ``alloc``/``free`` are O(blocks) with no daemon
round trip unless pages must be mapped or returned.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from kvdaemon.client.allocator import BlockAllocator
from kvdaemon.client.lease import Lease
from kvdaemon.client.spec import KVSpec
from kvdaemon.errors import BadRequest, KVDaemonError, NoMemory, OverLimit, PoolExhausted

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvdaemon.client.pool")
HEARTBEAT_S = 1.0


class KVPool:
    """A registered tenant's paged KV cache (see the module docstring)."""

    def __init__(
        self,
        lease: Lease,
        spec: KVSpec,
        num_virtual_pages: int,
        num_spare_pages: int = 2,
        num_prefetch_pages: int = 1,
    ) -> None:
        self.lease = lease
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
        self._lock = threading.Lock()
        self._bases: list[int] = []
        self._caches: list[torch.Tensor] = []
        self._pages: dict[int, list[Any]] = {}
        self._reclaim_pages = 0
        self._wake = threading.Event()
        self._closed = False
        self._agent: threading.Thread | None = None
        self._reported_used = -1

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> None:
        """Reserve the ranges, build the tensor views, start the background agent."""
        import torch

        dtype = getattr(torch, self.spec.dtype_name)
        span = self.num_virtual_pages * self.page_bytes
        view_bytes = self.num_blocks * self.spec.block_bytes
        shape = (self.num_blocks, self.spec.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        for _ in range(self.spec.num_segments):
            base = self.backend.reserve(span)
            self._bases.append(base)
            self._caches.append(self.backend.tensor(base, view_bytes, dtype).view(shape))
        self.lease.on_notice = self._on_notice
        self._agent = threading.Thread(target=self._agent_loop, name=f"kvpool-{self.name}", daemon=True)
        self._agent.start()

    def close(self) -> None:
        """Give every page back, unregister, and free the ranges. The tensors die with it."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        if self._agent is not None:
            self._agent.join(5)
        with self._lock:
            for lp in list(self._pages):
                self._unmap(lp)
            self._pages.clear()
            # An empty allocator: every later alloc takes the slow path and sees _closed.
            self.allocator = BlockAllocator(self.num_virtual_pages, self.page_bytes, self.spec.block_bytes)
            self.lease.close()
            self._caches.clear()
            for base in self._bases:
                self.backend.free_range(base)
            self._bases.clear()
        self.lease.client.pool_closed(self)

    def __enter__(self) -> KVPool:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- tensors ---------------------------------------------------------------

    def key_cache(self, layer: int) -> torch.Tensor:
        """K of ``layer``: ``[num_blocks, block_size, num_kv_heads, head_dim]``, fixed address."""
        return self._caches[2 * layer]

    def value_cache(self, layer: int) -> torch.Tensor:
        """V of ``layer``, same shape as ``key_cache``."""
        return self._caches[2 * layer + 1]

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
        with self._lock:
            if num_blocks > self.allocator.num_free:
                if self._closed:
                    raise PoolExhausted(f"pool {self.name!r} is closed")
                self._grow_for(num_blocks)
            return self.allocator.alloc(num_blocks)

    def free(self, block_ids: list[int]) -> None:
        """Return blocks; spare pages past ``num_spare_pages`` go back to the daemon."""
        with self._lock:
            self.allocator.free(block_ids)
            extra = len(self.allocator.spare) - self.num_spare_pages
            if extra > 0:
                self._return(self.allocator.spare_pages()[:extra])

    # -- pages -----------------------------------------------------------------

    def _grow_for(self, num_blocks: int) -> None:
        """Map pages until ``num_blocks`` are free, in as few grows as the geometry allows."""
        while num_blocks > self.allocator.num_free:
            missing = num_blocks - self.allocator.num_free
            needed = -(-missing // self.blocks_per_page)
            wanted = self.allocator.unmapped_pages(needed + self.num_prefetch_pages)
            if len(wanted) < needed:
                raise PoolExhausted(
                    f"pool {self.name!r} has {self.num_blocks} blocks of virtual capacity; "
                    f"{num_blocks} free wanted"
                )
            try:
                granted = self.lease.grow(wanted)
            except (NoMemory, OverLimit) as exc:
                if len(wanted) == needed:
                    raise PoolExhausted(f"daemon refused {needed} page(s): {exc.message}") from exc
                try:
                    granted = self.lease.grow(wanted[:needed])
                except (NoMemory, OverLimit) as again:
                    raise PoolExhausted(f"daemon refused {needed} page(s): {again.message}") from again
            self._map(granted)

    def _map(self, granted: dict[int, list[Any]]) -> None:
        for lp, pages in granted.items():
            offset = lp * self.page_bytes
            for base, page in zip(self._bases, pages):
                self.backend.map_page(base + offset, page)
            self._pages[lp] = pages
            self.allocator.add_page(lp)

    def _unmap(self, lp: int) -> None:
        offset = lp * self.page_bytes
        for base, page in zip(self._bases, self._pages[lp]):
            self.backend.unmap(base + offset, self.page_bytes)
            self.backend.release_page(page)

    def _return(self, lps: list[int]) -> None:
        """Unmap spare logical pages here and give them back to the daemon."""
        for lp in lps:
            self.allocator.remove_page(lp)
            self._unmap(lp)
            del self._pages[lp]
        self.lease.shrink(lps)

    # -- background agent ------------------------------------------------------

    def _on_notice(self, body: dict[str, Any]) -> None:
        """Called on the lease's reader thread: record, wake the agent, never block."""
        if body.get("notice") == "reclaim":
            num_pages = body.get("num_pages")
            if isinstance(num_pages, int) and num_pages > 0:
                self._reclaim_pages = max(self._reclaim_pages, num_pages)
                self._wake.set()

    def _agent_loop(self) -> None:
        while not self._closed:
            self._wake.wait(HEARTBEAT_S)
            self._wake.clear()
            if self._closed or self.lease.lost.is_set():
                return
            try:
                self._serve_reclaim()
                self._report_used()
            except KVDaemonError as exc:
                log.warning("pool %s: daemon request failed: %s", self.name, exc)

    def _serve_reclaim(self) -> None:
        if not self._reclaim_pages:
            return
        with self._lock:
            wanted, self._reclaim_pages = self._reclaim_pages, 0
            spare = self.allocator.spare_pages()[:wanted]
            if spare and not self._closed:
                self._return(spare)
                log.info("pool %s: returned %d spare page(s) on request", self.name, len(spare))

    def _report_used(self) -> None:
        used = self.used_bytes
        if used != self._reported_used:
            self.lease.heartbeat(used_bytes=used)
            self._reported_used = used
