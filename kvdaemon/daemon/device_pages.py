"""The physical pages of one device: a free stack and who owns each page.

``DevicePages`` hands out page ids in ``[0, num_pages)`` and creates the backend page
only when it is granted (on CUDA that is when device memory is taken), and
releases it when it comes back.

*Idle* pages: on a backend whose fresh memory costs a fault per 4 KiB on first
touch (``recycles_released_pages``: the host backend), the pages a warm sleep
gives back may be kept created ("idle": free, not yet released) until
``keep_until``, at most ``max_idle`` of them. A grant that will overwrite every
byte (a warm wake's restore: ``alloc(..., overwrite=True)``) takes idle pages
first, so the restore writes into memory already there; any other grant takes
never-touched pages first and releases and re-creates an idle page before
handing it out (fresh pages read zero). ``trim(now)`` releases the idle pages
whose time is up. Idle pages count as free everywhere.

*Retired* pages: a page whose release failed (its memory may still hold an
owner's bytes, or the backend still counts it as created) is never granted
again: it leaves the free stack for good and is logged (``num_retired``).

Invariants (``check`` asserts them):

- every page id is either free (on the free stack, or idle), retired, or
  owned by exactly one ``(tenant_id, segment, logical_page)``;
- ``num_free + num_owned + num_retired == num_pages``.

Cost: ``alloc`` is O(1) per page plus one backend create each; ``free`` O(1) per page plus
one backend ``release_pages`` for them all (on the host one syscall per run of consecutive page
ids: a tenant's pages, granted from a fresh stack, run long).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import NamedTuple

from kvdaemon.cuda_vmm.backend import Backend, PhysicalPage
from kvdaemon.errors import BackendError, NoMemory

log = logging.getLogger("kvdaemon.daemon.device_pages")


class Owner(NamedTuple):
    """Who holds a page: a tenant's segment at one logical page."""

    tenant_id: int
    segment: int
    logical_page: int


class DevicePages:
    """Free stack and owner table over a started backend's ``num_pages`` pages."""

    def __init__(self, backend: Backend, max_idle: int = 0) -> None:
        self.backend = backend
        self.num_pages = backend.num_pages
        self.page_size_bytes = backend.page_size_bytes
        self.max_idle = max_idle if getattr(backend, "recycles_released_pages", False) else 0
        # Pop from the end: low page ids go out first, which keeps tests readable.
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))
        self._idle: OrderedDict[int, tuple[PhysicalPage, float]] = OrderedDict()  # oldest first
        self._owners: dict[int, Owner] = {}
        self._pages: dict[int, PhysicalPage] = {}
        self._retired: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._idle)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    @property
    def num_retired(self) -> int:
        """Pages whose release failed: never granted again (see the module docstring)."""
        return len(self._retired)

    @property
    def capacity_bytes(self) -> int:
        return self.num_pages * self.page_size_bytes

    @property
    def free_bytes(self) -> int:
        return self.num_free * self.page_size_bytes

    def alloc(self, owners: list[Owner], overwrite: bool = False) -> list[PhysicalPage]:
        """One page per owner, in page id order (an owner list of one segment's logical pages in
        order gets pages that follow each other wherever the free ones do: a client maps such a
        run at once); all or nothing. ``overwrite``: the caller writes every byte before anyone
        reads (idle pages first, as they are); else the pages read zero.

        Raises ``NoMemory`` when fewer than ``len(owners)`` pages are free, and
        re-raises ``BackendError`` after undoing any pages already created.
        """
        if len(owners) > self.num_free:
            raise NoMemory(f"{len(owners)} pages wanted, {self.num_free} free")
        pages: list[PhysicalPage] = []
        try:
            for owner in owners:
                page = self._take(overwrite)
                self._pages[page.page_id] = page
                self._owners[page.page_id] = owner
                pages.append(page)
        except (BackendError, NoMemory):
            self.free([p.page_id for p in pages])
            raise
        pages.sort(key=lambda page: page.page_id)  # owners in order get ids in order: runs map at once
        for page, owner in zip(pages, owners):
            self._owners[page.page_id] = owner
        return pages

    def _take(self, overwrite: bool) -> PhysicalPage:
        """A free page: an idle one as it is (``overwrite``), else a created one reading zero.
        ``NoMemory`` when releasing idle pages for it retired the last free ones."""
        while True:
            if self._idle and (overwrite or not self._free):
                page_id, (page, _) = self._idle.popitem(last=False)
                if overwrite:
                    return page
                if self._release([page]):  # its bytes are another owner's: a fresh page instead
                    continue
            elif self._free:
                page_id = self._free.pop()
            else:
                raise NoMemory("the last free pages could not be released; none is left")
            break
        try:
            return self.backend.create_page(page_id)
        except BackendError:
            self._free.append(page_id)
            raise

    def free(self, page_ids: list[int], keep_until: float | None = None) -> None:
        """Give owned pages back: released now, or kept idle until ``keep_until`` where the
        backend gains from it and fewer than ``max_idle`` are idle (see the module docstring)."""
        released: list[PhysicalPage] = []
        for page_id in page_ids:
            page = self._pages.pop(page_id)
            del self._owners[page_id]
            if keep_until is not None and len(self._idle) < self.max_idle:
                self._idle[page_id] = (page, keep_until)
                continue
            released.append(page)
        self._put_back(released)

    def trim(self, now: float) -> int:
        """Release the idle pages kept until ``now`` or earlier; return how many."""
        expired = [page_id for page_id, (_, until) in self._idle.items() if until <= now]
        self._put_back([self._idle.pop(page_id)[0] for page_id in expired])
        return len(expired)

    def _put_back(self, pages: list[PhysicalPage]) -> None:
        """Release ``pages`` onto the free stack, in order; retire those whose release failed."""
        failed = self._release(pages)
        self._free.extend(page.page_id for page in pages if page.page_id not in failed)

    def _release(self, pages: list[PhysicalPage]) -> set[int]:
        """Give ``pages``' memory back (``Backend.release_pages``: one call for them all); retire
        those whose release failed (logged) and return their ids."""
        if not pages:
            return set()
        failed = self.backend.release_pages(pages)
        for page, exc in failed:
            self._retired.add(page.page_id)
            log.error("releasing page %d failed, so it is never granted again: %s", page.page_id, exc)
        return {page.page_id for page, _ in failed}

    def page(self, page_id: int) -> PhysicalPage:
        return self._pages[page_id]

    def owner(self, page_id: int) -> Owner | None:
        return self._owners.get(page_id)

    def check(self) -> None:
        """Assert the pool's invariants. O(num_pages)."""
        free = set(self._free) | self._idle.keys()
        assert len(free) == len(self._free) + len(self._idle), "a page is free twice"
        assert not free & self._owners.keys(), "a page is both free and owned"
        assert not self._retired & (free | self._owners.keys()), "a retired page is free or owned"
        assert len(free) + len(self._owners) + len(self._retired) == self.num_pages, "a page is lost"
        assert self._owners.keys() == self._pages.keys(), "owner and page tables disagree"
        assert len(set(self._owners.values())) == len(self._owners), "two pages, one owner slot"
