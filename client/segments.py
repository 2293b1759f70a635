"""``SegmentMap``: a pool's reserved ranges and which physical pages back them.

A pool has ``num_segments`` segments, each one reserved range of
``num_virtual_pages`` pages. Logical page p is the p-th page of every segment
at once, so mapping it maps one physical page into each segment. This is the
one place that maps and unmaps: grow, page returns, sleep, wake and the restart
hand-over all go through it.

Invariants: ``pages[lp]`` holds one page per segment exactly while logical page
lp is mapped in every segment; a failed map leaves nothing half-mapped, but for
the slots whose rollback the OS or driver refused too: their logical pages go
to ``stuck`` (some slot may map them still), out of the table, never released
nor given back while the ranges live, and unmapped again by ``unmap_stuck``.

Cost: one backend map per run of consecutive logical pages and segment
(`map_many`: a grant, a wake; `map`: one page per segment); one backend unmap per run
of consecutive logical pages and segment (`unmap_pages`, `drop_pages`, `unmap_all`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvdaemon.cuda_vmm.backend import Backend, PhysicalPage, unmap_slots
from kvdaemon.errors import BackendError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvdaemon.client.pool")


class SegmentMap:
    """Reserved ranges and the page table of one pool (see the module docstring)."""

    def __init__(self, backend: Backend, num_segments: int, num_virtual_pages: int, page_bytes: int) -> None:
        self.backend = backend
        self.num_segments = num_segments
        self.num_virtual_pages = num_virtual_pages
        self.page_bytes = page_bytes
        self.bases: list[int] = []
        self.pages: dict[int, list[PhysicalPage]] = {}
        self.stuck: dict[int, list[PhysicalPage]] = {}  # a failed map's pages it could not unmap (see above)
        self.num_held_mappings = 0  # of the process's cap, for pages to map back (``hold``)

    def reserve(self) -> None:
        """Reserve one range per segment; all or nothing."""
        span = self.num_virtual_pages * self.page_bytes
        try:
            for _ in range(self.num_segments):
                self.bases.append(self.backend.reserve(span))
        except BackendError:
            self.free_ranges()
            raise

    def free_ranges(self) -> None:
        """Give the ranges back (and any hold); every page must be unmapped first. A range
        whose pages the OS would not unmap (``stuck``, or still in the table) cannot go: it is
        kept (logged), the others go."""
        self.release_hold()
        for base in self.bases:
            try:
                self.backend.free_range(base)
            except BackendError as exc:
                if not (self.stuck or self.pages):
                    raise
                log.error("a range at %#x keeps pages the OS would not unmap; it stays reserved (%s)", base, exc)
        self.bases.clear()

    def view(self, segment: int, size_bytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor over the first ``size_bytes`` of a segment (fixed address)."""
        return self.backend.tensor(self.bases[segment], size_bytes, dtype)

    def mappable_pages(self) -> int:
        """Logical pages this process may still map (``Backend.mappable_pages``). O(1)."""
        return self.backend.mappable_pages() // self.num_segments

    def mappings_made(self) -> int:
        """The OS mappings the mapped pages would add to the bare ranges whatever pages they were:
        per range its runs of unmapped pages and its mapped pages, less the one a bare range is (the
        kernel merges pages that follow each other in one file into fewer, but a wake maps pages
        the daemon restored into, which need not). What a sleeper holds for its wake. O(p log p)."""
        mapped = sorted(self.pages)
        if not mapped:
            return 0
        num_runs = sum(1 for before, after in zip(mapped, mapped[1:]) if after > before + 1)
        num_runs += (mapped[0] > 0) + (mapped[-1] < self.num_virtual_pages - 1)  # before the first, after the last
        return self.num_segments * (len(mapped) + num_runs - 1)

    def hold(self, num_mappings: int) -> None:
        """Keep ``num_mappings`` of the process's cap for pages to map back (``Backend.hold_mappings``)."""
        self.backend.hold_mappings(num_mappings)
        self.num_held_mappings += num_mappings

    def release_hold(self) -> None:
        """Give back what ``hold`` kept, before mapping those pages back or dropping them."""
        self.backend.release_mappings(self.num_held_mappings)
        self.num_held_mappings = 0

    def map(self, lp: int, pages: list[PhysicalPage]) -> None:
        """Map one page per segment at logical page ``lp``; on error nothing stays mapped (but
        slots whose unmap is refused too: ``lp`` is then ``stuck``)."""
        offset = lp * self.page_bytes
        done = 0
        try:
            for base, page in zip(self.bases, pages):
                self.backend.map_page(base + offset, page)
                done += 1
        except BackendError:
            for base in self.bases[:done]:
                unmap_slots(self.backend, base + offset, 1)
            self._keep_stuck({lp: pages})
            raise
        self.pages[lp] = pages

    def map_many(self, pages: dict[int, list[PhysicalPage]]) -> None:
        """Map every logical page of ``pages`` (one page per segment each), all or nothing: on
        ``BackendError`` none of them stays mapped.

        Cost: one ``Backend.map_pages`` per run of consecutive logical pages and segment
        (on the host one ``mmap`` per run whose pages also follow each other in the file)."""
        done: list[tuple[int, list[int]]] = []  # (segment, run of logical pages) mapped so far
        try:
            for run in _runs(sorted(pages)):
                for segment, base in enumerate(self.bases):
                    self.backend.map_pages(base + run[0] * self.page_bytes, [pages[lp][segment] for lp in run])
                    done.append((segment, run))
        except BackendError:
            for segment, run in done:
                unmap_slots(self.backend, self.bases[segment] + run[0] * self.page_bytes, len(run))
            self._keep_stuck(pages)
            raise
        self.pages.update(pages)

    def _keep_stuck(self, pages: dict[int, list[PhysicalPage]]) -> None:
        """After a failed map and its rollback: move to ``stuck`` the logical pages of ``pages``
        that some slot still maps (the OS or driver refused their unmap). O(pages x segments)."""
        for lp, lp_pages in pages.items():
            offset = lp * self.page_bytes
            if any(self.backend.is_mapped(base + offset) for base in self.bases):
                self.stuck[lp] = lp_pages
                log.error("logical page %d could not be unmapped after a failed map: it stays out of the pool "
                          "and is not given back while the pool lives", lp)

    def unmap_stuck(self) -> dict[int, list[PhysicalPage]]:
        """Unmap the slots of ``stuck`` pages still mapped; return the logical pages now wholly
        unmapped (handles kept: the caller releases them and gives them back). O(stuck x segments)."""
        freed: dict[int, list[PhysicalPage]] = {}
        for lp, pages in list(self.stuck.items()):
            offset = lp * self.page_bytes
            mapped = [base + offset for base in self.bases if self.backend.is_mapped(base + offset)]
            if sum(unmap_slots(self.backend, addr, 1) for addr in mapped) == 0:
                freed[lp] = self.stuck.pop(lp)
        return freed

    def unmap(self, lp: int) -> list[PhysicalPage]:
        """Unmap logical page ``lp`` from every segment; return its pages (handles kept)."""
        offset = lp * self.page_bytes
        for base in self.bases:
            self.backend.unmap(base + offset, self.page_bytes)
        return self.pages.pop(lp)

    def release(self, pages: list[PhysicalPage]) -> None:
        """Release the handles of ``pages`` in one ``Backend.release_pages`` call; every one is
        tried, and the first failure is raised after."""
        failed = self.backend.release_pages(pages)
        if failed:
            raise failed[0][1]

    def unmap_pages(self, lps: Iterable[int]) -> dict[int, list[PhysicalPage]]:
        """Unmap logical pages ``lps`` (each mapped: ``KeyError`` before anything is unmapped
        otherwise) from every segment; return their pages (handles kept), in page order.

        On a backend error the runs this call unmapped are mapped back before it is
        raised, so the table and the mappings still agree (a map back refused too is
        logged).

        Cost: one backend unmap per run of consecutive logical pages and segment
        (a return or a sleep of 1 GiB in 64 KiB pages: 32 calls, not 16,384)."""
        pages = {lp: self.pages[lp] for lp in sorted(set(lps))}
        done: list[tuple[int, list[int]]] = []  # (segment, run of logical pages) unmapped so far
        try:
            for run in _runs(list(pages)):
                for segment, base in enumerate(self.bases):
                    self.backend.unmap(base + run[0] * self.page_bytes, len(run) * self.page_bytes)
                    done.append((segment, run))
        except BackendError:
            self._map_back(done)
            raise
        for lp in pages:
            del self.pages[lp]
        return pages

    def _map_back(self, done: list[tuple[int, list[int]]]) -> None:
        """Map the runs of ``done`` back with the pages the table holds (a page refused is logged:
        it stays unmapped in that segment, and touching it faults)."""
        for segment, run in done:
            for lp in run:
                try:
                    self.backend.map_page(self.bases[segment] + lp * self.page_bytes, self.pages[lp][segment])
                except BackendError as exc:
                    log.error("logical page %d of segment %d could not be mapped back (%s)", lp, segment, exc)

    def drop_pages(self, lps: Iterable[int]) -> None:
        """Unmap logical pages ``lps`` (as ``unmap_pages``) and release their handles (one call)."""
        self.release([page for pages in self.unmap_pages(lps).values() for page in pages])

    def unmap_all(self) -> dict[int, list[PhysicalPage]]:
        """Unmap every logical page; return them all (handles kept) for a remap or a release."""
        return self.unmap_pages(self.pages)

    def move(self, lp: int, fresh: list[PhysicalPage], staging: int) -> None:
        """Replace ``lp``'s pages by ``fresh`` ones holding the same bytes (a restart hand-over).

        Each fresh page is mapped at the one-page ``staging`` range, filled from
        the old page, then swapped in at the segment's address; the old page is
        released. The logical page is unmapped only between the unmap and map
        of one segment, so callers hold the engine between steps meanwhile.
        """
        import torch

        offset = lp * self.page_bytes
        for base, old, new in zip(self.bases, self.pages[lp], fresh):
            self.backend.map_page(staging, new)
            target = self.backend.tensor(staging, self.page_bytes, torch.uint8)
            target.copy_(self.backend.tensor(base + offset, self.page_bytes, torch.uint8))
            self.backend.unmap(staging, self.page_bytes)
            self.backend.unmap(base + offset, self.page_bytes)
            self.backend.map_page(base + offset, new)
            self.backend.release_page(old)
        self.pages[lp] = fresh


def _runs(lps: list[int]) -> list[list[int]]:
    """Sorted ``lps`` cut into runs of consecutive logical pages. O(n)."""
    runs: list[list[int]] = []
    for lp in lps:
        if runs and runs[-1][-1] + 1 == lp:
            runs[-1].append(lp)
        else:
            runs.append([lp])
    return runs
