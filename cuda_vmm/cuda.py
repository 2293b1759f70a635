"""The ``cuda`` backend: CUDA virtual memory management through cuda-python.

Pages are ``cuMemCreate`` allocations of ``page_size_bytes`` on one device,
created exportable as POSIX file descriptors so that another process can
``cuMemImportFromShareableHandle`` them. Ranges come from
``cuMemAddressReserve``; ``map_page`` is ``cuMemMap`` followed by
``cuMemSetAccess`` (read-write for this device); ``unmap`` synchronizes the
context first, so no kernel still reads the memory when it goes.

The device's primary context is made current on the calling thread at
``start()`` and before each driver call that needs one. A page stays alive
while any process maps it, even after its creator released it.

A page reads zero when it is created: ``cuMemCreate`` memory may hold what an
earlier owner (another tenant, another process) left in it, so ``create_page``
clears it through the staging slot (``cuMemsetD8``) before anyone maps it.

Views (``tensor``) are made without asking the driver about the pointer (see
:mod:`kvdaemon.cuda_vmm.device_view`), so they may be made before pages are
mapped. They are CUDA tensors, except on the test double of
``tests/cuda_vmm/fake_driver``: a device named ``kvdaemon fake CUDA ...`` keeps
"device" memory in host memory at the same addresses, and views there are CPU
tensors, so the whole CUDA path runs on machines without a GPU.

Bulk copies (``copy_out_pages``/``copy_in_pages``, a warm sleep's) map the
pages in chunks of ``STAGING_PAGES`` into two staging ranges and copy each
chunk with one asynchronous copy on its own stream, so the next chunk is
mapped while the last one is in flight; the host side is a page-locked buffer
(``pin_host``), so the copies are DMA at the link's speed.

Cost: one or two driver calls per operation (plus a ``cuCtxSynchronize`` per
``unmap``); ``create_page`` adds a map, a memset and an unmap.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvdaemon.cuda_vmm.address_book import AddressBook, free_every_range
from kvdaemon.cuda_vmm.backend import (
    COPY_SLICE_BYTES, DEFAULT_PAGE_SIZE_BYTES, MemInfo, PhysicalPage, check_bulk_buffer, unmap_slots,
)
from kvdaemon.cuda_vmm.device_view import address_view
from kvdaemon.errors import BackendError

if TYPE_CHECKING:
    import torch

STAGING_PAGES = 32
"""Pages per asynchronous bulk copy (two such chunks in flight at most)."""
HOST_MEMORY_DEVICE_PREFIX = "kvdaemon fake CUDA"
"""Device names of the test double whose device memory is host memory (views are CPU tensors)."""


def load_driver() -> Any:
    """Import ``cuda.bindings.driver`` and initialise it, or raise a clear BackendError."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise BackendError(
            "the cuda backend needs cuda-python: pip install 'kvdaemon[cuda]'"
        ) from exc
    try:
        from cuda.pathfinder import DynamicLibNotFoundError
    except ImportError:  # older cuda-python without pathfinder
        DynamicLibNotFoundError = OSError  # noqa: N806
    try:
        (err,) = driver.cuInit(0)
    except (DynamicLibNotFoundError, OSError, RuntimeError) as exc:
        raise BackendError(
            "no CUDA driver found on this machine (libcuda could not be loaded); "
            "use --backend host or install the NVIDIA driver",
            "NO_DRIVER",
        ) from exc
    if err != driver.CUresult.CUDA_SUCCESS:
        raise BackendError("CUDA driver failed to initialise (is there a GPU?)", _name(driver, err))
    return driver


def _name(driver: Any, err: Any) -> str:
    got, name = driver.cuGetErrorName(err)
    if got == driver.CUresult.CUDA_SUCCESS and name:
        return name.decode() if isinstance(name, bytes) else str(name)
    return str(err)


class CudaBackend:
    """Device-memory backend over the CUDA driver's VMM API (see the module docstring)."""

    name = "cuda"
    recycles_released_pages = False  # cuMemCreate memory needs no first-touch faults

    def __init__(
        self, num_pages: int = 0, page_size_bytes: int = DEFAULT_PAGE_SIZE_BYTES, device: int = 0
    ) -> None:
        if num_pages < 0:
            raise BackendError(f"number of pages must be >= 0, got {num_pages}")
        self.device = device
        self.page_size_bytes = page_size_bytes
        self.num_pages = num_pages
        self._drv: Any = None
        self._ctx: Any = None
        self._prop: Any = None
        self._access: Any = None
        self._granularity = 0
        self._book = AddressBook(page_size_bytes)
        self._created: dict[int, Any] = {}
        self._imported: dict[int, Any] = {}  # id(handle) -> handle, released at close()
        self._staging = 0  # a one-page range where copy_out/copy_in/zeroing map pages
        self._staging_lock = threading.Lock()  # one page at a time in the staging slot
        self._bulk: list[tuple[int, Any]] = []  # (staging range, stream) x 2 for bulk copies
        self._bulk_lock = threading.Lock()  # one bulk copy at a time
        self.device_name = ""
        self.host_memory = False  # True on the fake driver: views are CPU tensors
        # four staging chunks a slice: the two slots' pipeline runs within it
        self.copy_slice_bytes = max(COPY_SLICE_BYTES, 4 * STAGING_PAGES * page_size_bytes)

    @property
    def granularity_bytes(self) -> int:
        self._driver()
        return self._granularity

    def _check(self, result: Any, what: str) -> Any:
        err = result[0]
        if err != self._drv.CUresult.CUDA_SUCCESS:
            raise BackendError(f"{what} failed", _name(self._drv, err))
        return result[1] if len(result) == 2 else result[1:]

    def _driver(self) -> Any:
        if self._drv is None:
            raise BackendError("cuda backend is not started; call start() first")
        self._check(self._drv.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        return self._drv

    def start(self) -> None:
        if self._drv is not None:
            return
        drv = load_driver()
        self._drv = drv
        try:
            self._open_device(drv)
        except BackendError:
            if self._ctx is not None:
                self.close()
            self._drv = None
            raise

    def _open_device(self, drv: Any) -> None:
        num_devices = self._check(drv.cuDeviceGetCount(), "cuDeviceGetCount")
        if not 0 <= self.device < num_devices:
            raise BackendError(f"CUDA device {self.device} does not exist ({num_devices} found)")
        dev = self._check(drv.cuDeviceGet(self.device), "cuDeviceGet")
        name = self._check(drv.cuDeviceGetName(256, dev), "cuDeviceGetName")
        self.device_name = name.split(b"\0", 1)[0].decode(errors="replace")
        self.host_memory = self.device_name.startswith(HOST_MEMORY_DEVICE_PREFIX)
        self._ctx = self._check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        self._check(drv.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device
        prop.requestedHandleTypes = (
            drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        )
        self._prop = prop
        access = drv.CUmemAccessDesc()
        access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = access
        self._granularity = int(
            self._check(
                drv.cuMemGetAllocationGranularity(
                    prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
                ),
                "cuMemGetAllocationGranularity",
            )
        )
        if self.page_size_bytes <= 0 or self.page_size_bytes % self._granularity:
            raise BackendError(
                f"page size {self.page_size_bytes} must be a positive multiple of the "
                f"device granularity {self._granularity}"
            )

    def close(self) -> None:
        if self._drv is None:
            return
        free_every_range(self, self._book)
        for _, stream in self._bulk:
            self._drv.cuStreamDestroy(stream)
        self._bulk.clear()
        for handle in [*self._created.values(), *self._imported.values()]:
            self._drv.cuMemRelease(handle)
        self._created.clear()
        self._imported.clear()
        dev = self._check(self._drv.cuDeviceGet(self.device), "cuDeviceGet")
        self._drv.cuDevicePrimaryCtxRelease(dev)
        self._drv = None
        self._staging = 0
        self._ctx = None

    def reserve(self, size_bytes: int) -> int:
        self._book.check_size(size_bytes)
        drv = self._driver()
        ptr = self._check(
            drv.cuMemAddressReserve(size_bytes, self.page_size_bytes, 0, 0), "cuMemAddressReserve"
        )
        start = int(ptr)
        self._book.add_range(start, size_bytes)
        return start

    def free_range(self, addr: int) -> None:
        size_bytes = self._book.remove_range(addr)
        drv = self._driver()
        self._check(drv.cuMemAddressFree(drv.CUdeviceptr(addr), size_bytes), "cuMemAddressFree")

    def create_page(self, page_id: int) -> PhysicalPage:
        """A new page of device memory that reads zero (an earlier owner's bytes are cleared)."""
        drv = self._driver()
        if not isinstance(page_id, int) or not 0 <= page_id < self.num_pages:
            raise BackendError(f"page {page_id!r} is outside the pool of {self.num_pages} pages")
        if page_id in self._created:
            raise BackendError(f"page {page_id} already exists")
        handle = self._check(drv.cuMemCreate(self.page_size_bytes, self._prop, 0), "cuMemCreate")
        page = PhysicalPage(page_id, handle, 0)
        try:
            with self._staged(page) as device_ptr:
                self._check(drv.cuMemsetD8(device_ptr, 0, self.page_size_bytes), "cuMemsetD8")
        except BackendError:
            drv.cuMemRelease(handle)
            raise
        self._created[page_id] = handle
        return page

    def release_page(self, page: PhysicalPage) -> None:
        drv = self._driver()
        if self._created.get(page.page_id) is page.handle:
            del self._created[page.page_id]
        self._imported.pop(id(page.handle), None)
        self._check(drv.cuMemRelease(page.handle), "cuMemRelease")

    def release_pages(self, pages: list[PhysicalPage]) -> list[tuple[PhysicalPage, BackendError]]:
        """One ``cuMemRelease`` per page (each is an allocation of its own)."""
        failed: list[tuple[PhysicalPage, BackendError]] = []
        for page in pages:
            try:
                self.release_page(page)
            except BackendError as exc:
                failed.append((page, exc))
        return failed

    def export_page(self, page: PhysicalPage) -> int:
        drv = self._driver()
        kind = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        fd = self._check(
            drv.cuMemExportToShareableHandle(page.handle, kind, 0), "cuMemExportToShareableHandle"
        )
        return int(fd)

    def export_pages(self, pages: list[PhysicalPage]) -> tuple[list[int], list[int]]:
        fds: list[int] = []
        try:
            for page in pages:
                fds.append(self.export_page(page))
        except BackendError:
            for fd in fds:
                os.close(fd)
            raise
        return fds, list(range(len(fds)))

    def import_pages(
        self, fds: list[int], page_ids: list[int], fd_index: list[int]
    ) -> list[PhysicalPage]:
        if fd_index != list(range(len(fds))) or len(page_ids) != len(fds):
            for fd in fds:
                os.close(fd)
            raise BackendError("the cuda backend carries exactly one fd per page, in order")
        pages: list[PhysicalPage] = []
        for i, (fd, page_id) in enumerate(zip(fds, page_ids)):
            try:
                pages.append(self.import_page(fd, page_id))
            except BackendError:
                for rest in fds[i + 1 :]:
                    os.close(rest)
                for page in pages:
                    self.release_page(page)
                raise
        return pages

    def import_page(self, fd: int, page_id: int) -> PhysicalPage:
        drv = self._driver()
        kind = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        try:
            handle = self._check(
                drv.cuMemImportFromShareableHandle(fd, kind), "cuMemImportFromShareableHandle"
            )
        finally:
            os.close(fd)
        self._imported[id(handle)] = handle
        return PhysicalPage(page_id, handle, 0)

    def mappable_pages(self) -> int:
        """No OS cap binds: ``cuMemMap`` adds no mapping of the process's own."""
        return sys.maxsize

    def hold_mappings(self, num_mappings: int) -> None:
        """Nothing to keep: no cap binds (``mappable_pages``)."""

    def release_mappings(self, num_mappings: int) -> None:
        """Nothing kept."""

    def map_page(self, addr: int, page: PhysicalPage) -> None:
        drv = self._driver()
        self._book.mark_mapped(addr, page)
        ptr = drv.CUdeviceptr(addr)
        try:
            self._check(drv.cuMemMap(ptr, self.page_size_bytes, 0, page.handle, 0), "cuMemMap")
        except BackendError:
            self._book.unmark_mapped(addr)
            raise
        try:
            self._check(
                drv.cuMemSetAccess(ptr, self.page_size_bytes, [self._access], 1), "cuMemSetAccess"
            )
        except BackendError:
            err = drv.cuMemUnmap(ptr, self.page_size_bytes)[0]
            if err == drv.CUresult.CUDA_SUCCESS:  # else mapped still, as the book says (is_mapped)
                self._book.unmark_mapped(addr)
            raise

    def map_pages(self, addr: int, pages: list[PhysicalPage]) -> None:
        """A ``cuMemMap`` a page, then one ``cuMemSetAccess`` over the whole run (the driver
        takes a range of whole mappings); all or nothing: on a failure what this call mapped is
        unmapped again (``unmap_slots``: one whose unmap is refused too stays mapped)."""
        drv = self._driver()
        page_bytes, book = self.page_size_bytes, self._book
        num_mapped = 0
        try:
            for i, page in enumerate(pages):
                slot = addr + i * page_bytes
                book.mark_mapped(slot, page)
                try:
                    self._check(drv.cuMemMap(drv.CUdeviceptr(slot), page_bytes, 0, page.handle, 0), "cuMemMap")
                except BackendError:
                    book.unmark_mapped(slot)
                    raise
                num_mapped += 1
            if num_mapped:
                access = drv.cuMemSetAccess(drv.CUdeviceptr(addr), num_mapped * page_bytes, [self._access], 1)
                self._check(access, "cuMemSetAccess")
        except BackendError:
            unmap_slots(self, addr, num_mapped)
            raise

    def is_mapped(self, addr: int) -> bool:
        return self._book.is_mapped(addr)

    def unmap(self, addr: int, size_bytes: int) -> None:
        drv = self._driver()
        slots = list(self._book.slots(addr, size_bytes))
        self._check(drv.cuCtxSynchronize(), "cuCtxSynchronize")
        self._check(drv.cuMemUnmap(drv.CUdeviceptr(addr), size_bytes), "cuMemUnmap")
        for slot in slots:
            self._book.unmark_mapped(slot)

    def tensor(self, addr: int, size_bytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A view of ``dtype`` over the range. Nothing asks the driver about the pointer, so the
        pages may be mapped later (see :mod:`kvdaemon.cuda_vmm.device_view`)."""
        import torch

        self._book.check_view(addr, size_bytes)
        self._driver()
        device = torch.device("cpu") if self.host_memory else torch.device("cuda", self.device)
        return address_view(addr, size_bytes, dtype, device)

    def device_pointer(self, addr: int) -> int:
        """The device pointer at ``addr``, asked of the driver as Triton's launcher asks of
        every pointer argument (``cuPointerGetAttribute``); BackendError where nothing is mapped."""
        drv = self._driver()
        attribute = drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_POINTER
        return int(self._check(drv.cuPointerGetAttribute(attribute, addr), "cuPointerGetAttribute"))

    def mem_info(self) -> MemInfo:
        drv = self._driver()
        free, total = self._check(drv.cuMemGetInfo(), "cuMemGetInfo")
        return MemInfo(free_bytes=int(free), total_bytes=int(total))

    def prune_imports(self) -> None:
        """Nothing to do: each imported page is its own handle, released with the page."""

    def pin_host(self, buffer: memoryview) -> None:
        drv = self._driver()
        self._check(drv.cuMemHostRegister(_address(buffer), len(buffer), 0), "cuMemHostRegister")

    def unpin_host(self, buffer: memoryview) -> None:
        drv = self._driver()
        self._check(drv.cuMemHostUnregister(_address(buffer)), "cuMemHostUnregister")

    def copy_out(self, page: PhysicalPage, dest: memoryview) -> None:
        host_ptr = self._host_pointer(dest)
        with self._staged(page) as device_ptr:
            self._check(self._drv.cuMemcpyDtoH(host_ptr, device_ptr, self.page_size_bytes), "cuMemcpyDtoH")

    def copy_in(self, page: PhysicalPage, src: memoryview) -> None:
        host_ptr = self._host_pointer(src)
        with self._staged(page) as device_ptr:
            self._check(self._drv.cuMemcpyHtoD(device_ptr, host_ptr, self.page_size_bytes), "cuMemcpyHtoD")

    def copy_out_pages(self, pages: list[PhysicalPage], dest: memoryview) -> None:
        self._copy_pages(pages, dest, to_host=True)

    def copy_in_pages(self, pages: list[PhysicalPage], src: memoryview) -> None:
        self._copy_pages(pages, src, to_host=False)

    def _copy_pages(self, pages: list[PhysicalPage], host: memoryview, to_host: bool) -> None:
        """Page i of ``pages`` to or from ``host[i * page_size:]``, in chunks (module docstring)."""
        size = self.page_size_bytes
        check_bulk_buffer(len(pages), host, size)
        drv = self._driver()
        host_ptr = _address(host) if pages else 0
        with self._bulk_lock:
            slots = self._bulk_slots()
            in_flight = [0, 0]  # pages mapped in each slot, their copy queued on its stream
            try:
                for i, start in enumerate(range(0, len(pages), STAGING_PAGES)):
                    which = i % 2
                    self._drain(slots[which], in_flight, which)
                    base, stream = slots[which]
                    chunk = pages[start : start + STAGING_PAGES]
                    for j, page in enumerate(chunk):
                        self.map_page(base + j * size, page)
                        in_flight[which] = j + 1
                    num_bytes, at_host = len(chunk) * size, host_ptr + start * size
                    if to_host:
                        result = drv.cuMemcpyDtoHAsync(at_host, drv.CUdeviceptr(base), num_bytes, stream)
                    else:
                        result = drv.cuMemcpyHtoDAsync(drv.CUdeviceptr(base), at_host, num_bytes, stream)
                    self._check(result, "cuMemcpyDtoHAsync" if to_host else "cuMemcpyHtoDAsync")
            finally:
                for which in (0, 1):
                    self._drain(slots[which], in_flight, which)

    def _bulk_slots(self) -> list[tuple[int, Any]]:
        """The two staging ranges and their streams (made on first use, kept until close)."""
        if not self._bulk:
            flags = self._drv.CUstream_flags.CU_STREAM_NON_BLOCKING
            for _ in range(2):
                stream = self._check(self._drv.cuStreamCreate(flags), "cuStreamCreate")
                try:
                    base = self.reserve(STAGING_PAGES * self.page_size_bytes)
                except BackendError:
                    self._drv.cuStreamDestroy(stream)
                    raise
                self._bulk.append((base, stream))
        return self._bulk

    def _drain(self, slot: tuple[int, Any], in_flight: list[int], which: int) -> None:
        """Wait for the copy queued on ``slot``'s stream, then unmap its pages (no context-wide sync)."""
        if not in_flight[which]:
            return
        base, stream = slot
        num_bytes = in_flight[which] * self.page_size_bytes
        in_flight[which] = 0
        slots = list(self._book.slots(base, num_bytes))
        self._check(self._drv.cuStreamSynchronize(stream), "cuStreamSynchronize")
        self._check(self._drv.cuMemUnmap(self._drv.CUdeviceptr(base), num_bytes), "cuMemUnmap")
        for addr in slots:
            self._book.unmark_mapped(addr)

    def _host_pointer(self, buf: memoryview) -> int:
        if len(buf) != self.page_size_bytes:
            raise BackendError(f"a page copy needs {self.page_size_bytes} bytes, got {len(buf)}")
        return _address(buf)

    @contextlib.contextmanager
    def _staged(self, page: PhysicalPage) -> Iterator[Any]:
        """``page`` mapped at this backend's staging slot for the body (one page at a time);
        yields its device pointer and unmaps it after (synchronising first)."""
        self._driver()
        with self._staging_lock:
            if self._staging == 0:
                self._staging = self.reserve(self.page_size_bytes)
            self.map_page(self._staging, page)
            try:
                yield self._drv.CUdeviceptr(self._staging)
            finally:
                self.unmap(self._staging, self.page_size_bytes)


def _address(buffer: memoryview) -> int:
    """The address of a writable host buffer."""
    return ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))
