"""Host backend map+unmap cost per page, against raw mmap/munmap syscalls via ctypes.

Both sides map the same memfd pages into the same reserved range, one page at a
time, then take them away again: the backend with ``map_page`` + ``unmap``
(validation, bookkeeping, ``mmap(MAP_FIXED)`` then ``mmap(PROT_NONE)``), the
baseline with a bare ``mmap(MAP_SHARED|MAP_FIXED)`` + ``munmap`` pair. Rounds
alternate between the two so drift on a noisy machine hits both alike.

Target: backend ≤ 1.5× the raw syscalls.  Run: ``python bench/vmm.py``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import median_us, save, verdict  # noqa: E402

from kvdaemon.cuda_vmm.host import (  # noqa: E402
    _MAP_FIXED,
    _MAP_SHARED,
    _PROT_NONE,
    _PROT_RW,
    _RESERVE_FLAGS,
    HostBackend,
)

TARGET_RATIO = 1.5


def backend_round(backend: HostBackend, base: int, pages: list) -> float:
    """Seconds per page to map and unmap every page through the backend."""
    page_bytes = backend.page_size_bytes
    t0 = time.perf_counter()
    for i, page in enumerate(pages):
        addr = base + i * page_bytes
        backend.map_page(addr, page)
        backend.unmap(addr, page_bytes)
    return (time.perf_counter() - t0) / len(pages)


def raw_round(backend: HostBackend, base: int, pages: list) -> float:
    """Seconds per page for a bare ctypes mmap(MAP_FIXED)/munmap pair on the same slots."""
    libc = backend._lib()
    mmap_, munmap = libc.mmap, libc.munmap
    page_bytes = backend.page_size_bytes
    flags = _MAP_SHARED | _MAP_FIXED
    fd = backend.pool_fd
    t0 = time.perf_counter()
    for i, page in enumerate(pages):
        addr = base + i * page_bytes
        mmap_(addr, page_bytes, _PROT_RW, flags, fd, page.offset_bytes)
        munmap(addr, page_bytes)
    return (time.perf_counter() - t0) / len(pages)


def same_syscalls_round(backend: HostBackend, base: int, pages: list) -> float:
    """Seconds per page for the backend's own two syscalls, bare: mmap(FIXED) + mmap(PROT_NONE).

    Unlike munmap, putting PROT_NONE back keeps the slot reserved (nothing else
    can be placed there), which is what CUDA's cuMemUnmap guarantees; the
    kernel pays a VMA merge for it. This splits the backend's cost into kernel
    work and Python bookkeeping.
    """
    libc = backend._lib()
    mmap_ = libc.mmap
    page_bytes = backend.page_size_bytes
    flags = _MAP_SHARED | _MAP_FIXED
    fd = backend.pool_fd
    t0 = time.perf_counter()
    for i, page in enumerate(pages):
        addr = base + i * page_bytes
        mmap_(addr, page_bytes, _PROT_RW, flags, fd, page.offset_bytes)
        mmap_(addr, page_bytes, _PROT_NONE, _RESERVE_FLAGS | _MAP_FIXED, -1, 0)
    return (time.perf_counter() - t0) / len(pages)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=512, help="pages per round (2 MiB each)")
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()

    backend = HostBackend(num_pages=args.pages)
    backend.start()
    pages = [backend.create_page(i) for i in range(args.pages)]
    ours_base = backend.reserve(args.pages * backend.page_size_bytes)
    raw_base = backend.reserve(args.pages * backend.page_size_bytes)
    same_base = backend.reserve(args.pages * backend.page_size_bytes)
    ours: list[float] = []
    raw: list[float] = []
    same: list[float] = []
    for _ in range(args.rounds):
        ours.append(backend_round(backend, ours_base, pages))
        raw.append(raw_round(backend, raw_base, pages))
        same.append(same_syscalls_round(backend, same_base, pages))
    backend.close()

    ours_us, raw_us, same_us = median_us(ours), median_us(raw), median_us(same)
    ratio = ours_us / raw_us
    print(f"host backend map+unmap:          {ours_us:7.2f} us/page")
    print(f"raw mmap+munmap:                 {raw_us:7.2f} us/page   (baseline, same run)")
    print(f"raw mmap+mmap(PROT_NONE):        {same_us:7.2f} us/page   (same syscalls, no bookkeeping)")
    print(f"ratio vs raw mmap+munmap:        {ratio:.2f}x   target <= {TARGET_RATIO}x   "
          f"{verdict(ratio, TARGET_RATIO)}")
    print(f"ratio vs the same syscalls bare: {ours_us / same_us:.2f}x   (Python bookkeeping alone)")
    path = save(
        "vmm",
        {
            "pages": args.pages,
            "rounds": args.rounds,
            "backend_us_per_page": round(ours_us, 3),
            "raw_us_per_page": round(raw_us, 3),
            "same_syscalls_us_per_page": round(same_us, 3),
            "ratio_vs_same_syscalls": round(ours_us / same_us, 3),
            "ratio": round(ratio, 3),
            "target_ratio": TARGET_RATIO,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
