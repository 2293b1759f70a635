"""The physical pages of one device: a free stack and who owns each page.

``DevicePages`` hands out page ids in ``[0, num_pages)`` and creates the backend page
only when it is granted (on CUDA that is when device memory is taken), and
releases it when it comes back.

Invariants (``check`` asserts them):

- every page id is either on the free stack or owned by exactly one
  ``(tenant_id, segment, logical_page)``;
- ``num_free + num_owned == num_pages``.

Cost: ``alloc`` and ``free`` are O(1) per page plus one backend create/release.
"""

from __future__ import annotations

import logging
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

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.num_pages = backend.num_pages
        self.page_size_bytes = backend.page_size_bytes
        # Pop from the end: low page ids go out first, which keeps tests readable.
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))
        self._owners: dict[int, Owner] = {}
        self._pages: dict[int, PhysicalPage] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity_bytes(self) -> int:
        return self.num_pages * self.page_size_bytes

    @property
    def free_bytes(self) -> int:
        return len(self._free) * self.page_size_bytes

    def alloc(self, owners: list[Owner]) -> list[PhysicalPage]:
        """Create one page per owner; all or nothing.

        Raises ``NoMemory`` when fewer than ``len(owners)`` pages are free, and
        re-raises ``BackendError`` after undoing any pages already created.
        """
        if len(owners) > len(self._free):
            raise NoMemory(f"{len(owners)} pages wanted, {len(self._free)} free")
        pages: list[PhysicalPage] = []
        try:
            for owner in owners:
                page_id = self._free.pop()
                try:
                    page = self.backend.create_page(page_id)
                except BackendError:
                    self._free.append(page_id)
                    raise
                self._pages[page_id] = page
                self._owners[page_id] = owner
                pages.append(page)
        except BackendError:
            self.free([p.page_id for p in pages])
            raise
        return pages

    def free(self, page_ids: list[int]) -> None:
        """Release owned pages back to the backend and the free stack."""
        for page_id in page_ids:
            page = self._pages.pop(page_id)
            del self._owners[page_id]
            try:
                self.backend.release_page(page)
            except BackendError as exc:  # the page stays usable; only its memory was not given back
                log.error("releasing page %d failed: %s", page_id, exc)
            self._free.append(page_id)

    def page(self, page_id: int) -> PhysicalPage:
        return self._pages[page_id]

    def owner(self, page_id: int) -> Owner | None:
        return self._owners.get(page_id)

    def check(self) -> None:
        """Assert the pool's invariants. O(num_pages)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free stack twice"
        assert not free & self._owners.keys(), "a page is both free and owned"
        assert len(free) + len(self._owners) == self.num_pages, "a page is lost"
        assert self._owners.keys() == self._pages.keys(), "owner and page tables disagree"
        assert len(set(self._owners.values())) == len(self._owners), "two pages, one owner slot"
