"""Warm sleep storage: a sleeping tenant's page bytes, held in host memory.

``save`` copies every physical page of a tenant (logical page by logical page,
segment by segment) into one anonymous host mapping, so that the memory goes
back to the OS as soon as ``discard`` closes it. ``restore`` copies the bytes
into fresh pages in the same order, so a woken tenant sees every byte where it
was. On CUDA the copies go through the backend's staging slot
(``cuMemcpyDtoH``/``HtoD``).

Cost: one page-sized copy per physical page each way; host memory equal to the
tenant's mapped bytes while it sleeps.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

from kvdaemon.cuda_vmm.backend import Backend, PhysicalPage


class BufferCache:
    """Host buffers of finished warm copies, kept for the next sleep of the same size.

    Fresh memory costs a page fault per 4 KiB on first touch, often more than
    the copy itself; a reused buffer is already backed. At most
    ``max_bytes`` are kept; the rest go back to the OS.
    """

    def __init__(self, max_bytes: int, backend: Backend) -> None:
        self.max_bytes = max_bytes
        self.backend = backend
        self._buffers: list[mmap.mmap] = []

    @property
    def cached_bytes(self) -> int:
        return sum(len(b) for b in self._buffers)

    def take(self, size: int) -> mmap.mmap:
        for i, buffer in enumerate(self._buffers):
            if len(buffer) == size:
                return self._buffers.pop(i)
        buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            buffer.madvise(mmap.MADV_HUGEPAGE)  # fewer page faults where THP is on
        self.backend.pin_host(memoryview(buffer))  # page-locked on CUDA: DMA straight in
        return buffer

    def give(self, buffer: mmap.mmap) -> None:
        if self.cached_bytes + len(buffer) <= self.max_bytes:
            self._buffers.append(buffer)
        else:
            self._close(buffer)

    def clear(self) -> None:
        while self._buffers:
            self._close(self._buffers.pop())

    def _close(self, buffer: mmap.mmap) -> None:
        view = memoryview(buffer)
        self.backend.unpin_host(view)
        view.release()
        buffer.close()


@dataclass
class WarmCopy:
    """The saved bytes of one tenant: logical page order and one host buffer."""

    logical_pages: list[int]
    num_segments: int
    buffer: mmap.mmap
    cache: BufferCache

    @property
    def host_bytes(self) -> int:
        return len(self.buffer)

    def discard(self) -> None:
        self.cache.give(self.buffer)


def save(
    backend: Backend, logical: dict[int, list[PhysicalPage]], num_segments: int, cache: BufferCache
) -> WarmCopy:
    """Copy the pages of ``logical`` (``{lp: [page per segment]}``) into host memory."""
    page_bytes = backend.page_size_bytes
    order = sorted(logical)
    size = max(1, len(order) * num_segments * page_bytes)
    buffer = cache.take(size)
    view = memoryview(buffer)
    try:
        for i, lp in enumerate(order):
            for seg, page in enumerate(logical[lp]):
                start = (i * num_segments + seg) * page_bytes
                backend.copy_out(page, view[start : start + page_bytes])
    finally:
        view.release()
    return WarmCopy(order, num_segments, buffer, cache)


def restore(backend: Backend, copy: WarmCopy, logical: dict[int, list[PhysicalPage]]) -> None:
    """Copy saved bytes into the fresh pages of ``logical`` (same logical pages as saved)."""
    page_bytes = backend.page_size_bytes
    view = memoryview(copy.buffer)
    try:
        for i, lp in enumerate(copy.logical_pages):
            for seg, page in enumerate(logical[lp]):
                start = (i * copy.num_segments + seg) * page_bytes
                backend.copy_in(page, view[start : start + page_bytes])
    finally:
        view.release()
