"""Grants: logical pages in and out of a tenant, with their fds on the handle channel.

``grow`` asks for up to ``len(candidates)`` logical pages, at least
``min_pages``: it checks everything first (state, lease, pages already held),
then grants the first n candidates, where n is as many as the tenant's limit,
the free pages and one handle frame (``max_grant_pages``) allow, or raises (``OverLimit``/``NoMemory``, nothing
changed) when that is fewer than ``min_pages``. A grow *ahead of need*
(``ahead``: a pool mapping its engine's speculative floor) may take only the
free pages ``Shares.free_for_ahead`` leaves it. A grant takes one physical page
per segment for each logical page, exports them in frames of at most
``MAX_FDS_PER_FRAME`` pages and queues the frames to the tenant before the
reply goes out. ``shrink`` gives pages back. Each succeeds whole or changes
nothing.

Cost: O(pages) plus one backend create/export (grow) or release (shrink) per page.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from typing import Any

from kvdaemon.cuda_vmm.backend import PhysicalPage
from kvdaemon.daemon.device_pages import Owner, DevicePages
from kvdaemon.daemon.ports import LeasePort
from kvdaemon.daemon.shares import Shares
from kvdaemon.daemon.tenant import Tenant, TenantState
from kvdaemon.errors import Asleep, BackendError, BadRequest, Conflict, NoMemory, OverLimit
from kvdaemon.wire.handles import MAX_FDS_PER_FRAME, max_grant_pages


class Grants:
    """Grow and shrink of tenants over one ``DevicePages``."""

    def __init__(
        self,
        pages: DevicePages,
        leases: LeasePort,
        on_grant: Callable[[float, int], None] | None = None,
        on_shrink: Callable[[int], None] | None = None,
        shares: Shares | None = None,
    ) -> None:
        self.pages = pages
        self.shares = shares
        self.leases = leases
        self.on_grant = on_grant
        self.on_shrink = on_shrink
        self._next_grant_id = 1

    def grow(
        self, tenant: Tenant, candidates: list[int], min_pages: int, now: float, ahead: bool = False
    ) -> dict[str, Any]:
        """Grant the first n of ``candidates``, ``min_pages <= n``, as many as fit; or raise."""
        started = time.perf_counter()
        num_pages = self.num_grantable(tenant, candidates, min_pages, now, ahead)
        result = self.grant(tenant, candidates[:num_pages], now)
        tenant.note_grown(num_pages)
        if self.on_grant is not None:
            self.on_grant(time.perf_counter() - started, num_pages * tenant.spec.num_segments)
        return result

    def grant(self, tenant: Tenant, wanted: list[int], now: float) -> dict[str, Any]:
        """Take pages for ``wanted`` and queue their fds to the tenant; no limit checks.
        Raises ``NoMemory`` (nothing taken) when the pool is short."""
        return self.send(tenant, wanted, self.take(tenant, wanted, now))

    def take(self, tenant: Tenant, wanted: list[int], now: float, overwrite: bool = False) -> list[PhysicalPage]:
        """Pages for ``wanted``, the tenant's from now on, not yet sent (``send``); ``NoMemory``
        (nothing taken) when the pool is short.

        ``overwrite``: the caller writes every byte of the pages before they are
        sent (a warm wake), so they need not read zero.
        """
        nseg, num_wanted = tenant.spec.num_segments, len(wanted)
        by_segment = self.pages.alloc(  # each segment's pages in logical page order: runs in the file
            [Owner(tenant.tenant_id, seg, lp) for seg in range(nseg) for lp in wanted], overwrite)
        pages = [by_segment[seg * num_wanted + i] for i in range(num_wanted) for seg in range(nseg)]
        for i, lp in enumerate(wanted):
            tenant.logical[lp] = pages[i * nseg : (i + 1) * nseg]
        tenant.touch(now)
        return pages

    def send(self, tenant: Tenant, wanted: list[int], pages: list[PhysicalPage]) -> dict[str, Any]:
        """Queue the fds of ``pages`` (``take``'s for ``wanted``) to the tenant under a new
        grant id. Failing to export them (``BackendError``, ``OSError``), they go back to the
        pool, out of the tenant's pages, and the error is raised."""
        try:
            frames = self._export(pages)
        except (BackendError, OSError):
            for lp in wanted:
                del tenant.logical[lp]
            raise
        tenant.note_mapped()
        grant_id = self._next_grant_id
        self._next_grant_id += 1
        page_ids = [p.page_id for p in pages]
        nseg = tenant.spec.num_segments
        for start, fds, fd_index in frames:
            chunk = page_ids[start : start + len(fd_index)]
            self.leases.send_grant(tenant.tenant_id, grant_id, chunk, fds, fd_index)
        return {
            "grant_id": grant_id,
            "pages": [[lp, page_ids[i * nseg : (i + 1) * nseg]] for i, lp in enumerate(wanted)],
            "max_bytes": tenant.max_bytes,
        }

    def num_grantable(
        self, tenant: Tenant, candidates: list[int], min_pages: int, now: float, ahead: bool = False
    ) -> int:
        """How many of ``candidates`` a grow may grant now, at least ``min_pages``; else raise.

        ``OverLimit`` when the tenant's limit allows fewer than ``min_pages``,
        ``NoMemory`` when the free pages do (less those held for short tenants
        below their share, ``Shares.free_for``, past this tenant's own share;
        ``ahead``: less the low-water pages too, ``Shares.free_for_ahead``);
        ``Asleep``/``Conflict``/``BadRequest`` for a tenant that may not grow or
        pages it already holds.
        """
        self._check_grower(tenant)
        held = [lp for lp in candidates if lp in tenant.logical]
        if held:
            raise BadRequest(f"logical pages {held[:8]} are already mapped")
        by_limit = self._by_limit(tenant, min_pages)
        cap = max_grant_pages(tenant.spec.num_segments)  # the reply fits in one handle frame
        if min_pages > cap:
            raise BadRequest(f"a grow may ask for at most {cap} logical pages at least, got {min_pages}")
        num_free = self.pages.num_free
        fits_free = num_free // tenant.spec.num_segments >= min_pages  # shares only hold pages back:
        if self.shares is not None and fits_free and ahead:  # O(tenants), so asked only where it decides
            num_free = self.shares.free_for_ahead(tenant, num_free, now)
        elif self.shares is not None and fits_free:
            num_free = self.shares.free_for(tenant, num_free, now)
        by_free = num_free // tenant.spec.num_segments
        if by_free < min_pages:
            held = ""
            if ahead:
                held = " (a grow ahead of need takes none of the low-water pages nor those held for short tenants)"
            elif num_free != self.pages.num_free:
                held = f" ({self.pages.num_free - num_free} held for tenants short below their share)"
            raise NoMemory(
                f"{min_pages} logical page(s) need {min_pages * tenant.spec.num_segments} "
                f"pages, {self.pages.num_free} free{held}"
            )
        return min(len(candidates), by_limit, by_free, cap)

    def check_may_fit(self, tenant: Tenant, min_pages: int) -> None:
        """Raise what ``num_grantable`` would, where O(1) says so: ``Asleep``/``Conflict``,
        ``OverLimit``, or ``NoMemory`` when even every free page is fewer than ``min_pages``
        need (a parked grow's retry, before its O(candidates) attempt)."""
        self._check_grower(tenant)
        self._by_limit(tenant, min_pages)
        need = min_pages * tenant.spec.num_segments
        if self.pages.num_free < need:
            raise NoMemory(f"{min_pages} logical page(s) need {need} pages, {self.pages.num_free} free")

    @staticmethod
    def _check_grower(tenant: Tenant) -> None:
        """``Asleep``/``Conflict`` for a tenant that may not grow now. O(1)."""
        if tenant.state is not TenantState.ACTIVE:
            raise Asleep(f"tenant {tenant.name!r} is {tenant.state.value}; wake it first")
        if tenant.pending_sleep is not None:
            raise Asleep(f"tenant {tenant.name!r} is going to sleep")
        if not tenant.leased:
            raise Conflict(f"tenant {tenant.name!r} has not attached its handle channel")

    @staticmethod
    def _by_limit(tenant: Tenant, min_pages: int) -> int:
        """Logical pages ``tenant``'s limit lets it add; ``OverLimit`` when fewer than ``min_pages``. O(1)."""
        by_limit = max(0, tenant.max_bytes - tenant.mapped_bytes) // tenant.logical_page_bytes
        if by_limit < min_pages:
            raise OverLimit(
                f"tenant {tenant.name!r} holds {tenant.mapped_bytes} bytes; {min_pages} more "
                f"logical page(s) of {tenant.logical_page_bytes} would pass its limit of "
                f"{tenant.max_bytes}"
            )
        return by_limit

    def _export(self, pages: list[PhysicalPage]) -> list[tuple[int, list[int], list[int]]]:
        """Export ``pages`` in frames of at most ``MAX_FDS_PER_FRAME`` pages.

        Returns ``(first page index, fds, fd index per page)`` per frame. On a
        backend error or an ``OSError`` (out of fds: ``EMFILE``, raised as a
        ``BackendError`` named by its errno) the pages go back to the pool and
        no fd is left open.
        """
        frames: list[tuple[int, list[int], list[int]]] = []
        try:
            for start in range(0, len(pages), MAX_FDS_PER_FRAME):
                fds, fd_index = self.pages.backend.export_pages(pages[start : start + MAX_FDS_PER_FRAME])
                frames.append((start, fds, fd_index))
        except (BackendError, OSError) as exc:
            for _, fds, _ in frames:
                for fd in fds:
                    os.close(fd)
            self.pages.free([p.page_id for p in pages])
            if isinstance(exc, OSError):  # a stable code for the tenant: out of fds, say so
                raise BackendError(f"the daemon could not export page fds: {exc.strerror}",
                                   errno.errorcode.get(exc.errno or 0)) from exc
            raise
        return frames

    def shrink(self, tenant: Tenant, wanted: list[int], now: float) -> dict[str, Any]:
        """Take back ``wanted`` logical pages (unmapped by the tenant); all or nothing. Refused
        (``Asleep``) while its pages are copied for a warm sleep or wake (``Tenant.copying``)."""
        if tenant.copying:
            raise Asleep(f"tenant {tenant.name!r} is {tenant.copying}: its pages stay until that ends")
        missing = [lp for lp in wanted if lp not in tenant.logical]
        if missing:
            raise BadRequest(f"logical pages {missing[:8]} are not mapped for {tenant.name!r}")
        self.pages.free([p.page_id for lp in wanted for p in tenant.logical[lp]])  # one call: runs at once
        for lp in wanted:
            del tenant.logical[lp]
        tenant.touch(now)
        tenant.note_shrunk(len(wanted))
        if self.on_shrink is not None:
            self.on_shrink(len(wanted) * tenant.spec.num_segments)
        return {"num_released": len(wanted), "mapped_bytes": tenant.mapped_bytes}

    def release_all(self, tenant: Tenant, keep_until: float | None = None) -> int:
        """Give every page ``tenant`` holds back to the pool; return how many went.

        ``keep_until``: the pool may keep them idle until then (``DevicePages.free``)."""
        page_ids = [page.page_id for pages in tenant.logical.values() for page in pages]
        self.pages.free(page_ids, keep_until)  # one call: the backend releases runs at once
        tenant.logical.clear()
        return len(page_ids)

