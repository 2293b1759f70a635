"""Cases run in a child process that loads the fake CUDA driver (see ``test_fake_driver.py``).

Run from the repository root with the fake driver's environment::

    python -m tests.cuda_vmm.fake_cases [CASE ...]

Each case is a function that raises on failure; ``tests.child_cases`` runs
them and reports each (a ``crash_*`` case runs alone and must kill the
process). Two groups: ``driver_*`` cases hold the fake driver to the rules of
the real one (raw cuda-bindings calls); ``backend_*`` cases run
``CudaBackend`` on it, with CPU views of its pages.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from cuda.bindings import driver as drv

from kvdaemon.cuda_vmm import CudaBackend
from kvdaemon.errors import BackendError

from tests import child_cases
from tests.cuda_vmm import fake_driver

PAGE = 2 * 1024 * 1024
CASES: dict[str, Callable[[], None]] = {}
CRASHES: dict[str, Callable[[], None]] = {}  # cases that must kill the process; run one at a time
OK = drv.CUresult.CUDA_SUCCESS
E = drv.CUresult


def case(fn: Callable[[], None]) -> Callable[[], None]:
    CASES[fn.__name__] = fn
    return fn


def expect(result: tuple[Any, ...], code: drv.CUresult, what: str) -> Any:
    assert result[0] == code, f"{what}: {result[0]!r}, expected {code!r}"
    return result[1] if len(result) > 1 else None


def started(num_pages: int = 8) -> CudaBackend:
    backend = CudaBackend(num_pages=num_pages)
    backend.start()
    return backend


_log_mark = 0  # calls logged before the running case


def driver_log() -> list[fake_driver.Call]:
    """This process's driver calls since the running case began."""
    calls = fake_driver.read_log(Path(os.environ["FAKE_CUDA_LOG"]))[_log_mark:]
    return [c for c in calls if c.pid == os.getpid()]


def reserve(size: int) -> int:
    return int(expect(drv.cuMemAddressReserve(size, 0, 0, 0), OK, "cuMemAddressReserve"))


class Raw:
    """Raw driver objects on device 0, with the primary context current on this thread."""

    def __init__(self) -> None:
        expect(drv.cuInit(0), OK, "cuInit")
        self.ctx = expect(drv.cuDevicePrimaryCtxRetain(0), OK, "retain")
        expect(drv.cuCtxSetCurrent(self.ctx), OK, "set current")
        self.prop = drv.CUmemAllocationProp()
        self.prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.prop.requestedHandleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self.access = drv.CUmemAccessDesc()
        self.access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE

    def create(self) -> Any:
        return expect(drv.cuMemCreate(PAGE, self.prop, 0), OK, "cuMemCreate")

    def map(self, addr: int, handle: Any) -> None:
        expect(drv.cuMemMap(addr, PAGE, 0, handle, 0), OK, "cuMemMap")
        expect(drv.cuMemSetAccess(addr, PAGE, [self.access], 1), OK, "cuMemSetAccess")


# --- the fake holds the real driver's rules -------------------------------------------


@case
def driver_calls_need_a_current_context_on_each_thread() -> None:
    raw = Raw()
    answers: dict[str, Any] = {}

    def other_thread() -> None:
        answers["create"] = drv.cuMemCreate(PAGE, raw.prop, 0)[0]
        answers["reserve"] = drv.cuMemAddressReserve(PAGE, 0, 0, 0)[0]
        expect(drv.cuCtxSetCurrent(raw.ctx), OK, "set current")
        answers["with_context"] = drv.cuMemAddressReserve(PAGE, 0, 0, 0)

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert answers["create"] == E.CUDA_ERROR_INVALID_CONTEXT, answers
    assert answers["reserve"] == E.CUDA_ERROR_INVALID_CONTEXT, answers
    addr = int(expect(answers["with_context"], OK, "reserve with a context"))
    expect(drv.cuMemAddressFree(addr, PAGE), OK, "free")
    # A released primary context is no context: calls fail again.
    expect(drv.cuDevicePrimaryCtxRelease(0), OK, "release")
    expect(drv.cuMemAddressReserve(PAGE, 0, 0, 0), E.CUDA_ERROR_INVALID_CONTEXT, "after release")


@case
def driver_fresh_allocations_hold_garbage_and_access_must_be_set() -> None:
    raw = Raw()
    addr = reserve(2 * PAGE)
    handle = raw.create()
    expect(drv.cuMemMap(addr, PAGE, 0, handle, 0), OK, "map")
    host = torch.zeros(PAGE, dtype=torch.uint8)
    expect(drv.cuMemcpyDtoH(host.data_ptr(), addr, PAGE), E.CUDA_ERROR_ILLEGAL_ADDRESS,
           "a copy before cuMemSetAccess")
    assert int(host.count_nonzero()) == 0, "a refused copy wrote"
    expect(drv.cuMemSetAccess(addr, PAGE, [raw.access], 1), OK, "set access")
    expect(drv.cuMemcpyDtoH(host.data_ptr(), addr, PAGE), OK, "a copy after cuMemSetAccess")
    high = fake_driver.GARBAGE_HIGH_BITS
    assert bool(((host & high) == high).all()), "a fresh allocation read zero somewhere"


@case
def driver_unmapping_what_is_not_mapped_fails_and_changes_nothing() -> None:
    raw = Raw()
    addr = reserve(2 * PAGE)
    expect(drv.cuMemUnmap(addr, PAGE), E.CUDA_ERROR_INVALID_VALUE, "unmap of an unmapped slot")
    raw.map(addr, raw.create())
    expect(drv.cuMemUnmap(addr, 2 * PAGE), E.CUDA_ERROR_INVALID_VALUE, "unmap past the mapping")
    expect(drv.cuMemAddressFree(addr, 2 * PAGE), E.CUDA_ERROR_INVALID_VALUE, "free of a mapped range")
    expect(drv.cuPointerGetAttribute(drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_POINTER, addr),
           OK, "the refused calls left the mapping")
    expect(drv.cuMemUnmap(addr, PAGE), OK, "unmap")
    expect(drv.cuMemUnmap(addr, PAGE), E.CUDA_ERROR_INVALID_VALUE, "a second unmap")
    expect(drv.cuMemAddressFree(addr, 2 * PAGE), OK, "free")


@case
def driver_a_released_handle_lives_until_its_last_mapping() -> None:
    raw = Raw()
    addr = reserve(2 * PAGE)
    handle = raw.create()
    raw.map(addr, handle)
    view = torch.frombuffer(_bytes_at(addr, PAGE), dtype=torch.uint8)
    view.fill_(42)
    expect(drv.cuMemRelease(handle), OK, "release while mapped")
    assert int(view[PAGE - 1]) == 42, "the memory went with the handle"
    expect(drv.cuMemMap(addr + PAGE, PAGE, 0, handle, 0), E.CUDA_ERROR_INVALID_HANDLE, "map a released handle")
    expect(drv.cuMemRelease(handle), E.CUDA_ERROR_INVALID_VALUE, "release twice")
    del view
    expect(drv.cuMemUnmap(addr, PAGE), OK, "the last unmap")


def _bytes_at(addr: int, size: int) -> Any:
    return (ctypes.c_ubyte * size).from_address(addr)


@case
def driver_pointer_attribute_fails_on_reserved_unmapped_addresses() -> None:
    raw = Raw()
    attr = drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_POINTER
    addr = reserve(2 * PAGE)
    expect(drv.cuPointerGetAttribute(attr, addr), E.CUDA_ERROR_INVALID_VALUE, "reserved, unmapped")
    raw.map(addr + PAGE, raw.create())
    assert int(expect(drv.cuPointerGetAttribute(attr, addr + PAGE + 64), OK, "mapped")) == addr + PAGE + 64
    expect(drv.cuPointerGetAttribute(attr, addr), E.CUDA_ERROR_INVALID_VALUE, "still unmapped")
    plain = torch.zeros(16)
    expect(drv.cuPointerGetAttribute(attr, plain.data_ptr()), E.CUDA_ERROR_INVALID_VALUE, "host memory")


@case
def driver_exported_fds_import_as_the_same_memory() -> None:
    raw = Raw()
    kind = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    addr = reserve(2 * PAGE)
    handle = raw.create()
    fd = int(expect(drv.cuMemExportToShareableHandle(handle, kind, 0), OK, "export"))
    imported = expect(drv.cuMemImportFromShareableHandle(fd, kind), OK, "import")
    os.close(fd)
    raw.map(addr, handle)
    raw.map(addr + PAGE, imported)
    _bytes_at(addr, PAGE)[7] = 99
    assert _bytes_at(addr + PAGE, PAGE)[7] == 99
    with open(os.devnull, "rb") as other:
        expect(drv.cuMemImportFromShareableHandle(other.fileno(), kind), E.CUDA_ERROR_INVALID_VALUE,
               "import of a file that is no exported allocation")


@case
def driver_log_names_thread_and_context_of_every_call() -> None:
    Raw()
    seen = threading.Event()

    def other_thread() -> None:
        drv.cuMemAddressReserve(PAGE, 0, 0, 0)  # no context here: refused and logged
        seen.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    mine = driver_log()
    ctx_calls = [c for c in mine if c.name == "cuCtxSetCurrent" and c.tid == threading.get_native_id()]
    assert ctx_calls and ctx_calls[-1].context is not None
    refused = [c for c in mine if c.name == "cuMemAddressReserve" and c.tid == thread.native_id]
    assert refused and refused[-1].context is None
    assert refused[-1].result == int(E.CUDA_ERROR_INVALID_CONTEXT)


def crash(fn: Callable[[], None]) -> Callable[[], None]:
    CRASHES[fn.__name__] = fn
    return fn


@crash
def crash_touching_a_mapping_before_its_access_is_set() -> None:
    raw = Raw()
    addr = reserve(PAGE)
    expect(drv.cuMemMap(addr, PAGE, 0, raw.create(), 0), OK, "map")
    print(_bytes_at(addr, PAGE)[0], flush=True)  # a fault: no cuMemSetAccess yet


# --- CudaBackend on the fake driver ----------------------------------------------------


@case
def backend_starts_on_the_fake_device_with_cpu_views() -> None:
    backend = started()
    assert backend.device_name == fake_driver.DEVICE_NAME
    assert backend.host_memory and backend.granularity_bytes == PAGE
    addr = backend.reserve(2 * PAGE)
    view = backend.tensor(addr, 2 * PAGE, torch.int32)  # before anything is mapped
    assert view.device.type == "cpu" and view.data_ptr() == addr and view.numel() == 2 * PAGE // 4
    backend.map_page(addr + PAGE, backend.create_page(1))
    backend.map_page(addr, backend.create_page(0))
    view.copy_(torch.arange(view.numel(), dtype=torch.int32))
    later = backend.tensor(addr + PAGE, PAGE, torch.int32)
    assert torch.equal(later, torch.arange(PAGE // 4, 2 * PAGE // 4, dtype=torch.int32))
    del view, later
    backend.close()


@case
def backend_created_pages_read_zero_over_the_drivers_garbage() -> None:
    backend = started()
    addr = backend.reserve(4 * PAGE)
    pages = [backend.create_page(i) for i in range(4)]
    for i, page in enumerate(pages):
        backend.map_page(addr + i * PAGE, page)
    assert int(backend.tensor(addr, 4 * PAGE, torch.uint8).count_nonzero()) == 0
    memsets = [c for c in driver_log() if c.name == "cuMemsetD8" and c.result == 0]
    assert len(memsets) == 4 and all(f"size={PAGE}" in c.detail for c in memsets)
    backend.close()


@case
def driver_async_copies_need_a_live_stream_and_access() -> None:
    raw = Raw()
    stream = expect(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING), OK, "cuStreamCreate")
    addr = reserve(PAGE)
    handle = raw.create()
    host = torch.zeros(PAGE, dtype=torch.uint8)
    expect(drv.cuMemMap(addr, PAGE, 0, handle, 0), OK, "cuMemMap")
    expect(drv.cuMemcpyDtoHAsync(host.data_ptr(), addr, PAGE, stream), E.CUDA_ERROR_ILLEGAL_ADDRESS,
           "an async copy before cuMemSetAccess")
    expect(drv.cuMemSetAccess(addr, PAGE, [raw.access], 1), OK, "set access")
    expect(drv.cuMemcpyDtoHAsync(host.data_ptr(), addr, PAGE, stream), OK, "an async copy")
    expect(drv.cuStreamSynchronize(stream), OK, "cuStreamSynchronize")
    expect(drv.cuStreamDestroy(stream), OK, "cuStreamDestroy")
    expect(drv.cuMemcpyHtoDAsync(addr, host.data_ptr(), PAGE, stream), E.CUDA_ERROR_INVALID_HANDLE,
           "a copy on a destroyed stream")
    expect(drv.cuStreamSynchronize(stream), E.CUDA_ERROR_INVALID_HANDLE, "a sync of a destroyed stream")


@case
def backend_bulk_copies_round_trip_in_chunks_through_pinned_buffers() -> None:
    from kvdaemon.cuda_vmm.cuda import STAGING_PAGES

    num = STAGING_PAGES + 5  # two chunks: both staging slots in use
    backend = started(num_pages=2 * num)
    addr = backend.reserve(num * PAGE)
    pages = [backend.create_page(i) for i in range(num)]
    for i, page in enumerate(pages):
        backend.map_page(addr + i * PAGE, page)
    written = torch.randint(0, 1 << 30, (num * PAGE // 4,), dtype=torch.int32)
    backend.tensor(addr, num * PAGE, torch.int32).copy_(written)
    host = bytearray(num * PAGE)
    backend.pin_host(memoryview(host))
    order = pages[::-1]  # page i of the buffer is the i-th page asked for
    backend.copy_out_pages(order, memoryview(host))
    fresh = [backend.create_page(num + i) for i in range(num)]
    backend.copy_in_pages(fresh[::-1], memoryview(host))
    backend.unpin_host(memoryview(host))
    backend.unmap(addr, num * PAGE)
    for i, page in enumerate(fresh):
        backend.map_page(addr + i * PAGE, page)
    assert torch.equal(backend.tensor(addr, num * PAGE, torch.int32), written)
    copies = [c for c in driver_log() if c.name.startswith("cuMemcpy")]
    assert {c.name for c in copies} == {"cuMemcpyDtoHAsync", "cuMemcpyHtoDAsync"}
    assert len(copies) == 4, "one copy per chunk each way"
    assert all("pinned=1" in c.detail and c.result == 0 for c in copies)
    with pytest.raises(BackendError, match="bytes"):
        backend.copy_out_pages(pages[:2], memoryview(host)[:PAGE])
    backend.close()


@case
def backend_sliced_swap_round_trips_with_other_work_between_slices() -> None:
    """A daemon's warm copy a page per step (``swap.save``/``restore``), the loop's other
    work between steps (pages made, zeroed and written through the staging slot)."""
    from kvdaemon.daemon import swap
    from kvdaemon.daemon.copies import run_through

    backend = started(num_pages=64)
    backend.copy_slice_bytes = PAGE
    pages = [backend.create_page(i) for i in range(4)]
    for i, page in enumerate(pages):
        backend.copy_in(page, memoryview(bytearray([i + 1]) * PAGE))
    logical = {lp: [pages[2 * lp], pages[2 * lp + 1]] for lp in range(2)}
    cache = swap.BufferCache(1 << 30, backend)
    steps, num_steps = swap.save(backend, logical, 2, cache), 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            copy = done.value
            break
        num_steps += 1
        other = backend.create_page(20 + num_steps)  # the loop's work between two slices
        backend.copy_in(other, memoryview(bytearray(b"\xee") * PAGE))
    assert num_steps >= 3, "a page per step of the copy"
    fresh = {lp: [backend.create_page(10 + 2 * lp), backend.create_page(11 + 2 * lp)] for lp in range(2)}
    run_through(swap.restore(backend, copy, fresh))
    out = bytearray(PAGE)
    for i, page in enumerate(page for lp in (0, 1) for page in fresh[lp]):
        backend.copy_out(page, memoryview(out))
        assert out == bytes([i + 1]) * PAGE, f"page {i} came back wrong"
    copy.discard()
    cache.clear()
    backend.close()


@case
def backend_page_copies_round_trip_through_pinned_buffers() -> None:
    backend = started()
    addr = backend.reserve(PAGE)
    page = backend.create_page(0)
    backend.map_page(addr, page)
    backend.tensor(addr, PAGE, torch.int32).copy_(torch.arange(PAGE // 4, dtype=torch.int32) * 7)
    host = bytearray(PAGE)
    backend.pin_host(memoryview(host))
    backend.copy_out(page, memoryview(host))
    fresh = backend.create_page(1)
    backend.copy_in(fresh, memoryview(host))
    backend.unpin_host(memoryview(host))
    backend.unmap(addr, PAGE)
    backend.map_page(addr, fresh)
    assert torch.equal(backend.tensor(addr, PAGE, torch.int32), torch.arange(PAGE // 4, dtype=torch.int32) * 7)
    copies = [c for c in driver_log() if c.name.startswith("cuMemcpy")]
    assert [c.name for c in copies] == ["cuMemcpyDtoH", "cuMemcpyHtoD"]
    assert all("pinned=1" in c.detail and c.result == 0 for c in copies)
    with pytest.raises(BackendError, match="HOST_MEMORY_NOT_REGISTERED"):
        backend.unpin_host(memoryview(host))
    backend.close()


@case
def backend_calls_work_from_any_thread() -> None:
    backend = started()
    addr = backend.reserve(2 * PAGE)
    errors: list[BaseException] = []

    def worker() -> None:  # a thread that never set a context itself
        try:
            backend.map_page(addr, backend.create_page(0))
            backend.unmap(addr, PAGE)
        except BaseException as exc:  # noqa: BLE001 (reported to the main thread)
            errors.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert not errors, errors
    theirs = [c for c in driver_log() if c.tid == thread.native_id]
    assert theirs and all(c.result == 0 and c.context is not None for c in theirs if c.name != "cuCtxSetCurrent")
    backend.close()


@case
def backend_device_pointer_is_the_launchers_check() -> None:
    backend = started()
    addr = backend.reserve(2 * PAGE)
    with pytest.raises(BackendError, match="CUDA_ERROR_INVALID_VALUE"):
        backend.device_pointer(addr)
    backend.map_page(addr, backend.create_page(0))
    assert backend.device_pointer(addr) == addr
    with pytest.raises(BackendError, match="CUDA_ERROR_INVALID_VALUE"):
        backend.device_pointer(addr + PAGE)
    backend.close()


@case
def backend_close_releases_every_handle() -> None:
    backend = started()
    addr = backend.reserve(2 * PAGE)
    backend.map_page(addr, backend.create_page(0))
    backend.create_page(1)  # created, never mapped
    backend.close()
    mine = driver_log()
    created = {c.detail.split("handle=")[1] for c in mine if c.name == "cuMemCreate" and c.result == 0}
    released = {c.detail.split("handle=")[1] for c in mine if c.name == "cuMemRelease" and c.result == 0}
    assert created and created <= released, (created, released)
    frees = [c for c in mine if c.name == "cuMemAddressFree"]
    assert frees and all(c.result == 0 for c in frees)


class Refusing:
    """The driver module with some calls refused: ``plan`` maps a call's name to what its next
    calls do, in order (True: answer CUDA_ERROR_OUT_OF_MEMORY; False: pass through); a call
    past its plan passes through."""

    def __init__(self, real: Any, plan: dict[str, list[bool]]) -> None:
        self._real, self._plan = real, plan

    def __getattr__(self, name: str) -> Any:
        call = getattr(self._real, name)
        if name not in self._plan:
            return call

        def planned(*args: Any) -> tuple[Any, ...]:
            steps = self._plan[name]
            if steps and steps.pop(0):
                return (E.CUDA_ERROR_OUT_OF_MEMORY,)
            return call(*args)

        return planned


@case
def backend_map_pages_sets_the_access_of_a_run_at_once() -> None:
    backend = started()
    addr = backend.reserve(5 * PAGE)
    pages = [backend.create_page(i) for i in (3, 0, 4, 1)]  # any pages: each is its own handle
    mark_log()
    backend.map_pages(addr + PAGE, pages)
    calls = [c.name for c in driver_log() if c.name in ("cuMemMap", "cuMemSetAccess")]
    assert calls == ["cuMemMap"] * 4 + ["cuMemSetAccess"], calls
    view = backend.tensor(addr + PAGE, 4 * PAGE, torch.uint8)
    view.fill_(7)  # every page writable: touching one without access would fault
    assert int(view.sum()) == 7 * 4 * PAGE and not backend.is_mapped(addr)
    backend._drv, real = Refusing(backend._drv, {"cuMemSetAccess": [True]}), backend._drv
    with pytest.raises(BackendError, match="cuMemSetAccess"):
        backend.map_pages(addr, [backend.create_page(2)])
    backend._drv = real
    assert not backend.is_mapped(addr), "a run whose access was refused is unmapped again"
    del view
    backend.close()


@case
def backend_a_map_whose_rollback_the_driver_refuses_keeps_the_slot_mapped() -> None:
    backend = started()
    addr = backend.reserve(3 * PAGE)
    pages = [backend.create_page(i) for i in range(3)]
    real = backend._drv
    backend._drv = Refusing(real, {"cuMemSetAccess": [True], "cuMemUnmap": [True]})
    with pytest.raises(BackendError, match="cuMemSetAccess"):
        backend.map_page(addr, pages[0])
    assert backend.is_mapped(addr), "the driver still maps it: the book must say so"
    backend._drv = real
    backend.unmap(addr, PAGE)
    assert not backend.is_mapped(addr)
    # map_pages: the second page's map refused, then the rollback's unmap of the first
    backend._drv = Refusing(real, {"cuMemMap": [False, True], "cuMemUnmap": [True]})
    with pytest.raises(BackendError, match="cuMemMap"):
        backend.map_pages(addr + PAGE, pages[1:])
    backend._drv = real
    assert [backend.is_mapped(addr + i * PAGE) for i in range(3)] == [False, True, False]
    backend.unmap(addr + PAGE, PAGE)
    backend.close()


def mark_log() -> None:
    """Start the running case's view of the driver log here."""
    global _log_mark
    _log_mark = len(fake_driver.read_log(Path(os.environ["FAKE_CUDA_LOG"])))


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] in CRASHES:
        CRASHES[sys.argv[1]]()
    else:
        child_cases.main(CASES, before_each=mark_log)
