"""GPU check ``swap_sliced``: the daemon's warm copy as it runs on CUDA, against one whole copy.

A warm sleep or wake bigger than ``copy_slice_bytes`` (256 MiB at 2 MiB pages)
copies a slice per daemon loop step (``kvdaemon.daemon.copies``), into a host
buffer that ``swap.BufferCache`` backs and pins on a thread of its own
(``swap.Backing``: ``cuMemHostRegister`` off the loop, the backend setting its
context on that thread). PASS guarantees: ``swap.save`` then ``swap.restore``
into fresh pages restores every byte, the new buffer made on the backing
thread serves DMA; the figure is the sliced round trip's bandwidth over one
whole ``copy_out_pages``/``copy_in_pages`` of the same pages into the same
pinned buffer, measured in the same run (equal: 1.0).

Cost: ``SLICED_PAGES`` pages three times (1.5 GiB of device memory) and
1 GiB of pinned host memory; run by ``bench/gpu_check.py``.
"""

from __future__ import annotations

import time

from gpu_backend_checks import PAGE, Figures, check_copy, map_run, started, written_pages

SLICED_PAGES = 512  # 1 GiB: four slices of 256 MiB each way


def check_swap_sliced() -> Figures:
    import torch

    from kvdaemon.cuda_vmm import CudaBackend
    from kvdaemon.daemon import swap
    from kvdaemon.daemon.copies import run_through

    size = SLICED_PAGES * PAGE
    with started(CudaBackend(num_pages=3 * SLICED_PAGES)) as backend:
        addr, pages = written_pages(backend, SLICED_PAGES, seed=7)
        backend.unmap(addr, size)
        cache = swap.BufferCache(2 * size, backend)
        logical = {lp: [page] for lp, page in enumerate(pages)}
        made_s = time.perf_counter()
        run_through(swap.save(backend, logical, 1, cache)).discard()  # the buffer made, pinned, kept
        made_s = time.perf_counter() - made_s
        t0 = time.perf_counter()
        copy = run_through(swap.save(backend, logical, 1, cache))
        out_s = time.perf_counter() - t0
        fresh = [backend.create_page(SLICED_PAGES + i) for i in range(SLICED_PAGES)]
        t0 = time.perf_counter()
        run_through(swap.restore(backend, copy, {lp: [page] for lp, page in enumerate(fresh)}))
        in_s = time.perf_counter() - t0
        map_run(backend, addr, fresh)
        check_copy(backend.tensor(addr, size, torch.int32), 7, "bytes restored by the sliced copy")
        backend.unmap(addr, size)
        with memoryview(copy.buffer) as view:
            t0 = time.perf_counter()
            backend.copy_out_pages(pages, view[:size])
            backend.copy_in_pages(fresh, view[:size])
            whole_s = time.perf_counter() - t0
        copy.discard()
        cache.clear()
    return {
        "bytes": size,
        "slice_bytes": backend.copy_slice_bytes,
        "first_save_s": round(made_s, 3),
        "sliced_round_trip_gbps": round(2 * size / (out_s + in_s) / 1e9, 2),
        "whole_round_trip_gbps": round(2 * size / whole_s / 1e9, 2),
        "sliced_vs_whole": round(whole_s / (out_s + in_s), 3),
    }
