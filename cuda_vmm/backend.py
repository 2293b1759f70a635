"""The virtual-memory backend interface shared by the ``cuda`` and ``host`` backends.

A backend separates *virtual* address ranges from *physical* pages:

- ``reserve(size_bytes)`` takes a range of addresses with nothing behind it;
- ``create_page(page_id)`` makes one physical page of ``page_size_bytes``;
- ``map_page(addr, page)`` puts a page behind one page-sized slot of a range,
  readable and writable; ``unmap(addr, size_bytes)`` takes pages away again;
- ``export_page(page)`` gives a file descriptor that another process turns back
  into the same page with ``import_page(fd, page_id)``.

Invariants every backend keeps (and checks, raising ``BackendError``):

- addresses and sizes passed in are multiples of ``page_size_bytes``;
- a slot is mapped at most once; only mapped slots are unmapped;
- ``page_id`` is in ``[0, num_pages)`` on the creating side;
- a range handed back by ``free_range`` has all its slots unmapped first.

The backend tracks its own reservations and mappings in dicts, so every check
is O(1) per page; no call scans a range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

from kvdaemon.errors import BackendError

if TYPE_CHECKING:
    import torch

DEFAULT_PAGE_SIZE_BYTES = 2 * 1024 * 1024
COPY_SLICE_BYTES = 64 << 20  # a step of a daemon's bulk copy on the host: ~8 ms at host memcpy speed


class PhysicalPage(NamedTuple):
    """One physical page as this process sees it (a tuple: cheap to make by the thousand).

    ``page_id`` is the page's index in the creating pool. ``handle`` is the
    backend's own object (host: the fd of the pool file; cuda: a
    ``CUmemGenericAllocationHandle``) and ``offset_bytes`` the page's offset
    within that handle (host: ``page_id * page_size``; cuda: 0).
    """

    page_id: int
    handle: Any
    offset_bytes: int


@dataclass(frozen=True, slots=True)
class MemInfo:
    """Free and total bytes of the device (host: physical RAM)."""

    free_bytes: int
    total_bytes: int


@runtime_checkable
class Backend(Protocol):
    """What the daemon and the client need from a virtual-memory backend."""

    name: str
    device: int
    recycles_released_pages: bool  # True where fresh memory is faulted in on first touch (host)
    copy_slice_bytes: int  # the most one step of a sliced bulk copy moves: as fast per byte as one copy
    page_size_bytes: int
    num_pages: int

    @property
    def granularity_bytes(self) -> int:
        """Smallest size and alignment the backend can map."""
        ...

    def start(self) -> None:
        """Open the device (cuda) or the pool file (host). Idempotent."""
        ...

    def close(self) -> None:
        """Unmap and free every range, release every page created here."""
        ...

    def reserve(self, size_bytes: int) -> int:
        """Reserve ``size_bytes`` of address space; return its page-aligned start."""
        ...

    def free_range(self, addr: int) -> None:
        """Give back a range from ``reserve``; all its slots must be unmapped."""
        ...

    def create_page(self, page_id: int) -> PhysicalPage:
        """Create the physical page ``page_id`` of this pool."""
        ...

    def release_page(self, page: PhysicalPage) -> None:
        """Release a page created or imported here; its memory goes back."""
        ...

    def release_pages(self, pages: list[PhysicalPage]) -> list[tuple[PhysicalPage, BackendError]]:
        """Release every page of ``pages`` as ``release_page`` does; return those whose release
        failed, each with its error (the others are released)."""
        ...

    def export_page(self, page: PhysicalPage) -> int:
        """A new fd for ``page``, owned by the caller (send it, then close it)."""
        ...

    def import_page(self, fd: int, page_id: int) -> PhysicalPage:
        """Turn an exported fd into a page of this process. Takes ownership of fd."""
        ...

    def export_pages(self, pages: list[PhysicalPage]) -> tuple[list[int], list[int]]:
        """Fds for ``pages`` and, per page, the index of the fd that carries it.

        Pages behind one handle (host: the pool file) share one fd, so a grant
        of many pages costs one fd on the host backend and one per page on cuda.
        """
        ...

    def import_pages(
        self, fds: list[int], page_ids: list[int], fd_index: list[int]
    ) -> list[PhysicalPage]:
        """The inverse of ``export_pages`` in another process. Takes ownership of fds."""
        ...

    def mappable_pages(self) -> int:
        """Pages this process may still map before an OS cap on its mappings binds
        (``sys.maxsize`` where none does). O(1)."""
        ...

    def hold_mappings(self, num_mappings: int) -> None:
        """Keep ``num_mappings`` of that cap for pages to map back later (a warm sleeper's)."""
        ...

    def release_mappings(self, num_mappings: int) -> None:
        """Give back what ``hold_mappings`` kept."""
        ...

    def map_page(self, addr: int, page: PhysicalPage) -> None:
        """Map ``page`` read-write at ``addr``, a free slot of a reserved range."""
        ...

    def map_pages(self, addr: int, pages: list[PhysicalPage]) -> None:
        """Map ``pages`` read-write at the consecutive slots from ``addr``, all or nothing: on
        ``BackendError`` the slots it mapped are unmapped again (``unmap_slots``), and only a
        slot whose unmap the OS or driver refuses too stays mapped (``is_mapped`` says which).
        The host backend maps each run of pages that follow each other in one file with one
        ``mmap``; CUDA maps a page at a time and sets the access of the whole run at once."""
        ...

    def unmap(self, addr: int, size_bytes: int) -> None:
        """Unmap every slot in ``[addr, addr + size_bytes)``; each must be mapped. On
        ``BackendError`` every one of them stays mapped."""
        ...

    def is_mapped(self, addr: int) -> bool:
        """True while a page is mapped at slot ``addr`` (as this backend's book says). O(1)."""
        ...

    def tensor(self, addr: int, size_bytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor of ``dtype`` viewing the bytes at ``addr`` (no copy)."""
        ...

    def mem_info(self) -> MemInfo:
        """Free and total bytes of the device."""
        ...

    def prune_imports(self) -> None:
        """Close imported handles no mapped page uses any more (a dead daemon's pool)."""
        ...

    def pin_host(self, buffer: memoryview) -> None:
        """Page-lock a host buffer for fast device copies (cuda); a no-op on the host backend."""
        ...

    def unpin_host(self, buffer: memoryview) -> None:
        """Undo ``pin_host``."""
        ...

    def copy_out(self, page: PhysicalPage, dest: memoryview) -> None:
        """Copy the page's bytes into host memory ``dest`` (``page_size_bytes`` long)."""
        ...

    def copy_in(self, page: PhysicalPage, src: memoryview) -> None:
        """Copy host memory ``src`` (``page_size_bytes`` long) into the page."""
        ...

    def copy_out_pages(self, pages: list[PhysicalPage], dest: memoryview) -> None:
        """Copy pages created here into ``dest``, page i at ``i * page_size_bytes`` (a warm
        sleep: the fastest way the backend has, see each backend's docstring)."""
        ...

    def copy_in_pages(self, pages: list[PhysicalPage], src: memoryview) -> None:
        """Copy ``src`` into pages created here, the inverse of ``copy_out_pages``."""
        ...


def check_bulk_buffer(num_pages: int, host: memoryview, page_size_bytes: int) -> None:
    """``BackendError`` unless ``host`` holds exactly ``num_pages`` pages (``copy_*_pages``)."""
    if len(host) != num_pages * page_size_bytes:
        raise BackendError(
            f"{num_pages} pages need a buffer of {num_pages * page_size_bytes} bytes, got {len(host)}"
        )


def unmap_slots(backend: Backend, addr: int, num_slots: int) -> int:
    """Unmap the ``num_slots`` mapped slots from ``addr``: one ``unmap`` call, and when the
    backend refuses it one call a slot, past refusals. Returns how many slots stay mapped (0
    when all went); the backend's book lists them. What rolls back a map that failed part-way.
    Cost: one call, or ``num_slots`` calls after a refusal."""
    if num_slots <= 0:
        return 0
    page_bytes = backend.page_size_bytes
    try:
        backend.unmap(addr, num_slots * page_bytes)
        return 0
    except BackendError:
        if num_slots == 1:
            return 1
    num_left = 0
    for i in range(num_slots):
        try:
            backend.unmap(addr + i * page_bytes, page_bytes)
        except BackendError:
            num_left += 1
    return num_left

