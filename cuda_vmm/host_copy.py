"""Bulk copies in host memory: ``memmove`` of many ranges on several threads.

A warm sleep moves every page of a tenant between its pages and a host buffer.
One thread copying runs well below what the memory can do, and fresh memory
is faulted in 4 KiB at a time on first touch. The helpers here:

- ``populate(addr, size)`` / ``populate_ranges``: back ranges before copying
  into them, by ``madvise(MADV_POPULATE_WRITE)`` (the kernel fills it in bulk, far faster
  than a page fault per 4 KiB in the middle of a copy); a no-op where the
  kernel lacks it (before Linux 5.14);
- ``copy_ranges(moves)``: each ``(dst, src, size)`` by ``memmove``, cut into
  pieces and split into contiguous shares over ``num_copy_threads()`` threads
  (ctypes releases the GIL for each call, so the threads copy in parallel).

Callers guarantee the addresses are mapped and the ranges do not overlap.
Cost: one ctypes call per range; a thread start per share past the first.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable

MADV_POPULATE_WRITE = 23  # Linux 5.14; Python 3.11's mmap does not name it
MAX_COPY_THREADS = 4
MIN_BYTES_PER_THREAD = 16 << 20  # below this a thread costs more than it copies
PIECE_BYTES = 8 << 20  # ranges are cut into pieces of this size to share them out
# Backing memory is the kernel zeroing pages, ~5x slower per byte than a copy: a second
# thread pays off from a few MiB (a 4 MiB populate: 1.4x faster on two threads here).
POPULATE_MIN_BYTES_PER_THREAD = 2 << 20
POPULATE_PIECE_BYTES = 1 << 20
_EINVAL = 22

Move = tuple[int, int, int]
"""``(dst address, src address, size in bytes)``."""


def num_copy_threads() -> int:
    """How many threads a bulk copy uses: the CPUs this process may run on, at most 4."""
    return max(1, min(MAX_COPY_THREADS, len(os.sched_getaffinity(0))))


def populate(addr: int, size_bytes: int) -> bool:
    """Back ``[addr, addr + size)`` (page-aligned) for writing, on several threads; False where
    the kernel cannot (the copy then faults the memory in itself)."""
    return populate_ranges([(addr, size_bytes)])


def populate_ranges(ranges: list[tuple[int, int]]) -> bool:
    """``populate`` of every ``(addr, size)``, all of them shared out over the threads at once."""
    pieces = _pieces([(addr, addr, size) for addr, size in ranges], POPULATE_PIECE_BYTES)
    done = [True]

    def share(part: list[Move]) -> None:
        for start, _, size in part:
            if not _populate(start, size):
                done[0] = False
                return

    _spread(pieces, share, POPULATE_MIN_BYTES_PER_THREAD)
    return done[0]


def copy_ranges(moves: list[Move]) -> None:
    """``memmove`` every range, spread over threads (see the module docstring)."""

    def share(part: list[Move]) -> None:
        memmove = ctypes.memmove
        for dst, src, size in part:
            memmove(dst, src, size)

    _spread(_pieces(moves, PIECE_BYTES), share, MIN_BYTES_PER_THREAD)


def _pieces(moves: list[Move], piece_bytes: int) -> list[Move]:
    """``moves`` cut into pieces of at most ``piece_bytes``, in order."""
    out = []
    for dst, src, size in moves:
        for offset in range(0, size, piece_bytes):
            out.append((dst + offset, src + offset, min(piece_bytes, size - offset)))
    return out


def _spread(pieces: list[Move], share: Callable[[list[Move]], None], min_bytes_per_thread: int) -> None:
    """Run ``share`` over contiguous shares of ``pieces`` (a thread per ``min_bytes_per_thread``
    at most): this thread takes the first."""
    total = sum(size for _, _, size in pieces)
    num_threads = min(num_copy_threads(), max(1, total // min_bytes_per_thread), max(1, len(pieces)))
    shares = [pieces[i * len(pieces) // num_threads : (i + 1) * len(pieces) // num_threads]
              for i in range(num_threads)]
    errors: list[BaseException] = []

    def run(part: list[Move]) -> None:
        try:
            share(part)
        except BaseException as exc:  # raised again on the calling thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(part,), daemon=True) for part in shares[1:]]
    for thread in threads:
        thread.start()
    run(shares[0])
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def _populate(addr: int, size_bytes: int) -> bool:
    libc = _libc()
    if libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(size_bytes), MADV_POPULATE_WRITE) == 0:
        return True
    err = ctypes.get_errno()
    if err == _EINVAL:
        return False  # an older kernel
    raise OSError(err, f"madvise(MADV_POPULATE_WRITE): {os.strerror(err)}")


_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        _LIBC = libc
    return _LIBC


def address_of(buffer: memoryview) -> int:
    """The address of a writable host buffer."""
    return ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))
