"""The host backend: memfd pool, PROT_NONE reservations, MAP_FIXED pages."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from kvdaemon.cuda_vmm import HostBackend, host_copy
from kvdaemon.errors import BackendError

from .conftest import PAGE_BYTES, make_host


def run_child(script: str, pass_fds: tuple[int, ...] = ()) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a fresh interpreter, returning its result."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        pass_fds=pass_fds,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_round_trip_through_tensor_view(host: HostBackend) -> None:
    base = host.reserve(4 * PAGE_BYTES)
    assert base % PAGE_BYTES == 0
    page = host.create_page(3)
    slot = base + 2 * PAGE_BYTES
    host.map_page(slot, page)
    view = host.tensor(slot, PAGE_BYTES, torch.int32)
    assert view.numel() == PAGE_BYTES // 4
    view.copy_(torch.arange(view.numel(), dtype=torch.int32))
    again = host.tensor(slot, PAGE_BYTES, torch.int32)
    assert torch.equal(again, torch.arange(view.numel(), dtype=torch.int32))
    host.unmap(slot, PAGE_BYTES)
    # The bytes live in the page, not the slot: map it elsewhere and read them.
    host.map_page(base, page)
    moved = host.tensor(base, PAGE_BYTES, torch.int32)
    assert int(moved[12345]) == 12345
    host.unmap(base, PAGE_BYTES)
    host.release_page(page)
    host.free_range(base)


def test_two_pages_hold_distinct_bytes(host: HostBackend) -> None:
    base = host.reserve(2 * PAGE_BYTES)
    pages = [host.create_page(0), host.create_page(1)]
    for i, page in enumerate(pages):
        host.map_page(base + i * PAGE_BYTES, page)
    host.tensor(base, PAGE_BYTES, torch.uint8).fill_(7)
    host.tensor(base + PAGE_BYTES, PAGE_BYTES, torch.uint8).fill_(9)
    both = host.tensor(base, 2 * PAGE_BYTES, torch.uint8)
    assert int(both[:PAGE_BYTES].sum()) == 7 * PAGE_BYTES
    assert int(both[PAGE_BYTES:].sum()) == 9 * PAGE_BYTES
    host.unmap(base, 2 * PAGE_BYTES)
    for page in pages:
        host.release_page(page)


def test_release_returns_memory_to_the_os(host: HostBackend) -> None:
    base = host.reserve(PAGE_BYTES)
    page = host.create_page(5)
    host.map_page(base, page)
    host.tensor(base, PAGE_BYTES, torch.uint8).fill_(1)
    touched = os.fstat(host.pool_fd).st_blocks * 512
    assert touched >= PAGE_BYTES
    host.unmap(base, PAGE_BYTES)
    host.release_page(page)
    assert os.fstat(host.pool_fd).st_blocks * 512 <= touched - PAGE_BYTES
    # A fresh page at the same index reads zeros.
    again = host.create_page(5)
    host.map_page(base, again)
    assert int(host.tensor(base, PAGE_BYTES, torch.uint8).sum()) == 0
    host.unmap(base, PAGE_BYTES)


def test_child_process_shares_the_page(host: HostBackend) -> None:
    base = host.reserve(PAGE_BYTES)
    page = host.create_page(2)
    host.map_page(base, page)
    view = host.tensor(base, PAGE_BYTES, torch.uint8)
    view[:4096].fill_(0xAB)
    fd = host.export_page(page)
    result = run_child(
        f"""
        import torch
        from kvdaemon.cuda_vmm import HostBackend, host_copy
        b = HostBackend(page_size_bytes={PAGE_BYTES})
        b.start()
        page = b.import_page({fd}, 2)
        base = b.reserve({PAGE_BYTES})
        b.map_page(base, page)
        v = b.tensor(base, {PAGE_BYTES}, torch.uint8)
        assert int(v[:4096].min()) == 0xAB and int(v[:4096].max()) == 0xAB, "parent bytes"
        v[4096:8192].fill_(0x5C)
        b.close()
        """,
        pass_fds=(fd,),
    )
    os.close(fd)
    assert result.returncode == 0, result.stderr
    assert int(view[4096:8192].min()) == 0x5C and int(view[4096:8192].max()) == 0x5C
    host.unmap(base, PAGE_BYTES)


def test_touching_an_unmapped_page_kills_with_sigsegv() -> None:
    result = run_child(
        f"""
        import torch
        from kvdaemon.cuda_vmm import HostBackend, host_copy
        b = HostBackend(num_pages=1, page_size_bytes={PAGE_BYTES})
        b.start()
        base = b.reserve({PAGE_BYTES})
        page = b.create_page(0)
        b.map_page(base, page)
        view = b.tensor(base, {PAGE_BYTES}, torch.uint8)
        view.fill_(1)
        b.unmap(base, {PAGE_BYTES})
        print("unmapped", flush=True)
        view.fill_(2)
        print("survived", flush=True)
        """
    )
    assert "unmapped" in result.stdout
    assert "survived" not in result.stdout
    assert result.returncode == -signal.SIGSEGV


def test_import_dedupes_the_pool_file(host: HostBackend) -> None:
    importer = make_host(num_pages=0)
    first = importer.import_page(host.export_page(host.create_page(0)), 0)
    second = importer.import_page(host.export_page(host.create_page(1)), 1)
    assert first.handle == second.handle
    assert (first.offset_bytes, second.offset_bytes) == (0, PAGE_BYTES)
    importer.close()


def test_close_unmaps_and_frees_everything() -> None:
    backend = make_host(num_pages=2)
    base = backend.reserve(2 * PAGE_BYTES)
    backend.map_page(base, backend.create_page(0))
    fd = backend.pool_fd
    backend.close()
    with pytest.raises(OSError):
        os.fstat(fd)
    with pytest.raises(BackendError, match="not started"):
        backend.reserve(PAGE_BYTES)


def test_the_pool_file_cannot_be_resized(host: HostBackend) -> None:
    with pytest.raises(OSError):
        os.ftruncate(host.pool_fd, 0)
    with pytest.raises(OSError):
        os.ftruncate(host.pool_fd, (host.num_pages + 1) * PAGE_BYTES)


F_SEAL_FUTURE_WRITE = 0x10  # linux/fcntl.h (not in Python's fcntl)


@pytest.mark.parametrize("seal", [fcntl.F_SEAL_WRITE, F_SEAL_FUTURE_WRITE, fcntl.F_SEAL_SEAL])
def test_no_holder_of_the_pool_file_can_seal_it_further(host: HostBackend, seal: int) -> None:
    """A tenant holds the pool file (an exported fd): a write seal would make every later
    release (hole punch) fail, so the daemon seals the seals."""
    page = host.create_page(0)
    exported = host.export_pages([page])[0][0]
    try:
        with pytest.raises(PermissionError):
            fcntl.fcntl(exported, fcntl.F_ADD_SEALS, seal)
    finally:
        os.close(exported)
    host.release_page(page)  # still works


def written_pages(host: HostBackend, page_ids: list[int], seed: int) -> tuple[list, torch.Tensor]:
    """Create ``page_ids``, fill them with random bytes through a mapping; the pages and the bytes."""
    pages = [host.create_page(i) for i in page_ids]
    base = host.reserve(len(pages) * PAGE_BYTES)
    for i, page in enumerate(pages):
        host.map_page(base + i * PAGE_BYTES, page)
    data = torch.randint(0, 256, (len(pages) * PAGE_BYTES,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))
    host.tensor(base, len(pages) * PAGE_BYTES, torch.uint8).copy_(data)
    host.unmap(base, len(pages) * PAGE_BYTES)
    host.free_range(base)
    return pages, data


@pytest.mark.parametrize("page_ids", [[0, 1, 2, 3], [5, 2, 7, 3, 4]], ids=["one-run", "scattered"])
def test_bulk_copies_move_pages_through_a_host_buffer_in_order(host: HostBackend, page_ids: list[int]) -> None:
    pages, data = written_pages(host, page_ids, seed=len(page_ids))
    buffer = bytearray(len(pages) * PAGE_BYTES)
    host.copy_out_pages(pages, memoryview(buffer))
    assert torch.equal(torch.frombuffer(buffer, dtype=torch.uint8), data), "page i lands at i * page size"
    for page in pages:
        host.release_page(page)
    fresh = [host.create_page(i) for i in reversed(page_ids)]
    host.copy_in_pages(fresh[::-1], memoryview(buffer))
    back = bytearray(len(pages) * PAGE_BYTES)
    host.copy_out_pages(fresh[::-1], memoryview(back))
    assert back == buffer


def test_bulk_copies_back_the_pool_view_once_per_page_life(
    host: HostBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool view's PTEs are made once per created page: a second copy walks nothing, and a
    released page (its PTEs gone with the hole) is backed again and reads zero."""
    backed: list[tuple[int, int]] = []
    real = host_copy.populate_ranges
    monkeypatch.setattr(host_copy, "populate_ranges", lambda ranges: backed.extend(ranges) or real(ranges))
    pages, data = written_pages(host, [0, 1, 3], seed=5)
    buffer = bytearray(3 * PAGE_BYTES)
    host.copy_out_pages(pages, memoryview(buffer))
    assert sum(size for _, size in backed) == 3 * PAGE_BYTES
    assert len(backed) == 2, "pages 0-1 are one run, page 3 another"
    backed.clear()
    host.copy_in_pages(pages, memoryview(buffer))
    host.copy_out_pages(pages, memoryview(buffer))
    assert backed == [] and torch.equal(torch.frombuffer(buffer, dtype=torch.uint8), data)
    host.release_page(pages[1])
    fresh = host.create_page(1)
    out = bytearray(PAGE_BYTES)
    host.copy_out_pages([fresh], memoryview(out))
    assert sum(size for _, size in backed) == PAGE_BYTES
    assert out == bytes(PAGE_BYTES), "a re-created page reads zero through the view"


def test_bulk_copies_refuse_a_wrong_buffer_and_pages_made_elsewhere(host: HostBackend) -> None:
    pages, _ = written_pages(host, [0, 1], seed=3)
    with pytest.raises(BackendError, match="buffer of"):
        host.copy_out_pages(pages, memoryview(bytearray(PAGE_BYTES)))
    importer = HostBackend()
    importer.start()
    try:
        imported = importer.import_page(host.export_page(pages[0]), 0)
        with pytest.raises(BackendError, match="not created here"):
            host.copy_in_pages([imported], memoryview(bytearray(PAGE_BYTES)))
    finally:
        importer.close()


def test_map_pages_maps_each_file_run_at_once_and_all_or_nothing(
    host: HostBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = host.reserve(8 * PAGE_BYTES)
    pages = [host.create_page(i) for i in (0, 1, 2, 5, 6)]  # two runs in the file
    book_before = host._book.num_mappings
    real, calls = host._mmap, []

    def mmap(*args: object) -> int:
        calls.append(args[1])
        if len(calls) == 2:  # the second run's mmap fails
            return -1
        return real(*args)

    monkeypatch.setattr(host, "_mmap", mmap)
    with pytest.raises(BackendError, match="mapping pages 5-6"):
        host.map_pages(base, pages)
    monkeypatch.undo()
    assert calls[:2] == [3 * PAGE_BYTES, 2 * PAGE_BYTES]
    assert host._book.num_mappings == book_before, "the first run stayed mapped"
    with pytest.raises(BackendError, match="not mapped"):
        host.unmap(base, PAGE_BYTES)
    host.map_pages(base, pages)
    for i, page in enumerate(pages):  # each slot shows its own page: the file runs landed where they should
        host.tensor(base + i * PAGE_BYTES, PAGE_BYTES, torch.uint8)[0] = page.page_id
    for i, page in enumerate(pages):
        scratch = host.reserve(PAGE_BYTES)
        host.map_page(scratch, page)  # the same page, seen through a mapping of its own
        assert int(host.tensor(scratch, PAGE_BYTES, torch.uint8)[0]) == page.page_id
        host.unmap(scratch, PAGE_BYTES)
        host.free_range(scratch)
    host.unmap(base, 5 * PAGE_BYTES)
    host.free_range(base)
    host.release_pages(pages)
