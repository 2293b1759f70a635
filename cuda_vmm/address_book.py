"""Bookkeeping of reserved ranges and mapped slots, shared by every backend.

The book is the single place that decides whether an address or size is valid
before a backend touches the OS or the driver, so both backends refuse bad
input with the same messages.

Invariants: ranges never overlap; every mapped slot lies inside exactly one
range; a range's ``num_mapped`` equals the mapped slots inside it;
``num_mappings`` is each range's runs of unmapped slots plus its mapped slots:
the OS mappings (Linux VMAs) the ranges make where no two mapped slots merge (a
test holds it to ``/proc/self/maps``). The kernel merges neighbours whose pages
follow each other in one file, so it is never fewer than the OS counts, and it
never rises on an unmap, though the OS count does where an unmap splits a merged
mapping: a cap on it bounds the OS count after any unmap too. Linux caps a process's mappings
(``vm.max_map_count``), and a map past the cap fails and leaves the process
unable to map anything (no thread, no ``malloc`` of a large block), so a backend
that makes one mapping per slot passes ``max_mappings`` to ``mark_mapped``.
Cost: finding a slot's range is O(log R) (bisect over R range starts); marking a
slot mapped or unmapped is O(1).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvdaemon.cuda_vmm.backend import Backend, PhysicalPage, unmap_slots
from kvdaemon.errors import BackendError

log = logging.getLogger("kvdaemon.cuda_vmm")


@dataclass(slots=True)
class _Range:
    start: int
    size_bytes: int
    num_mapped: int = 0

    @property
    def end(self) -> int:
        return self.start + self.size_bytes


class AddressBook:
    """Reserved ranges and the page mapped at each slot, for one backend."""

    def __init__(self, page_size_bytes: int) -> None:
        self.page_size_bytes = page_size_bytes
        self._starts: list[int] = []
        self._ranges: dict[int, _Range] = {}
        self._mapped: dict[int, tuple[PhysicalPage, _Range]] = {}
        self._last: _Range = _Range(0, 0)  # the range found last: most calls hit it again
        self.num_mappings = 0  # OS mappings the ranges make at most (see the module docstring)

    def check_size(self, size_bytes: int) -> None:
        """Raise unless ``size_bytes`` is a positive multiple of the page size."""
        if not isinstance(size_bytes, int) or size_bytes <= 0:
            raise BackendError(f"size must be a positive number of bytes, got {size_bytes!r}")
        if size_bytes % self.page_size_bytes:
            raise BackendError(
                f"size {size_bytes} is not a multiple of the page size {self.page_size_bytes}"
            )

    def add_range(self, start: int, size_bytes: int) -> None:
        """Record a new reservation at ``start``."""
        bisect.insort(self._starts, start)
        self._ranges[start] = _Range(start, size_bytes)
        self.num_mappings += 1

    def remove_range(self, start: int) -> int:
        """Forget the range starting at ``start``; return its size. It must be unmapped."""
        rng = self._ranges.get(start)
        if rng is None:
            raise BackendError(f"address {start:#x} is not the start of a reserved range")
        if rng.num_mapped:
            raise BackendError(
                f"range at {start:#x} still has {rng.num_mapped} mapped page(s); unmap them first"
            )
        del self._ranges[start]
        self._starts.remove(start)
        self.num_mappings -= 1
        if self._last is rng:
            self._last = _Range(0, 0)
        return rng.size_bytes

    def range_starts(self) -> list[int]:
        """Starts of every live range, ascending."""
        return list(self._starts)

    def _range_of(self, addr: int) -> _Range:
        if addr % self.page_size_bytes:
            raise BackendError(
                f"address {addr:#x} is not aligned to the page size {self.page_size_bytes}"
            )
        return self._containing(addr)

    def _containing(self, addr: int) -> _Range:
        rng = self._last
        if rng.start <= addr < rng.start + rng.size_bytes:
            return rng
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0:
            rng = self._ranges[self._starts[i]]
            if addr < rng.start + rng.size_bytes:
                self._last = rng
                return rng
        raise BackendError(f"address {addr:#x} is not inside a reserved range")

    def mark_mapped(self, addr: int, page: PhysicalPage, max_mappings: int | None = None) -> None:
        """Check ``addr`` is a free slot and record ``page`` there; refuse it when the ranges
        would then make more than ``max_mappings`` OS mappings (``None``: no cap)."""
        if addr in self._mapped:
            raise BackendError(f"address {addr:#x} is already mapped; unmap it first")
        rng = self._range_of(addr)
        num_split = self._unmapped_neighbours(addr, rng)
        if max_mappings is not None and num_split and self.num_mappings + num_split > max_mappings:
            raise BackendError(
                f"mapping a page at {addr:#x} would make {self.num_mappings + num_split} memory mappings, past "
                f"the {max_mappings} this process may use (vm.max_map_count less a share for the rest of the "
                f"process): raise vm.max_map_count (sysctl) or use a larger page size"
            )
        self._mapped[addr] = (page, rng)
        rng.num_mapped += 1
        self.num_mappings += num_split

    def unmark_mapped(self, addr: int) -> PhysicalPage:
        """Forget the page mapped at ``addr``; it must be mapped."""
        entry = self._mapped.pop(addr, None)
        if entry is None:
            self._range_of(addr)  # a misaligned or foreign address says so
            raise BackendError(f"address {addr:#x} is not mapped")
        page, rng = entry
        rng.num_mapped -= 1
        self.num_mappings -= self._unmapped_neighbours(addr, rng)
        return page

    def _unmapped_neighbours(self, addr: int, rng: _Range) -> int:
        """How many of slot ``addr``'s two neighbours in ``rng`` are unmapped: what mapping it adds
        to ``num_mappings`` (a page splitting a run of reservation, ending one, or filling a
        one-slot gap), and what unmapping it takes away. O(1)."""
        page = self.page_size_bytes
        left = addr - page
        right = addr + page
        return ((left >= rng.start and left not in self._mapped)
                + (right < rng.start + rng.size_bytes and right not in self._mapped))

    def slots(self, addr: int, size_bytes: int) -> Iterator[int]:
        """Every slot address in ``[addr, addr + size_bytes)``, checked mapped first."""
        self.check_size(size_bytes)
        end = addr + size_bytes
        rng = self._range_of(addr)
        if end > rng.start + rng.size_bytes:
            raise BackendError(f"range [{addr:#x}, {end:#x}) runs past its reservation")
        for slot in range(addr, end, self.page_size_bytes):
            if slot not in self._mapped:
                raise BackendError(f"address {slot:#x} is not mapped")
        return iter(range(addr, end, self.page_size_bytes))

    def check_view(self, addr: int, size_bytes: int) -> None:
        """Raise unless ``[addr, addr + size_bytes)`` lies inside one reserved range.

        A view may span unmapped slots: touching those faults, as with CUDA.
        """
        if not isinstance(size_bytes, int) or size_bytes <= 0:
            raise BackendError(f"view size must be a positive number of bytes, got {size_bytes!r}")
        rng = self._containing(addr)
        if addr + size_bytes > rng.start + rng.size_bytes:
            raise BackendError(f"view of {size_bytes} bytes at {addr:#x} runs past its reservation")

    def mapped_in(self, start: int) -> list[int]:
        """Mapped slot addresses of the range starting at ``start``."""
        rng = self._ranges[start]
        end = start + rng.size_bytes
        return [a for a in self._mapped if start <= a < end]

    def handles_in_use(self) -> set[Any]:
        """The handles of every mapped page. O(mapped slots)."""
        return {page.handle for page, _ in self._mapped.values()}

    def is_mapped(self, addr: int) -> bool:
        """True while a page is mapped at slot ``addr``. O(1)."""
        return addr in self._mapped

    def page_at(self, addr: int) -> PhysicalPage:
        """The page mapped at slot ``addr``; raises if none is."""
        entry = self._mapped.get(addr)
        if entry is None:
            raise BackendError(f"address {addr:#x} is not mapped")
        return entry[0]


def free_every_range(backend: Backend, book: AddressBook) -> None:
    """Unmap every mapped slot of ``book``'s ranges and free the ranges (a backend's close),
    past refusals: a range keeping a slot the OS or driver would not unmap stays reserved
    (logged), the others go. Cost: one unmap call per mapped slot, one free per range."""
    for start in book.range_starts():
        num_left = sum(unmap_slots(backend, addr, 1) for addr in book.mapped_in(start))
        if num_left:
            log.error("%s backend: %d page(s) of the range at %#x could not be unmapped; it stays reserved",
                      backend.name, num_left, start)
            continue
        backend.free_range(start)
