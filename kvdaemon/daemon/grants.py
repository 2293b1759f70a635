"""Grants: logical pages in and out of a tenant, with their fds on the handle channel.

``grow`` checks everything first (state, lease, pages already held, free pages,
the tenant's limit), then takes one physical page per segment for each logical
page, exports them in frames of at most ``MAX_FDS_PER_FRAME`` pages and queues
the frames to the tenant before the reply goes out. ``shrink`` gives pages back.
Either succeeds whole or changes nothing.

Cost: O(pages) plus one backend create/export (grow) or release (shrink) per page.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvdaemon.cuda_vmm.backend import PhysicalPage
from kvdaemon.errors import Asleep, BackendError, BadRequest, Conflict, NoMemory, OverLimit
from kvdaemon.wire.handles import MAX_FDS_PER_FRAME
from kvdaemon.daemon.page_pool import Owner, PagePool
from kvdaemon.daemon.tenant import Tenant

if TYPE_CHECKING:
    from kvdaemon.daemon.service import LeasePort


class Grants:
    """Grow and shrink of tenants over one ``PagePool``."""

    def __init__(
        self,
        pool: PagePool,
        leases: LeasePort,
        on_grant: Callable[[float, int], None] | None = None,
        on_shrink: Callable[[int], None] | None = None,
    ) -> None:
        self.pool = pool
        self.leases = leases
        self.on_grant = on_grant
        self.on_shrink = on_shrink
        self._next_grant_id = 1

    def grow(self, tenant: Tenant, wanted: list[int]) -> dict[str, Any]:
        """Grant ``wanted`` logical pages: all of them, or raise with nothing changed."""
        started = time.perf_counter()
        self._check_grow(tenant, wanted)
        result = self.grant(tenant, wanted)
        if self.on_grant is not None:
            self.on_grant(time.perf_counter() - started, len(wanted) * tenant.spec.num_segments)
        return result

    def grant(self, tenant: Tenant, wanted: list[int]) -> dict[str, Any]:
        """Take pages for ``wanted`` and queue their fds to the tenant; no limit checks.

        Raises ``NoMemory`` (nothing taken) when the pool is short.
        """
        owners = [
            Owner(tenant.tenant_id, seg, lp) for lp in wanted for seg in range(tenant.spec.num_segments)
        ]
        pages = self.pool.alloc(owners)
        frames = self._export(pages)
        grant_id = self._next_grant_id
        self._next_grant_id += 1
        page_ids = [p.page_id for p in pages]
        nseg = tenant.spec.num_segments
        for i, lp in enumerate(wanted):
            tenant.logical[lp] = pages[i * nseg : (i + 1) * nseg]
        tenant.touch()
        for start, fds, fd_index in frames:
            chunk = page_ids[start : start + len(fd_index)]
            self.leases.send_grant(tenant.tenant_id, grant_id, chunk, fds, fd_index)
        return {
            "grant_id": grant_id,
            "pages": [[lp, page_ids[i * nseg : (i + 1) * nseg]] for i, lp in enumerate(wanted)],
        }

    def _check_grow(self, tenant: Tenant, wanted: list[int]) -> None:
        if tenant.state != "active":
            raise Asleep(f"tenant {tenant.name!r} is {tenant.state}; wake it first")
        if tenant.pending_sleep is not None:
            raise Asleep(f"tenant {tenant.name!r} is going to sleep")
        if not tenant.leased:
            raise Conflict(f"tenant {tenant.name!r} has not attached its handle channel")
        held = [lp for lp in wanted if lp in tenant.logical]
        if held:
            raise BadRequest(f"logical pages {held[:8]} are already mapped")
        new_bytes = tenant.mapped_bytes + len(wanted) * tenant.logical_page_bytes
        if new_bytes > tenant.max_bytes:
            raise OverLimit(
                f"tenant {tenant.name!r} would hold {new_bytes} bytes, over its limit of "
                f"{tenant.max_bytes}"
            )
        if len(wanted) * tenant.spec.num_segments > self.pool.num_free:
            raise NoMemory(
                f"{len(wanted)} logical pages need {len(wanted) * tenant.spec.num_segments} "
                f"pages, {self.pool.num_free} free"
            )

    def _export(self, pages: list[PhysicalPage]) -> list[tuple[int, list[int], list[int]]]:
        """Export ``pages`` in frames of at most ``MAX_FDS_PER_FRAME`` pages.

        Returns ``(first page index, fds, fd index per page)`` per frame. On a
        backend error or an ``OSError`` (out of fds: ``EMFILE``) the pages go
        back to the pool and no fd is left open.
        """
        frames: list[tuple[int, list[int], list[int]]] = []
        try:
            for start in range(0, len(pages), MAX_FDS_PER_FRAME):
                fds, fd_index = self.pool.backend.export_pages(pages[start : start + MAX_FDS_PER_FRAME])
                frames.append((start, fds, fd_index))
        except (BackendError, OSError):
            for _, fds, _ in frames:
                for fd in fds:
                    os.close(fd)
            self.pool.free([p.page_id for p in pages])
            raise
        return frames

    def shrink(self, tenant: Tenant, wanted: list[int]) -> dict[str, Any]:
        """Take back ``wanted`` logical pages (unmapped by the tenant); all or nothing."""
        missing = [lp for lp in wanted if lp not in tenant.logical]
        if missing:
            raise BadRequest(f"logical pages {missing[:8]} are not mapped for {tenant.name!r}")
        for lp in wanted:
            self.pool.free([p.page_id for p in tenant.logical[lp]])
            del tenant.logical[lp]
        tenant.touch()
        if self.on_shrink is not None:
            self.on_shrink(len(wanted) * tenant.spec.num_segments)
        return {"num_released": len(wanted), "mapped_bytes": tenant.mapped_bytes}

    def release_all(self, tenant: Tenant) -> int:
        """Give every page ``tenant`` holds back to the pool; return how many went."""
        num_pages = 0
        for pages in tenant.logical.values():
            self.pool.free([p.page_id for p in pages])
            num_pages += len(pages)
        tenant.logical.clear()
        return num_pages

    def ask_back_excess(self, tenant: Tenant) -> None:
        """Ask a tenant over its limit to return the logical pages above it."""
        excess = tenant.mapped_bytes - tenant.max_bytes
        if excess > 0 and tenant.leased:
            num_pages = -(-excess // tenant.logical_page_bytes)
            self.leases.send_notice(
                tenant.tenant_id,
                {"notice": "reclaim", "args": {"tenant": tenant.name, "num_pages": num_pages}},
            )
