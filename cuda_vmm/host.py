"""The ``host`` backend: CUDA-VMM semantics on Linux virtual memory.

The pool is one memfd of ``num_pages * page_size_bytes``; physical page k is the
file range at ``k * page_size_bytes``. A reservation is an anonymous
``PROT_NONE | MAP_NORESERVE`` mapping (no memory behind it); mapping a page
replaces one slot with ``MAP_SHARED | MAP_FIXED`` of the file range; unmapping
puts ``PROT_NONE`` back; releasing punches a hole in the file
(``fallocate(PUNCH_HOLE)``) so the memory returns to the OS at once. The pool fd
crosses processes like a CUDA handle: ``export_page`` dups it, and
``import_page`` keeps one fd per distinct pool file.

Unlike CUDA, releasing a page zeroes it for every process that still maps it:
the daemon must release a page only once its tenant unmapped it or died.

Bulk copies (``copy_out_pages``/``copy_in_pages``, a warm sleep's) go through
one shared mapping of the whole pool in this process (made on first use):
each run of consecutive pages that mapping has not touched since the page was
created is backed in bulk (``MADV_POPULATE_WRITE``: the page table entries
made at once, instead of a fault per 4 KiB mid-copy; pages it already touched
cost no walk again), and copied with ``memmove`` on several threads
(``host_copy``). The host buffer is the caller's to back (``swap.BufferCache``
does); an unbacked one is only slower. Fresh memory costs a fault per 4 KiB on
first touch, so the daemon may keep a warm sleeper's released pages backed for
a wake (``recycles_released_pages``).

Each mapped page is one mapping of the process's own (a VMA; the kernel merges
neighbours whose pages follow each other in the file, but an unmap between them
splits them again, so the backend counts every page apart: ``AddressBook``), and
Linux caps them (``vm.max_map_count``, 65,530 by default); a map past the cap
fails and leaves the process unable to map anything more, a thread's stack or a
large ``malloc`` included. So the backend maps no page that would take its ranges
past the cap less a share kept for the rest of the process (``max_mappings``),
and says how many more pages it may map (``mappable_pages``): about 57,000 at the
default cap (112 GiB at the default 2 MiB page), fewer where pages scatter (two
mappings each at worst). The cap is the process's: every started host
backend of the process (one per ``KVClient``) counts against it, with the mappings
each holds for pages to map back (``hold_mappings``: a warm sleeper's, whose wake
must find room for them).

Cost: map and unmap are one ``mmap`` syscall each; releasing is one ``fallocate`` per run
of consecutive pages.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import weakref
from collections.abc import Collection
from typing import TYPE_CHECKING

import psutil

from kvdaemon.cuda_vmm import host_copy
from kvdaemon.cuda_vmm.address_book import AddressBook, free_every_range
from kvdaemon.cuda_vmm.backend import (
    COPY_SLICE_BYTES, DEFAULT_PAGE_SIZE_BYTES, MemInfo, PhysicalPage, check_bulk_buffer, unmap_slots,
)
from kvdaemon.errors import BackendError

if TYPE_CHECKING:
    import torch

_PROT_NONE = 0x0
_PROT_RW = 0x1 | 0x2
_MAP_SHARED = 0x01
_MAP_PRIVATE = 0x02
_MAP_FIXED = 0x10
_MAP_ANONYMOUS = 0x20
_MAP_NORESERVE = 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value
_FALLOC_PUNCH_HOLE = 0x01 | 0x02  # KEEP_SIZE | PUNCH_HOLE
_RESERVE_FLAGS = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE
MAX_MAP_COUNT_PATH = "/proc/sys/vm/max_map_count"
DEFAULT_MAX_MAP_COUNT = 65530  # Linux's default, where the file cannot be read
MAP_HEADROOM = 8192  # mappings left to the rest of the process (a torch process maps ~2,500), at most
_STARTED: weakref.WeakSet[HostBackend] = weakref.WeakSet()  # this process's started backends: one cap for all


def max_mappings(path: str = MAX_MAP_COUNT_PATH) -> int:
    """The OS mappings a backend's pages may make: ``vm.max_map_count`` less ``MAP_HEADROOM``
    (a quarter of it where that is less). One read of ``path``."""
    try:
        with open(path) as file:
            limit = int(file.read())
    except (OSError, ValueError):
        limit = DEFAULT_MAX_MAP_COUNT
    return max(0, limit - min(MAP_HEADROOM, limit // 4))


def _load_libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long,
    ]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.fallocate.restype = ctypes.c_int
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return libc


def _os_error(call: str) -> BackendError:
    err = ctypes.get_errno()
    return BackendError(f"{call} failed: {os.strerror(err)}", errno.errorcode.get(err, str(err)))


def process_mappings(excluding: Collection[HostBackend] = ()) -> int:
    """The mappings every started host backend of this process makes or holds, but ``excluding``'s
    (what the cap is shared with). O(started backends)."""
    return sum(b._book.num_mappings + b.num_held_mappings for b in list(_STARTED) if b not in excluding)


def _file_runs(pages: list[PhysicalPage]) -> list[list[PhysicalPage]]:
    """``pages`` (in slot order, or sorted by id) cut into runs that follow each other in one
    file: the same handle, each offset one page past the one before. O(n)."""
    runs: list[list[PhysicalPage]] = []
    for page in pages:
        last = runs[-1][-1] if runs else None
        if last is not None and last.handle == page.handle and last.page_id + 1 == page.page_id:
            runs[-1].append(page)
        else:
            runs.append([page])
    return runs


def _not_started(*_args: object) -> int:
    raise BackendError("host backend is not started; call start() first")


class HostBackend:
    """Host-memory backend over one memfd pool (see the module docstring).

    ``num_pages == 0`` makes an importer only (a client): it maps pages other
    processes export but creates none.
    """

    name = "host"
    recycles_released_pages = True  # fresh memory is faulted in on first touch
    copy_slice_bytes = COPY_SLICE_BYTES  # smaller slices copy on fewer threads (host_copy.MIN_BYTES_PER_THREAD)

    def __init__(
        self, num_pages: int = 0, page_size_bytes: int = DEFAULT_PAGE_SIZE_BYTES, device: int = 0
    ) -> None:
        if page_size_bytes <= 0 or page_size_bytes % mmap.PAGESIZE:
            raise BackendError(
                f"page size {page_size_bytes} must be a positive multiple of {mmap.PAGESIZE}"
            )
        if num_pages < 0:
            raise BackendError(f"number of pages must be >= 0, got {num_pages}")
        self.device = device
        self.page_size_bytes = page_size_bytes
        self.num_pages = num_pages
        self.pool_fd = -1
        self._libc: ctypes.CDLL | None = None
        self._mmap = _not_started  # libc.mmap once started; bound here for the hot path
        self._book = AddressBook(page_size_bytes)
        self._created: set[int] = set()
        self._imported_fds: dict[tuple[int, int], int] = {}
        self._pool_view = 0  # this process's shared mapping of the whole pool, for bulk copies
        self._in_view: set[int] = set()  # created pages whose PTEs the pool view holds
        self.max_mappings = DEFAULT_MAX_MAP_COUNT - MAP_HEADROOM  # read from the OS at start()
        self.num_held_mappings = 0  # kept for pages to map back (``hold_mappings``)

    @property
    def granularity_bytes(self) -> int:
        return mmap.PAGESIZE

    def start(self) -> None:
        if self._libc is not None:
            return
        self._libc = _load_libc()
        self._mmap = self._libc.mmap
        self.max_mappings = max_mappings()
        _STARTED.add(self)
        if self.num_pages:
            self.pool_fd = os.memfd_create("kvdaemon-pool", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(self.pool_fd, self.num_pages * self.page_size_bytes)
            # No process holding the fd may resize the pool (a shrink would SIGBUS every mapper),
            # nor seal it further (a write seal would make every later release fail).
            fcntl.fcntl(self.pool_fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)

    def close(self) -> None:
        if self._libc is None:
            return
        free_every_range(self, self._book)
        for fd in self._imported_fds.values():
            os.close(fd)
        self._imported_fds.clear()
        if self._pool_view:
            self._libc.munmap(self._pool_view, self.num_pages * self.page_size_bytes)
            self._pool_view = 0
        self._in_view.clear()
        if self.pool_fd >= 0:
            os.close(self.pool_fd)
            self.pool_fd = -1
        self._created.clear()
        self._libc = None
        self._mmap = _not_started
        self.num_held_mappings = 0
        _STARTED.discard(self)

    def _lib(self) -> ctypes.CDLL:
        if self._libc is None:
            raise BackendError("host backend is not started; call start() first")
        return self._libc

    def reserve(self, size_bytes: int) -> int:
        self._book.check_size(size_bytes)
        libc = self._lib()
        # Over-reserve by one page, then trim, so the start is page-aligned.
        span = size_bytes + self.page_size_bytes
        raw = libc.mmap(None, span, _PROT_NONE, _RESERVE_FLAGS, -1, 0)
        if raw == _MAP_FAILED:
            raise _os_error(f"reserving {size_bytes} bytes")
        start = (raw + self.page_size_bytes - 1) // self.page_size_bytes * self.page_size_bytes
        if start > raw:
            libc.munmap(raw, start - raw)
        tail = raw + span - (start + size_bytes)
        if tail:
            libc.munmap(start + size_bytes, tail)
        self._book.add_range(start, size_bytes)
        return start

    def free_range(self, addr: int) -> None:
        size_bytes = self._book.remove_range(addr)
        if self._lib().munmap(addr, size_bytes) != 0:
            raise _os_error("munmap")

    def _check_page_id(self, page_id: int) -> None:
        if not isinstance(page_id, int) or not 0 <= page_id < self.num_pages:
            raise BackendError(f"page {page_id!r} is outside the pool of {self.num_pages} pages")

    def create_page(self, page_id: int) -> PhysicalPage:
        self._lib()
        self._check_page_id(page_id)
        if page_id in self._created:
            raise BackendError(f"page {page_id} already exists")
        self._created.add(page_id)
        return PhysicalPage(page_id, self.pool_fd, page_id * self.page_size_bytes)

    def release_page(self, page: PhysicalPage) -> None:
        failed = self.release_pages([page])
        if failed:
            raise failed[0][1]

    def release_pages(self, pages: list[PhysicalPage]) -> list[tuple[PhysicalPage, BackendError]]:
        """Punch one hole per run of consecutive created pages (a run that fails is tried page by
        page); imported pages are the creator's: nothing to give back here. O(n log n)."""
        libc = self._lib()
        failed: list[tuple[PhysicalPage, BackendError]] = []
        own: dict[int, PhysicalPage] = {}
        for page in pages:
            if page.handle != self.pool_fd:
                continue
            if page.page_id not in self._created or page.page_id in own:
                failed.append((page, BackendError(f"page {page.page_id} was not created here or is already released")))
            else:
                own[page.page_id] = page
        for run in _file_runs(sorted(own.values(), key=lambda page: page.page_id)):  # one handle: runs of ids
            size_bytes = len(run) * self.page_size_bytes
            if libc.fallocate(self.pool_fd, _FALLOC_PUNCH_HOLE, run[0].offset_bytes, size_bytes) == 0:
                self._forget(run)
            elif len(run) == 1:
                failed.append((run[0], _os_error("fallocate(PUNCH_HOLE)")))
            else:
                for page in run:
                    failed.extend(self.release_pages([page]))
        return failed

    def _forget(self, released: list[PhysicalPage]) -> None:
        for page in released:
            self._created.discard(page.page_id)
            self._in_view.discard(page.page_id)  # the hole took its PTEs in every mapping

    def export_page(self, page: PhysicalPage) -> int:
        self._lib()
        if page.handle != self.pool_fd or page.page_id not in self._created:
            raise BackendError(f"page {page.page_id} was not created here; cannot export it")
        return os.dup(self.pool_fd)

    def export_pages(self, pages: list[PhysicalPage]) -> tuple[list[int], list[int]]:
        for page in pages:
            if page.handle != self.pool_fd or page.page_id not in self._created:
                raise BackendError(f"page {page.page_id} was not created here; cannot export it")
        return [os.dup(self.pool_fd)], [0] * len(pages)

    def import_page(self, fd: int, page_id: int) -> PhysicalPage:
        return self.import_pages([fd], [page_id], [0])[0]

    def import_pages(
        self, fds: list[int], page_ids: list[int], fd_index: list[int]
    ) -> list[PhysicalPage]:
        self._lib()
        files: list[tuple[int, int]] = []
        try:
            for fd in fds:
                files.append(self._adopt(fd))
        except BackendError:
            for fd in fds[len(files) + 1 :]:
                os.close(fd)
            raise
        if len(fd_index) != len(page_ids):
            raise BackendError("import needs one fd index per page")
        pages = []
        for page_id, index in zip(page_ids, fd_index):
            if not 0 <= index < len(files):
                raise BackendError(f"fd index {index} is outside the {len(files)} fds received")
            pool_fd, size = files[index]
            offset = page_id * self.page_size_bytes if isinstance(page_id, int) else -1
            if offset < 0 or offset + self.page_size_bytes > size:
                raise BackendError(f"page {page_id!r} is outside the exported pool of {size} bytes")
            pages.append(PhysicalPage(page_id, pool_fd, offset))
        return pages

    def _adopt(self, fd: int) -> tuple[int, int]:
        """Keep one fd per distinct pool file: ``(our fd for that file, its size)``; closes dups."""
        try:
            st = os.fstat(fd)
        except OSError as exc:
            raise BackendError(f"cannot import fd {fd}: {exc.strerror}", "EBADF") from exc
        key = (st.st_dev, st.st_ino)
        pool_fd = self._imported_fds.get(key)
        if pool_fd is None:
            self._imported_fds[key] = pool_fd = fd
        else:
            os.close(fd)
        return pool_fd, st.st_size

    def mappable_pages(self) -> int:
        """Pages this process may still map at a mapping each (a page beside a mapped one or at a
        range's end; one that lands apart takes two, and its map is refused if that passes the
        cap). O(started backends)."""
        return max(0, self._map_cap() - self._book.num_mappings)

    def hold_mappings(self, num_mappings: int) -> None:
        """Keep ``num_mappings`` of the cap for pages unmapped now and mapped back later (a warm
        sleeper's); no page of this process maps into them until ``release_mappings``. O(1)."""
        self.num_held_mappings += num_mappings

    def release_mappings(self, num_mappings: int) -> None:
        """Give back what ``hold_mappings`` kept (before mapping those pages back). O(1)."""
        self.num_held_mappings = max(0, self.num_held_mappings - num_mappings)

    def _map_cap(self) -> int:
        """What this backend's own mappings may reach: ``max_mappings`` less what every other
        started backend of the process maps or holds, and what this one holds. O(1) while it is
        the process's only one (a page's map asks this: iterating the others cost ~5 us a page)."""
        alone = len(_STARTED) == 1 and self in _STARTED
        others = 0 if alone else process_mappings(excluding=(self,))
        return self.max_mappings - others - self.num_held_mappings

    def map_page(self, addr: int, page: PhysicalPage) -> None:
        self._book.mark_mapped(addr, page, self._map_cap())
        got = self._mmap(
            addr, self.page_size_bytes, _PROT_RW, _MAP_SHARED | _MAP_FIXED, page.handle, page.offset_bytes
        )
        if got != addr:
            self._book.unmark_mapped(addr)
            raise _os_error(f"mapping page {page.page_id} at {addr:#x}")

    def map_pages(self, addr: int, pages: list[PhysicalPage]) -> None:
        """One ``mmap`` per run of ``pages`` that follow each other in one file (a grant's pages
        of one segment, taken in page order, mostly do), all or nothing. O(pages) bookkeeping,
        O(runs) syscalls."""
        page_bytes, book = self.page_size_bytes, self._book
        cap = self._map_cap()
        done = 0  # pages mapped by earlier runs
        try:
            for run in _file_runs(pages):
                start = addr + done * page_bytes
                for i, page in enumerate(run):
                    try:
                        book.mark_mapped(start + i * page_bytes, page, cap)
                    except BackendError:
                        for j in range(i):
                            book.unmark_mapped(start + j * page_bytes)
                        raise
                size = len(run) * page_bytes
                got = self._mmap(start, size, _PROT_RW, _MAP_SHARED | _MAP_FIXED, run[0].handle, run[0].offset_bytes)
                if got != start:
                    error = _os_error(f"mapping pages {run[0].page_id}-{run[-1].page_id} at {start:#x}")
                    for j in range(len(run)):
                        book.unmark_mapped(start + j * page_bytes)
                    raise error
                done += len(run)
        except BackendError:
            unmap_slots(self, addr, done)  # a slot whose unmap is refused too stays mapped (is_mapped)
            raise

    def is_mapped(self, addr: int) -> bool:
        return self._book.is_mapped(addr)

    def unmap(self, addr: int, size_bytes: int) -> None:
        book = self._book
        if size_bytes == self.page_size_bytes:
            pages = [book.unmark_mapped(addr)]  # one slot: the common case, no scan
        else:
            pages = [book.unmark_mapped(slot) for slot in book.slots(addr, size_bytes)]
        got = self._mmap(addr, size_bytes, _PROT_NONE, _RESERVE_FLAGS | _MAP_FIXED, -1, 0)
        if got != addr:
            for i, page in enumerate(pages):
                book.mark_mapped(addr + i * self.page_size_bytes, page)
            raise _os_error(f"unmapping {size_bytes} bytes at {addr:#x}")

    def tensor(self, addr: int, size_bytes: int, dtype: torch.dtype) -> torch.Tensor:
        import torch

        self._book.check_view(addr, size_bytes)
        buf = (ctypes.c_ubyte * size_bytes).from_address(addr)
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype)

    def mem_info(self) -> MemInfo:
        vm = psutil.virtual_memory()
        return MemInfo(free_bytes=int(vm.available), total_bytes=int(vm.total))

    def prune_imports(self) -> None:
        in_use = self._book.handles_in_use()
        for key, fd in list(self._imported_fds.items()):
            if fd not in in_use:
                os.close(fd)
                del self._imported_fds[key]

    def pin_host(self, buffer: memoryview) -> None:
        """Nothing to do: host pages are copied by the kernel."""

    def unpin_host(self, buffer: memoryview) -> None:
        """Nothing to do."""

    def copy_out(self, page: PhysicalPage, dest: memoryview) -> None:
        self._check_copy(page, dest)
        done = 0
        while done < self.page_size_bytes:
            got = os.preadv(page.handle, [dest[done:]], page.offset_bytes + done)
            if got <= 0:
                raise BackendError(f"reading page {page.page_id} stopped at {done} bytes")
            done += got

    def copy_in(self, page: PhysicalPage, src: memoryview) -> None:
        self._check_copy(page, src)
        done = 0
        while done < self.page_size_bytes:
            done += os.pwritev(page.handle, [src[done:]], page.offset_bytes + done)

    def copy_out_pages(self, pages: list[PhysicalPage], dest: memoryview) -> None:
        self._copy_pages(pages, dest, to_host=True)

    def copy_in_pages(self, pages: list[PhysicalPage], src: memoryview) -> None:
        self._copy_pages(pages, src, to_host=False)

    def _copy_pages(self, pages: list[PhysicalPage], host: memoryview, to_host: bool) -> None:
        """Copy ``pages`` (created here) to or from ``host``, page i at ``i * page_size``."""
        size = self.page_size_bytes
        check_bulk_buffer(len(pages), host, size)
        if not pages:
            return
        base = self._pool_address()
        for page in pages:
            if page.handle != self.pool_fd or page.page_id not in self._created:
                raise BackendError(f"page {page.page_id} was not created here; cannot copy it in bulk")
        host_addr = host_copy.address_of(host)
        moves: list[host_copy.Move] = []
        for i, page in enumerate(pages):
            pool_addr, buf_addr = base + page.offset_bytes, host_addr + i * size
            dst, src = (buf_addr, pool_addr) if to_host else (pool_addr, buf_addr)
            last = moves[-1] if moves else None
            if last is not None and last[0] + last[2] == dst and last[1] + last[2] == src:
                moves[-1] = (last[0], last[1], last[2] + size)  # one run of consecutive pages
            else:
                moves.append((dst, src, size))
        self._back_in_view(pages)
        host_copy.copy_ranges(moves)

    def _back_in_view(self, pages: list[PhysicalPage]) -> None:
        """Make the pool view's PTEs of ``pages`` in bulk, once per page's life (a walk over
        PTEs already there costs ~50 ms per GiB)."""
        fresh = sorted({p.page_id for p in pages} - self._in_view)
        if not fresh:
            return
        base, size = self._pool_view, self.page_size_bytes
        runs: list[list[int]] = []  # [first page id, number of pages]
        for page_id in fresh:
            if runs and runs[-1][0] + runs[-1][1] == page_id:
                runs[-1][1] += 1
            else:
                runs.append([page_id, 1])
        host_copy.populate_ranges([(base + first * size, count * size) for first, count in runs])
        self._in_view.update(fresh)

    def _pool_address(self) -> int:
        """This process's read-write shared mapping of the whole pool (made once)."""
        libc = self._lib()
        if self.pool_fd < 0:
            raise BackendError("only the pool's creator copies pages in bulk")
        if not self._pool_view:
            span = self.num_pages * self.page_size_bytes
            got = libc.mmap(None, span, _PROT_RW, _MAP_SHARED, self.pool_fd, 0)
            if got == _MAP_FAILED:
                raise _os_error("mapping the pool for copies")
            self._pool_view = got
        return self._pool_view

    def _check_copy(self, page: PhysicalPage, buf: memoryview) -> None:
        self._lib()
        if len(buf) != self.page_size_bytes:
            raise BackendError(f"a page copy needs {self.page_size_bytes} bytes, got {len(buf)}")
