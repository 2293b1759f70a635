"""Bad input to the host backend: a BackendError naming the problem, nothing changed."""

from __future__ import annotations

import pytest
import torch

from kvdaemon.cuda_vmm import HostBackend, open_backend
from kvdaemon.cuda_vmm import host as host_module
from kvdaemon.errors import BackendError

from .conftest import PAGE_BYTES, make_host


@pytest.mark.parametrize("size", [0, -PAGE_BYTES, PAGE_BYTES + 4096, 1.5])
def test_reserve_refuses_bad_sizes(host: HostBackend, size: object) -> None:
    with pytest.raises(BackendError, match="size"):
        host.reserve(size)  # type: ignore[arg-type]


def test_map_refuses_misaligned_address(host: HostBackend) -> None:
    base = host.reserve(2 * PAGE_BYTES)
    with pytest.raises(BackendError, match="not aligned"):
        host.map_page(base + 4096, host.create_page(0))


def test_map_refuses_address_outside_any_range(host: HostBackend) -> None:
    base = host.reserve(PAGE_BYTES)
    with pytest.raises(BackendError, match="not inside a reserved range"):
        host.map_page(base + 64 * PAGE_BYTES, host.create_page(0))


def test_map_refuses_mapping_over_a_mapped_page(host: HostBackend) -> None:
    base = host.reserve(PAGE_BYTES)
    first = host.create_page(0)
    host.map_page(base, first)
    host.tensor(base, PAGE_BYTES, torch.uint8).fill_(3)
    with pytest.raises(BackendError, match="already mapped"):
        host.map_page(base, host.create_page(1))
    # The first page is still there, bytes intact.
    assert int(host.tensor(base, PAGE_BYTES, torch.uint8)[-1]) == 3


def test_unmap_refuses_what_is_not_mapped(host: HostBackend) -> None:
    base = host.reserve(2 * PAGE_BYTES)
    host.map_page(base, host.create_page(0))
    with pytest.raises(BackendError, match="not mapped"):
        host.unmap(base + PAGE_BYTES, PAGE_BYTES)
    with pytest.raises(BackendError, match="not mapped"):
        host.unmap(base, 2 * PAGE_BYTES)  # second slot unmapped: nothing is touched
    host.tensor(base, PAGE_BYTES, torch.uint8).fill_(1)  # first still mapped
    with pytest.raises(BackendError, match="size"):
        host.unmap(base, 0)


def test_page_index_past_the_pool(host: HostBackend) -> None:
    with pytest.raises(BackendError, match="outside the pool"):
        host.create_page(host.num_pages)
    with pytest.raises(BackendError, match="outside the pool"):
        host.create_page(-1)


def test_page_created_twice_or_released_twice(host: HostBackend) -> None:
    page = host.create_page(0)
    with pytest.raises(BackendError, match="already exists"):
        host.create_page(0)
    host.release_page(page)
    with pytest.raises(BackendError, match="already released"):
        host.release_page(page)


def test_free_range_refuses_mapped_or_unknown(host: HostBackend) -> None:
    base = host.reserve(PAGE_BYTES)
    host.map_page(base, host.create_page(0))
    with pytest.raises(BackendError, match="still has 1 mapped"):
        host.free_range(base)
    with pytest.raises(BackendError, match="not the start"):
        host.free_range(base + PAGE_BYTES)


def test_import_refuses_bad_fd_and_page(host: HostBackend) -> None:
    importer = make_host(num_pages=0)
    with pytest.raises(BackendError, match="cannot import"):
        importer.import_page(987654, 0)
    with pytest.raises(BackendError, match="outside the exported pool"):
        importer.import_page(host.export_page(host.create_page(0)), host.num_pages)
    importer.close()


def test_view_past_the_range(host: HostBackend) -> None:
    base = host.reserve(PAGE_BYTES)
    with pytest.raises(BackendError, match="runs past"):
        host.tensor(base, 2 * PAGE_BYTES, torch.uint8)


def test_bad_page_size_and_unknown_backend() -> None:
    with pytest.raises(BackendError, match="page size"):
        HostBackend(num_pages=1, page_size_bytes=1000)
    with pytest.raises(BackendError, match="unknown backend"):
        open_backend("tpu")


def test_a_map_of_runs_refused_whose_rollback_is_refused_too_keeps_only_those_slots_mapped(
    host: HostBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = host.reserve(4 * PAGE_BYTES)
    pages = [host.create_page(i) for i in (0, 1, 5)]  # two runs in the file: 0-1, then 5
    real_mmap, real_unmap, num_maps = host._mmap, host.unmap, [0]

    def mmap(addr: int, size: int, prot: int, *rest: object) -> int:
        if prot == host_module._PROT_RW:
            num_maps[0] += 1
            if num_maps[0] == 2:
                return -1  # the second run's map: refused
        return real_mmap(addr, size, prot, *rest)

    def unmap(addr: int, size_bytes: int) -> None:
        if size_bytes > PAGE_BYTES or addr == base + PAGE_BYTES:
            raise BackendError("munmap failed: out of memory (a test)")
        real_unmap(addr, size_bytes)

    monkeypatch.setattr(host, "_mmap", mmap)
    monkeypatch.setattr(host, "unmap", unmap)
    with pytest.raises(BackendError, match="mapping pages 5-5"):  # the map's error, not the rollback's
        host.map_pages(base, pages)
    monkeypatch.undo()
    assert [host.is_mapped(base + i * PAGE_BYTES) for i in range(4)] == [False, True, False, False]
    host.unmap(base + PAGE_BYTES, PAGE_BYTES)  # the book listed it: it was mapped
    host.free_range(base)
