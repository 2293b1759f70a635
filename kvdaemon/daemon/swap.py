"""Warm sleep storage: a sleeping tenant's page bytes, held in host memory.

``save`` copies every physical page of a tenant (logical page by logical page,
segment by segment) into one anonymous host mapping, so that the memory goes
back to the OS as soon as ``discard`` closes it. ``restore`` copies the bytes
into fresh pages in the same order, so a woken tenant sees every byte where it
was. Both are one bulk copy of the backend (``copy_out_pages``/``copy_in_pages``:
on the host backend ``memmove`` on several threads, on CUDA asynchronous copies
in chunks through page-locked memory).

Host buffers are backed before the copy lands in them (``MADV_POPULATE_WRITE``,
in bulk, on several threads of their own: ``Backing``, off the daemon's loop,
as the buffer is no one else's; pinned there too on CUDA) and kept for the next
sleep of the same size
(``BufferCache``): first-touch faults, one per 4 KiB in the middle of a copy,
cost more than the copy. (Transparent huge pages are not asked for: a fresh
huge page can cost far more to fault in than the 512 small ones it replaces.)

``save`` and ``restore`` are generators that copy one slice per step
(``kvdaemon.daemon.copies``; ``Pacer``: about 10 ms each, at most the backend's
``copy_slice_bytes``, less where pages are fresh and fault in as they are
written): the daemon's loop serves other tenants between slices. Closed
early, a save gives its buffer back and saves nothing.

Cost: one bulk copy each way; host memory equal to the tenant's mapped bytes
while it sleeps, plus at most the cache's bound after.
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from collections.abc import Callable, Generator
from pathlib import Path

import psutil
from dataclasses import dataclass

from kvdaemon.cuda_vmm import host_copy
from kvdaemon.cuda_vmm.backend import Backend, PhysicalPage
from kvdaemon.daemon.copies import BUDGET_S, FIRST_SLICE_BYTES, Pacer, run_through
from kvdaemon.errors import BackendError

log = logging.getLogger("kvdaemon.swap")


def host_memory_bytes(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """The host memory this process may use: the machine's RAM, or less where a cgroup
    (a container's memory limit; v2 ``memory.max``, v1 ``memory.limit_in_bytes``) caps it."""
    total = int(psutil.virtual_memory().total)
    for path in (cgroup_root / "memory.max", cgroup_root / "memory" / "memory.limit_in_bytes"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


class BufferCache:
    """Host buffers of finished warm copies, kept for the next sleeps.

    Fresh memory costs a page fault per 4 KiB on first touch, often more than
    the copy itself; a reused buffer is already backed (and on CUDA pinned).
    ``take`` reuses the smallest kept buffer that holds the size and is at most
    ``MAX_SLACK`` times it, so a small sleep never pins a big buffer. At most
    ``max_bytes`` are kept: past it the oldest go back to the OS, as do buffers
    unused for ``KEEP_S`` (``trim``, each tick), so a daemon whose sleepers
    left holds none. Cost: O(kept buffers) per call, at most a few dozen.
    """

    KEEP_S = 120.0  # a buffer unused this long goes back to the OS
    MAX_SLACK = 2  # a kept buffer serves sizes from half its length up

    def __init__(self, max_bytes: int, backend: Backend, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.backend = backend
        self.clock = clock
        self._buffers: list[tuple[mmap.mmap, float]] = []  # (buffer, when given back), oldest first

    @property
    def cached_bytes(self) -> int:
        return sum(len(b) for b, _ in self._buffers)

    def take(self, size: int, largest: int | None = None) -> mmap.mmap:
        """``take_steps`` at once."""
        return run_through(self.take_steps(size, largest))

    def take_steps(self, size: int, largest: int | None = None) -> Generator[None, None, mmap.mmap]:
        """A buffer of at least ``size`` bytes, backed: a kept one at most ``MAX_SLACK`` times
        ``size`` (and at most ``largest``), else a new one of ``size``, backed by a thread of
        its own (``Backing``) while each step waits for it at most ``BUDGET_S``."""
        most = self.MAX_SLACK * size if largest is None else min(self.MAX_SLACK * size, largest)
        fits = [(len(b), i) for i, (b, _) in enumerate(self._buffers) if size <= len(b) <= most]
        if fits:
            return self._buffers.pop(min(fits)[1])[0]
        backing = Backing(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), self.backend)
        backing.start()
        try:
            while not backing.wait(BUDGET_S):
                yield
            return backing.result()
        except BaseException:  # closed early too: the memory goes back to the OS
            backing.discard()
            raise

    def give(self, buffer: mmap.mmap) -> None:
        if len(buffer) > self.max_bytes:
            self._close(buffer)
            return
        self._buffers.append((buffer, self.clock()))
        while self.cached_bytes > self.max_bytes:  # the oldest go first
            self._close(self._buffers.pop(0)[0])

    def shrink_to(self, max_bytes: int) -> None:
        """Release the oldest kept buffers until at most ``max_bytes`` are kept."""
        while self._buffers and self.cached_bytes > max_bytes:
            self._close(self._buffers.pop(0)[0])

    def trim(self, now: float) -> int:
        """Release the buffers unused for ``KEEP_S`` on a thread of its own (unpinning and
        unmapping GiBs takes a few hundred ms, and nobody waits for the memory); return how many."""
        old = [b for b, given_at in self._buffers if now - given_at >= self.KEEP_S]
        self._buffers = [(b, t) for b, t in self._buffers if now - t < self.KEEP_S]
        if old:
            threading.Thread(target=self._close_all, args=(old,), name="kvdaemon-trim", daemon=True).start()
        return len(old)

    def _close_all(self, buffers: list[mmap.mmap]) -> None:
        for buffer in buffers:
            self._close(buffer)

    def clear(self) -> None:
        while self._buffers:
            self._close(self._buffers.pop()[0])

    def _close(self, buffer: mmap.mmap) -> None:
        _unpin_and_close(self.backend, buffer)


class Backing:
    """A new host buffer backed (``host_copy.populate``) and pinned (``Backend.pin_host``: page-
    locked on CUDA, DMA straight in) on a thread of its own: fresh memory is the kernel zeroing
    every page, seconds per GiB on some hosts, and the buffer is no one else's, so the daemon's
    loop need not wait for it. ``discard`` gives the memory back once the thread is done with
    it (at once, or when it ends; a thread still backing it stops within ``PIECE_BYTES``).
    Cost: one thread per new buffer."""

    PIECE_BYTES = 64 << 20  # backed at once, between two looks at ``discard``

    def __init__(self, buffer: mmap.mmap, backend: Backend) -> None:
        self.buffer = buffer
        self.backend = backend
        self._error: Exception | None = None
        self._pinned = False
        self._done = False  # the thread no longer touches the buffer (set under the lock)
        self._discarded = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvdaemon-backing", daemon=True)

    def start(self) -> None:
        with memoryview(self.buffer) as view:
            self._address = host_copy.address_of(view)
        self._thread.start()

    def _run(self) -> None:
        try:
            size = len(self.buffer)
            for start in range(0, size, self.PIECE_BYTES):  # a dropped buffer stops within a piece
                if self._discarded:
                    break
                host_copy.populate(self._address + start, min(self.PIECE_BYTES, size - start))
            else:
                with memoryview(self.buffer) as view:
                    self.backend.pin_host(view)
                self._pinned = True
        except (BackendError, OSError) as exc:  # no memory, no pinning: the take's error
            self._error = exc
        except Exception as exc:  # the thread's boundary: a bug fails the take, with its traceback logged
            log.exception("backing a host buffer failed")
            self._error = exc
        with self._lock:
            self._done = True
            if self._discarded:
                self._release()

    def wait(self, timeout_s: float) -> bool:
        """Whether the buffer is ready (or failed to be), waiting at most ``timeout_s``."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def result(self) -> mmap.mmap:
        """The ready buffer; the error that stopped it is raised (``OSError``: no memory;
        ``BackendError``: no pinning; anything else as a ``BackendError``)."""
        if isinstance(self._error, (BackendError, OSError)):
            raise self._error
        if self._error is not None:
            raise BackendError(f"a host buffer could not be made ready: {type(self._error).__name__}: {self._error}")
        return self.buffer

    def discard(self) -> None:
        with self._lock:
            self._discarded = True
            if self._done:
                self._release()

    def _release(self) -> None:
        if self._pinned:
            _unpin_and_close(self.backend, self.buffer)
        else:
            self.buffer.close()


def _unpin_and_close(backend: Backend, buffer: mmap.mmap) -> None:
    """Give a pinned host buffer back to the OS; an unpin that fails (the backend closed
    meanwhile, as the daemon stops) is logged and the memory still goes."""
    try:
        with memoryview(buffer) as view:
            backend.unpin_host(view)
    except BackendError as exc:
        log.warning("a host buffer could not be unpinned: %s", exc)
    buffer.close()


@dataclass
class WarmCopy:
    """The saved bytes of one tenant: logical page order and one host buffer."""

    logical_pages: list[int]
    num_segments: int
    buffer: mmap.mmap  # at least one OS page, even for a tenant with no pages
    cache: BufferCache
    host_bytes: int  # the bytes saved (0 for a tenant with no pages)

    @property
    def held_bytes(self) -> int:
        """Host memory its buffer holds: at least ``host_bytes`` (a reused buffer may be larger)."""
        return len(self.buffer)

    def discard(self) -> None:
        self.cache.give(self.buffer)


def save(
    backend: Backend, logical: dict[int, list[PhysicalPage]], num_segments: int, cache: BufferCache,
    largest: int | None = None,
) -> Generator[None, None, WarmCopy]:
    """Copy the pages of ``logical`` (``{lp: [page per segment]}``) into host memory, in a
    buffer of at most ``largest`` bytes where a kept one is reused (``BufferCache.take_steps``),
    a slice per step. Closed early or failing, the buffer goes back and nothing is saved."""
    page_bytes = backend.page_size_bytes
    order = sorted(logical)
    pages = [page for lp in order for page in logical[lp]]
    num_bytes = len(pages) * page_bytes
    buffer = yield from cache.take_steps(max(mmap.PAGESIZE, num_bytes), largest)
    saved = False
    try:
        yield from _copy_slices(backend.copy_out_pages, pages, buffer, page_bytes, backend.copy_slice_bytes)
        saved = True
    finally:
        if not saved:
            cache.give(buffer)  # nothing saved: the buffer goes back for the next sleep
    return WarmCopy(order, num_segments, buffer, cache, num_bytes)


def restore(
    backend: Backend, copy: WarmCopy, logical: dict[int, list[PhysicalPage]]
) -> Generator[None, None, None]:
    """Copy saved bytes into the fresh pages of ``logical`` (same logical pages as saved),
    a slice per step."""
    pages = [page for lp in copy.logical_pages for page in logical[lp]]
    yield from _copy_slices(
        backend.copy_in_pages, pages, copy.buffer, backend.page_size_bytes, backend.copy_slice_bytes
    )


def _copy_slices(
    copy_pages: Callable[[list[PhysicalPage], memoryview], None], pages: list[PhysicalPage],
    buffer: mmap.mmap, page_bytes: int, slice_bytes: int,
) -> Generator[None, None, None]:
    """``copy_pages`` of page i at ``buffer[i * page_bytes:]``, a slice a step (``Pacer``: at
    most ``slice_bytes``, less where memory is slow to write)."""

    def copy(first: int, count: int) -> None:
        with memoryview(buffer) as view:
            copy_pages(pages[first : first + count], view[first * page_bytes : (first + count) * page_bytes])

    yield from Pacer(slice_bytes, page_bytes, FIRST_SLICE_BYTES).run(len(pages), copy)
