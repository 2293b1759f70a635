"""The GPU checks of the ``cuda`` backend, run one per process by ``bench/gpu_check.py``.

Each ``check_*`` function returns flat figures or raises; every import of
torch and of kvdaemon happens inside the functions that need it, so an
environment missing a package fails the checks that use it, not the run.

- ``check_cuda_start``: the backend starts, the device name, torch/triton versions.
- ``check_cross_process``: a page crosses processes as an fd (SCM_RIGHTS) and
  both sides see each other's writes through torch views.
- ``check_map_latency``: map/unmap cost of the backend next to the raw driver
  and ``torch.empty``.
- ``check_torch_view``: views at one address agree; copy bandwidth into a view.
- ``check_view_before_map``: views made over a reserved, unmapped range (how
  the client makes its KV tensors) work once pages are mapped, on this torch.
- ``check_zeroed_pages``: a created page reads zero, whatever the memory held.
- ``check_kernel_pointers``: Triton launches over a view whose base page is
  mapped and every other page unmapped; a launch over an unmapped base fails
  in the launcher's pointer check (why the pool keeps logical page 0 mapped).
- ``check_swap_copy``: page copies to and from pinned host memory (warm sleep).

Cost: seconds each (a child process for ``check_cross_process``), at most
512 MiB of device memory at a time.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from report import median_us, percentile_us

if TYPE_CHECKING:
    import torch

    from kvdaemon.cuda_vmm import CudaBackend, PhysicalPage

Figures = dict[str, float | int | str | bool]
Message = dict[str, Any]  # one JSON record on the cross_process socket

PAGE = 2 * 1024 * 1024
WORDS = PAGE // 4
LATENCY_PAGES = 256  # 512 MiB of 2 MiB pages
VIEW_PAGES = 64  # 128 MiB for the bandwidth figure
COPY_REPEATS = 20
ZERO_PAGES = 32
CHILD_TIMEOUT_S = 120.0
CHILD_FLAG = "--cross-process-child"  # internal: the child side of cross_process
CHILD_SEED = 2
PARENT_SEED = 5


# --- helpers ---------------------------------------------------------------------


def require(condition: bool, message: str) -> None:
    """Raise AssertionError(message) unless ``condition``; unlike ``assert``, kept under -O."""
    if not condition:
        raise AssertionError(message)


def child_error(reply: Message) -> str:
    """The child's error text in ``reply``, or an empty string when it reported none."""
    return f"child: {reply['error']}" if "error" in reply else ""


def pattern(num_words: int, seed: int) -> torch.Tensor:
    """A deterministic int32 pattern on the GPU; distinct seeds differ in every word."""
    import torch

    return torch.arange(num_words, dtype=torch.int32, device="cuda") * 3 + seed


@contextlib.contextmanager
def started(backend: CudaBackend) -> Iterator[CudaBackend]:
    """Start ``backend`` and close it on the way out.

    When the body failed, a failure to close (e.g. after a sticky CUDA fault)
    is dropped so that the body's error is the one reported.
    """
    from kvdaemon.errors import BackendError

    backend.start()
    body_done = False
    try:
        yield backend
        body_done = True
    finally:
        if body_done:
            backend.close()
        else:
            with contextlib.suppress(BackendError):
                backend.close()


def map_run(backend: CudaBackend, addr: int, pages: list[PhysicalPage]) -> None:
    """Map ``pages`` at consecutive slots from ``addr``."""
    for i, page in enumerate(pages):
        backend.map_page(addr + i * PAGE, page)


def written_pages(backend: CudaBackend, num_pages: int, seed: int) -> tuple[int, list[PhysicalPage]]:
    """``num_pages`` new pages mapped in a new range and filled with ``pattern(seed)``;
    returns the range's address and the pages (still mapped there)."""
    import torch

    size = num_pages * PAGE
    addr = backend.reserve(size)
    pages = [backend.create_page(i) for i in range(num_pages)]
    map_run(backend, addr, pages)
    backend.tensor(addr, size, torch.int32).copy_(pattern(size // 4, seed=seed))
    torch.cuda.synchronize()
    return addr, pages


def spread(name: str, samples_ns: list[int]) -> Figures:
    """Median and p99 of ``samples_ns`` as ``{name}_median_us`` and ``{name}_p99_us``."""
    seconds = [s / 1e9 for s in samples_ns]
    return {
        f"{name}_median_us": round(median_us(seconds), 2),
        f"{name}_p99_us": round(percentile_us(seconds, 99), 2),
    }


def send_message(sock: socket.socket, message: Message, fds: Sequence[int] = ()) -> None:
    """Send one JSON message (and ``fds``) as one SOCK_SEQPACKET record."""
    data = json.dumps(message).encode()
    sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
    require(sent == len(data), f"short send: {sent} of {len(data)} bytes")


def receive_message(sock: socket.socket) -> tuple[Message, list[int]]:
    """Receive one JSON message and any fds it carries. Raises AssertionError if the peer left."""
    data, fds, _flags, _addr = socket.recv_fds(sock, 65536, 4)
    require(bool(data), "the peer closed the socket before answering")
    return json.loads(data), fds


def check_copy(view: torch.Tensor, seed: int, what: str) -> None:
    """Assert ``view`` (int32) holds ``pattern(seed)``; name the first differing word if not."""
    import torch

    expected = pattern(view.numel(), seed)
    if not torch.equal(view, expected):
        first = int((view != expected).nonzero()[0])
        raise AssertionError(
            f"{what}: word {first} is {int(view[first])}, expected {int(expected[first])}"
        )



# --- checks ------------------------------------------------------------------------


def check_cuda_start() -> Figures:
    """The cuda backend starts on device 0 and torch has CUDA.

    Guarantees on PASS: the driver loads, device 0 exists, the page size is a
    multiple of its granularity, and torch can make CUDA tensors.
    Cost: one cuInit and primary-context retain; milliseconds.
    """
    import torch

    from kvdaemon.cuda_vmm import CudaBackend

    with started(CudaBackend()) as backend:
        info = backend.mem_info()
        figures: Figures = {
            "granularity_bytes": backend.granularity_bytes,
            "page_size_bytes": backend.page_size_bytes,
            "device_total_bytes": info.total_bytes,
            "device_free_bytes": info.free_bytes,
        }
        figures["driver_device_name"] = backend.device_name
        require(not backend.host_memory, "this is the fake driver of the tests, not a GPU")
    require(torch.cuda.is_available(), f"torch {torch.__version__} has no CUDA (a CPU-only build?)")
    figures["device_name"] = torch.cuda.get_device_name(0)
    figures["torch"] = torch.__version__
    figures["triton"] = _version("triton")
    figures["cuda_bindings"] = _version("cuda-bindings")
    return figures


def _version(package: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def check_cross_process() -> Figures:
    """A page created here is written by a child through its own mapping, and read here.

    Guarantees on PASS: an exported page fd crossed processes over SCM_RIGHTS;
    the child's import + map + torch writes land in the physical page this
    process maps in its own range, and this process's writes reach the child.
    Cost: one child Python process (torch and CUDA start-up: seconds) and one
    page of device memory.
    """
    import torch

    from kvdaemon.cuda_vmm import CudaBackend

    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    parent_sock.settimeout(CHILD_TIMEOUT_S)
    child: subprocess.Popen[bytes] | None = None
    try:
        with started(CudaBackend(num_pages=1)) as backend:
            page = backend.create_page(0)
            t0 = time.perf_counter_ns()
            script = str(Path(__file__).resolve())  # runs run_cross_process_child
            child = subprocess.Popen(
                [sys.executable, script, CHILD_FLAG, str(child_sock.fileno())],
                pass_fds=(child_sock.fileno(),),
            )
            child_sock.close()
            fd = backend.export_page(page)
            try:
                send_message(parent_sock, {"page_id": page.page_id, "seed": CHILD_SEED}, [fd])
            finally:
                os.close(fd)  # the child holds its own copy now
            written, _ = receive_message(parent_sock)
            require(not child_error(written), child_error(written))
            child_ready_s = (time.perf_counter_ns() - t0) / 1e9

            addr = backend.reserve(PAGE)
            backend.map_page(addr, page)
            view = backend.tensor(addr, PAGE, torch.int32)
            check_copy(view, CHILD_SEED, "this process reading the child's bytes")
            view.copy_(pattern(WORDS, PARENT_SEED))
            torch.cuda.synchronize()
            send_message(parent_sock, {"seed": PARENT_SEED})
            read, _ = receive_message(parent_sock)
            require(not child_error(read), child_error(read))
            del view
        status = child.wait(timeout=CHILD_TIMEOUT_S)
        require(status == 0, f"child exited with status {status}")
    finally:
        parent_sock.close()
        child_sock.close()
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
    return {
        "bytes_checked_each_way": PAGE,
        "child_start_to_written_s": round(child_ready_s, 2),
        "child_import_map_us": written["import_map_us"],
    }


def run_cross_process_child(sock_fd: int) -> int:
    """The child side of ``check_cross_process``; returns the process exit status.

    Receives the page fd, imports and maps it, writes ``pattern(seed)``, then
    checks the pattern the parent writes back. Every failure is sent to the
    parent as ``{"error": ...}`` before exiting with status 1.
    """
    import torch

    from kvdaemon.cuda_vmm import CudaBackend

    sock = socket.socket(fileno=sock_fd)
    sock.settimeout(CHILD_TIMEOUT_S)
    try:
        with started(CudaBackend()) as backend:
            request, fds = receive_message(sock)
            require(len(fds) == 1, f"expected one page fd, got {len(fds)}")
            t0 = time.perf_counter_ns()
            page = backend.import_page(fds[0], int(request["page_id"]))
            addr = backend.reserve(PAGE)
            backend.map_page(addr, page)
            import_map_us = (time.perf_counter_ns() - t0) / 1e3
            view = backend.tensor(addr, PAGE, torch.int32)
            view.copy_(pattern(WORDS, int(request["seed"])))
            torch.cuda.synchronize()
            send_message(sock, {"import_map_us": round(import_map_us, 1)})
            request, _ = receive_message(sock)
            check_copy(view, int(request["seed"]), "the child reading this process's bytes")
            send_message(sock, {"ok": True})
            del view
    except Exception as exc:  # noqa: BLE001 (the child's boundary: every failure goes to the parent)
        with contextlib.suppress(OSError):
            send_message(sock, {"error": f"{type(exc).__name__}: {exc}"})
        return 1
    finally:
        sock.close()
    return 0


def check_map_latency() -> Figures:
    """Per-page map and unmap cost of the backend, the raw driver, and ``torch.empty``.

    Guarantees on PASS: ``LATENCY_PAGES`` pages map one by one, are readable and
    writable through one view over the whole range, and unmap one by one and
    all at once; mapped again as one run (``map_pages``), they hold what is written. Figures are per call, in microseconds (median and p99):
    ``create`` (cuMemCreate), ``map`` (backend: cuMemMap + cuMemSetAccess +
    bookkeeping), ``map_run_us_per_page`` (``map_pages`` of them all, per page), ``unmap`` (backend: cuCtxSynchronize + cuMemUnmap),
    ``raw_map``/``raw_set_access``/``raw_unmap`` (the bare driver calls on
    another range), and ``torch_empty`` of one page (the caching allocator, from
    an emptied cache; an engine's usual allocation, not a driver floor).
    Cost: a few seconds and ``LATENCY_PAGES`` pages of device memory.
    """
    import torch

    from kvdaemon.cuda_vmm import CudaBackend

    figures: Figures = {"pages": LATENCY_PAGES, "page_size_bytes": PAGE}
    with started(CudaBackend(num_pages=LATENCY_PAGES)) as backend:
        pages: list[PhysicalPage] = []
        create_ns: list[int] = []
        for i in range(LATENCY_PAGES):
            t0 = time.perf_counter_ns()
            pages.append(backend.create_page(i))
            create_ns.append(time.perf_counter_ns() - t0)
        addr = backend.reserve(LATENCY_PAGES * PAGE)
        slots = [addr + i * PAGE for i in range(LATENCY_PAGES)]
        map_ns: list[int] = []
        for slot, page in zip(slots, pages, strict=True):
            t0 = time.perf_counter_ns()
            backend.map_page(slot, page)
            map_ns.append(time.perf_counter_ns() - t0)
        unmap_ns: list[int] = []
        for slot in slots:
            t0 = time.perf_counter_ns()
            backend.unmap(slot, PAGE)
            unmap_ns.append(time.perf_counter_ns() - t0)

        for slot, page in zip(slots, pages, strict=True):
            backend.map_page(slot, page)
        view = backend.tensor(addr, LATENCY_PAGES * PAGE, torch.int32)
        view.fill_(7)
        torch.cuda.synchronize()
        require(bool((view == 7).all()), "a mapped page did not keep what was written")
        del view
        t0 = time.perf_counter_ns()
        backend.unmap(addr, LATENCY_PAGES * PAGE)
        range_unmap_ns = time.perf_counter_ns() - t0
        t0 = time.perf_counter_ns()
        backend.map_pages(addr, pages)  # a grant's run: a cuMemMap a page, one cuMemSetAccess
        run_map_ns = time.perf_counter_ns() - t0
        view = backend.tensor(addr, LATENCY_PAGES * PAGE, torch.int32)
        view.fill_(9)
        torch.cuda.synchronize()
        require(bool((view == 9).all()), "a page mapped in a run did not keep what was written")
        del view
        backend.unmap(addr, LATENCY_PAGES * PAGE)

        figures |= spread("create", create_ns)
        figures |= spread("map", map_ns)
        figures |= spread("unmap", unmap_ns)
        figures["unmap_whole_range_us_per_page"] = round(range_unmap_ns / 1e3 / LATENCY_PAGES, 2)
        figures["map_run_us_per_page"] = round(run_map_ns / 1e3 / LATENCY_PAGES, 2)
        figures |= raw_driver_costs(pages, backend.device)
    figures |= spread("torch_empty", torch_empty_costs())
    figures["map_over_raw_map_set_access"] = round(
        float(figures["map_median_us"])
        / (float(figures["raw_map_median_us"]) + float(figures["raw_set_access_median_us"])),
        2,
    )
    return figures


def raw_driver_costs(pages: list[PhysicalPage], device: int) -> Figures:
    """The bare cuMemMap, cuMemSetAccess and cuMemUnmap per page, on a range of its own.

    Needs the primary context current on this thread (a started CudaBackend
    leaves it so). Cost: three driver calls per page, plus one reserve and free.
    """
    from kvdaemon.cuda_vmm.cuda import load_driver
    from kvdaemon.errors import BackendError

    drv = load_driver()

    def ok(result: tuple[object, ...], what: str) -> object:
        if result[0] != drv.CUresult.CUDA_SUCCESS:
            raise BackendError(f"{what} failed", str(result[0]))
        return result[1] if len(result) > 1 else None

    access = drv.CUmemAccessDesc()
    access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = device
    access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    size = len(pages) * PAGE
    base = int(ok(drv.cuMemAddressReserve(size, PAGE, 0, 0), "cuMemAddressReserve"))
    map_ns: list[int] = []
    access_ns: list[int] = []
    unmap_ns: list[int] = []
    try:
        for i, page in enumerate(pages):
            ptr = drv.CUdeviceptr(base + i * PAGE)
            t0 = time.perf_counter_ns()
            ok(drv.cuMemMap(ptr, PAGE, 0, page.handle, 0), "cuMemMap")
            t1 = time.perf_counter_ns()
            map_ns.append(t1 - t0)
            ok(drv.cuMemSetAccess(ptr, PAGE, [access], 1), "cuMemSetAccess")
            access_ns.append(time.perf_counter_ns() - t1)
        for i in range(len(pages)):
            ptr = drv.CUdeviceptr(base + i * PAGE)
            t0 = time.perf_counter_ns()
            ok(drv.cuMemUnmap(ptr, PAGE), "cuMemUnmap")
            unmap_ns.append(time.perf_counter_ns() - t0)
    finally:
        if len(unmap_ns) < len(map_ns):  # failed half-way: leave nothing mapped
            for i in range(len(unmap_ns), len(map_ns)):
                drv.cuMemUnmap(drv.CUdeviceptr(base + i * PAGE), PAGE)
        ok(drv.cuMemAddressFree(drv.CUdeviceptr(base), size), "cuMemAddressFree")
    return (
        spread("raw_map", map_ns)
        | spread("raw_set_access", access_ns)
        | spread("raw_unmap", unmap_ns)
    )


def torch_empty_costs() -> list[int]:
    """Nanoseconds per ``torch.empty`` of one page, ``LATENCY_PAGES`` held at once.

    The cache is emptied first, so the first calls reach cudaMalloc and the rest
    are served from the segments those made. Cost: ``LATENCY_PAGES`` pages of
    device memory, given back at the end.
    """
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    held: list[torch.Tensor] = []
    samples: list[int] = []
    for _ in range(LATENCY_PAGES):
        t0 = time.perf_counter_ns()
        held.append(torch.empty(PAGE, dtype=torch.uint8, device="cuda"))
        samples.append(time.perf_counter_ns() - t0)
    del held
    torch.cuda.empty_cache()
    return samples


def check_torch_view() -> Figures:
    """Torch reads back through a second view what it wrote through a first one.

    Guarantees on PASS: a view's ``data_ptr`` is the mapped address; a second
    view at that address, and a view at an offset inside the range, see the
    bytes written through the first; copy bandwidth into a view is reported
    against a copy into a plain torch tensor of the same size.
    Cost: ``VIEW_PAGES`` pages of device memory and ``2 * COPY_REPEATS`` copies.
    """
    import torch

    from kvdaemon.cuda_vmm import CudaBackend

    size = VIEW_PAGES * PAGE
    with started(CudaBackend(num_pages=VIEW_PAGES)) as backend:
        addr = backend.reserve(size)
        for i in range(VIEW_PAGES):
            backend.map_page(addr + i * PAGE, backend.create_page(i))
        first = backend.tensor(addr, size, torch.int32)
        require(first.data_ptr() == addr, f"view at {first.data_ptr():#x}, mapped at {addr:#x}")
        first.copy_(pattern(size // 4, seed=11))
        torch.cuda.synchronize()
        check_copy(backend.tensor(addr, size, torch.int32), 11, "second view at the same address")
        offset_view = backend.tensor(addr + PAGE, PAGE, torch.int32)
        require(torch.equal(offset_view, first[WORDS : 2 * WORDS]), "view at an offset differs")

        source = torch.randint(0, 2**31 - 1, (size // 4,), dtype=torch.int32, device="cuda")
        plain = torch.empty_like(source)
        view_gbps = copy_bandwidth_gbps(source, first)
        plain_gbps = copy_bandwidth_gbps(source, plain)
        require(torch.equal(first, source), "the copy into the view did not land")
        del first, offset_view
    return {
        "bytes_checked": size,
        "copy_into_view_gbps": round(view_gbps, 1),
        "copy_into_torch_tensor_gbps": round(plain_gbps, 1),
        "view_over_torch_bandwidth": round(view_gbps / plain_gbps, 3),
    }


def copy_bandwidth_gbps(source: torch.Tensor, target: torch.Tensor) -> float:
    """GB/s (read + write) of ``target.copy_(source)``, best of ``COPY_REPEATS`` timed runs."""
    import torch

    target.copy_(source)  # warm-up
    best_ms = float("inf")
    for _ in range(COPY_REPEATS):
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        begin.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        best_ms = min(best_ms, begin.elapsed_time(end))
    return 2 * source.numel() * source.element_size() / (best_ms / 1e3) / 1e9


def check_view_before_map() -> Figures:
    """A view made over a reserved, still unmapped range works once pages are mapped.

    Guarantees on PASS: ``backend.tensor`` does not need the memory mapped when
    the view is made (the client makes its KV tensors before it grows), on this
    torch, and writes through that early view reach the pages mapped later.
    Also reports, without judging, whether this torch's ``as_tensor`` over
    ``__cuda_array_interface__`` accepts an unmapped address when given an
    explicit device (the path ``device_view`` falls back to).
    Cost: two pages of device memory.
    """
    import torch

    from kvdaemon.cuda_vmm import CudaBackend

    with started(CudaBackend(num_pages=2)) as backend:
        addr = backend.reserve(2 * PAGE)
        early = backend.tensor(addr, 2 * PAGE, torch.int32)
        require(early.data_ptr() == addr, f"view at {early.data_ptr():#x}, reserved at {addr:#x}")
        interface_view = _interface_view_before_map(addr, backend.device)
        backend.map_page(addr + PAGE, backend.create_page(1))  # the second slot first
        backend.map_page(addr, backend.create_page(0))
        early.copy_(pattern(2 * WORDS, seed=3))
        torch.cuda.synchronize()
        check_copy(backend.tensor(addr, 2 * PAGE, torch.int32), 3, "a later view")
        del early
    return {
        "bytes_checked": 2 * PAGE,
        "torch": torch.__version__,
        "explicit_device_storage": hasattr(torch._C, "_construct_storage_from_data_pointer"),
        "cuda_array_interface_before_map": interface_view,
    }


def _interface_view_before_map(addr: int, device: int) -> str:
    """``ok`` when ``torch.as_tensor`` takes an unmapped address through ``__cuda_array_interface__``."""
    import torch

    class Bytes:
        __cuda_array_interface__ = {"shape": (PAGE,), "typestr": "|u1", "data": (addr, False), "version": 3}

    try:
        torch.as_tensor(Bytes(), device=f"cuda:{device}")
    except (RuntimeError, TypeError, ValueError) as exc:
        return f"refused: {type(exc).__name__}: {str(exc)[:120]}"
    return "ok"


def check_zeroed_pages() -> Figures:
    """Created pages read zero, also where the memory held another page's bytes just before.

    Guarantees on PASS: ``ZERO_PAGES`` pages filled with a pattern and released,
    then ``ZERO_PAGES`` new ones created (the driver may hand out the same
    memory): every byte of the new ones reads zero. Reports the per-page cost of
    ``create_page`` (cuMemCreate plus the zeroing map, memset and unmap).
    Cost: ``2 * ZERO_PAGES`` pages of device memory at most.
    """
    import torch

    from kvdaemon.cuda_vmm import CudaBackend

    size = ZERO_PAGES * PAGE
    with started(CudaBackend(num_pages=2 * ZERO_PAGES)) as backend:
        addr = backend.reserve(size)
        first = [backend.create_page(i) for i in range(ZERO_PAGES)]
        map_run(backend, addr, first)
        backend.tensor(addr, size, torch.uint8).fill_(0xA5)
        torch.cuda.synchronize()
        backend.unmap(addr, size)
        for page in first:
            backend.release_page(page)
        t0 = time.perf_counter_ns()
        fresh = [backend.create_page(ZERO_PAGES + i) for i in range(ZERO_PAGES)]
        create_us = (time.perf_counter_ns() - t0) / 1e3 / ZERO_PAGES
        map_run(backend, addr, fresh)
        nonzero = int(backend.tensor(addr, size, torch.uint8).count_nonzero())
        require(nonzero == 0, f"{nonzero} bytes of fresh pages are not zero")
    return {"pages": ZERO_PAGES, "create_page_us": round(create_us, 1)}


def check_swap_copy() -> Figures:
    """Warm-sleep copies: device pages to host memory and back, bit-exact, with bandwidth.

    Guarantees on PASS: ``copy_out_pages`` then ``copy_in_pages`` into fresh
    pages restores every byte (what a warm sleep and wake do in the daemon:
    asynchronous chunked copies through host memory page-locked with
    ``pin_host``); the bandwidth of both directions is reported against
    torch's pinned-memory copies (target: the round trip >= 0.7x torch's).
    Cost: ``VIEW_PAGES`` pages twice, and the same bytes of host memory.
    """
    import mmap

    import torch

    from kvdaemon.cuda_vmm import CudaBackend

    size = VIEW_PAGES * PAGE
    with started(CudaBackend(num_pages=2 * VIEW_PAGES)) as backend:
        addr, pages = written_pages(backend, VIEW_PAGES, seed=5)
        host = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        view = memoryview(host)
        backend.pin_host(view)  # page-locked, as the daemon's warm copies are
        t0 = time.perf_counter()
        backend.copy_out_pages(pages, view)
        out_s = time.perf_counter() - t0
        backend.unmap(addr, size)
        fresh = [backend.create_page(VIEW_PAGES + i) for i in range(VIEW_PAGES)]
        t0 = time.perf_counter()
        backend.copy_in_pages(fresh, view)
        in_s = time.perf_counter() - t0
        map_run(backend, addr, fresh)
        check_copy(backend.tensor(addr, size, torch.int32), 5, "bytes restored into fresh pages")
        pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        device = torch.empty(size, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pinned.copy_(device)
        device.copy_(pinned)
        torch.cuda.synchronize()
        torch_s = time.perf_counter() - t0
        backend.unpin_host(view)
        view.release()
        host.close()
    return {
        "bytes": size,
        "copy_out_gbps": round(size / out_s / 1e9, 2),
        "copy_in_gbps": round(size / in_s / 1e9, 2),
        "torch_pinned_round_trip_gbps": round(2 * size / torch_s / 1e9, 2),
        "round_trip_vs_torch_pinned": round(torch_s / (out_s + in_s), 3),
    }




if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == CHILD_FLAG:
        sys.exit(run_cross_process_child(int(sys.argv[2])))
    sys.exit(f"usage: run the checks with bench/gpu_check.py ({CHILD_FLAG} is internal)")
