"""Tests of the ``cuda`` backend on a real GPU (marked ``gpu``; skipped without one).

Every test here talks to the CUDA driver through ``CudaBackend`` and reads or
writes device memory through ``backend.tensor`` views. No test touches a view
after its pages are unmapped: a fault on the device is sticky and would break
every later test of the session.

Cost: about 16 MiB of device memory per test and, for the cross-process test,
one child Python process (torch and CUDA start-up, a few seconds).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch

from kvdaemon.cuda_vmm import DEFAULT_PAGE_SIZE_BYTES, CudaBackend, PhysicalPage, cuda_available
from kvdaemon.errors import BackendError

_HAS_CUDA = cuda_available()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _HAS_CUDA, reason="no CUDA GPU/driver"),
]

PAGE = DEFAULT_PAGE_SIZE_BYTES
NUM_PAGES = 8
WORDS_PER_PAGE = PAGE // 4
CHILD_TIMEOUT_S = 180


def _pattern(num_words: int, seed: int) -> torch.Tensor:
    """A deterministic int32 pattern on the GPU; distinct seeds give distinct words."""
    return torch.arange(num_words, dtype=torch.int32, device="cuda") * 3 + seed


@pytest.fixture
def backend() -> Iterator[CudaBackend]:
    """A started cuda backend with a pool of ``NUM_PAGES`` pages; closed afterwards."""
    b = CudaBackend(num_pages=NUM_PAGES)
    b.start()
    try:
        yield b
    finally:
        torch.cuda.synchronize()
        b.close()


@pytest.fixture
def mapped(backend: CudaBackend) -> tuple[int, PhysicalPage]:
    """A 4-page range with page 0 mapped at its first slot, holding ``_pattern(seed=1)``.

    The ``backend`` fixture's close() unmaps and releases it.
    """
    addr = backend.reserve(4 * PAGE)
    page = backend.create_page(0)
    backend.map_page(addr, page)
    backend.tensor(addr, PAGE, torch.int32).copy_(_pattern(WORDS_PER_PAGE, seed=1))
    torch.cuda.synchronize()
    return addr, page


# --- basics -------------------------------------------------------------------


def test_start_reports_granularity_and_memory(backend: CudaBackend) -> None:
    gran = backend.granularity_bytes
    assert gran > 0
    assert PAGE % gran == 0
    info = backend.mem_info()
    assert 0 < info.free_bytes <= info.total_bytes


def test_start_is_idempotent_and_restartable() -> None:
    b = CudaBackend(num_pages=1)
    b.start()
    b.start()
    b.close()
    b.close()
    b.start()  # a closed backend starts again
    addr = b.reserve(PAGE)
    b.map_page(addr, b.create_page(0))
    b.close()  # unmaps, frees the range and releases the page itself


def test_page_size_off_granularity_is_refused() -> None:
    b = CudaBackend(num_pages=1, page_size_bytes=PAGE + 4096)
    with pytest.raises(BackendError, match="granularity"):
        b.start()
    with pytest.raises(BackendError, match="not started"):
        b.reserve(PAGE + 4096)


def test_calls_before_start_raise() -> None:
    b = CudaBackend(num_pages=1)
    with pytest.raises(BackendError, match="not started"):
        b.reserve(PAGE)
    with pytest.raises(BackendError, match="not started"):
        b.create_page(0)


# --- round trip ----------------------------------------------------------------


def test_reserve_map_write_read_unmap_release(backend: CudaBackend) -> None:
    addr = backend.reserve(4 * PAGE)
    assert addr % PAGE == 0
    pages = [backend.create_page(0), backend.create_page(1)]
    backend.map_page(addr, pages[0])
    backend.map_page(addr + 2 * PAGE, pages[1])

    first = backend.tensor(addr, PAGE, torch.int32)
    third = backend.tensor(addr + 2 * PAGE, PAGE, torch.int32)
    assert first.data_ptr() == addr
    assert first.device.type == "cuda"
    assert first.numel() == WORDS_PER_PAGE
    first.copy_(_pattern(WORDS_PER_PAGE, seed=10))
    third.copy_(_pattern(WORDS_PER_PAGE, seed=20))
    torch.cuda.synchronize()

    # A second view at the same address sees the same bytes, under another dtype too.
    assert torch.equal(backend.tensor(addr, PAGE, torch.int32), _pattern(WORDS_PER_PAGE, seed=10))
    assert torch.equal(
        backend.tensor(addr + 2 * PAGE, PAGE, torch.uint8),
        _pattern(WORDS_PER_PAGE, seed=20).view(torch.uint8),
    )

    del first, third
    backend.unmap(addr, PAGE)
    backend.unmap(addr + 2 * PAGE, PAGE)
    for page in pages:
        backend.release_page(page)
    backend.free_range(addr)
    # The page ids are free again once released.
    backend.release_page(backend.create_page(0))


def test_page_keeps_its_bytes_across_unmap_and_remap(
    backend: CudaBackend, mapped: tuple[int, PhysicalPage]
) -> None:
    addr, page = mapped
    backend.unmap(addr, PAGE)
    backend.map_page(addr + 3 * PAGE, page)  # the same physical page, another slot
    assert torch.equal(
        backend.tensor(addr + 3 * PAGE, PAGE, torch.int32), _pattern(WORDS_PER_PAGE, seed=1)
    )


def test_unmap_of_several_pages_in_one_call(backend: CudaBackend) -> None:
    addr = backend.reserve(4 * PAGE)
    for i in range(4):
        backend.map_page(addr + i * PAGE, backend.create_page(i))
    view = backend.tensor(addr, 4 * PAGE, torch.int32)
    view.fill_(7)
    torch.cuda.synchronize()
    assert bool((view == 7).all())
    del view
    backend.unmap(addr, 4 * PAGE)
    with pytest.raises(BackendError, match="not mapped"):
        backend.unmap(addr + PAGE, PAGE)
    backend.free_range(addr)


def test_view_made_before_its_pages_are_mapped(backend: CudaBackend) -> None:
    """A KV tensor exists over a reserved range before pages go behind it (client KVPool)."""
    addr = backend.reserve(2 * PAGE)
    view = backend.tensor(addr, 2 * PAGE, torch.int32)  # nothing mapped yet: no access
    assert view.data_ptr() == addr
    backend.map_page(addr, backend.create_page(0))
    backend.map_page(addr + PAGE, backend.create_page(1))
    view.copy_(_pattern(2 * WORDS_PER_PAGE, seed=5))
    torch.cuda.synchronize()
    assert torch.equal(
        backend.tensor(addr + PAGE, PAGE, torch.int32),
        _pattern(2 * WORDS_PER_PAGE, seed=5)[WORDS_PER_PAGE:],
    )


# --- bad input -----------------------------------------------------------------


@pytest.mark.parametrize("size", [0, -PAGE, PAGE + 1, PAGE // 2])
def test_reserve_refuses_bad_sizes(backend: CudaBackend, size: int) -> None:
    with pytest.raises(BackendError):
        backend.reserve(size)


def test_map_refuses_misaligned_and_foreign_addresses(
    backend: CudaBackend, mapped: tuple[int, PhysicalPage]
) -> None:
    addr, _ = mapped
    page = backend.create_page(1)
    with pytest.raises(BackendError, match="aligned"):
        backend.map_page(addr + PAGE + 4096, page)
    with pytest.raises(BackendError, match="reserved range"):
        backend.map_page(addr + 4 * PAGE, page)  # one past the end of the range


def test_map_over_a_mapped_slot_is_refused_and_changes_nothing(
    backend: CudaBackend, mapped: tuple[int, PhysicalPage]
) -> None:
    addr, _ = mapped
    with pytest.raises(BackendError, match="already mapped"):
        backend.map_page(addr, backend.create_page(1))
    assert torch.equal(backend.tensor(addr, PAGE, torch.int32), _pattern(WORDS_PER_PAGE, seed=1))
    backend.unmap(addr, PAGE)  # still mapped exactly once
    with pytest.raises(BackendError, match="not mapped"):
        backend.unmap(addr, PAGE)


def test_unmap_refuses_unmapped_misaligned_and_empty(
    backend: CudaBackend, mapped: tuple[int, PhysicalPage]
) -> None:
    addr, _ = mapped
    with pytest.raises(BackendError, match="not mapped"):
        backend.unmap(addr + PAGE, PAGE)
    with pytest.raises(BackendError, match="not mapped"):
        backend.unmap(addr, 2 * PAGE)  # second slot unmapped: nothing is unmapped
    with pytest.raises(BackendError, match="aligned"):
        backend.unmap(addr + 4096, PAGE)
    with pytest.raises(BackendError):
        backend.unmap(addr, 0)
    with pytest.raises(BackendError):
        backend.unmap(addr, -PAGE)
    # The refused calls left the mapping alone.
    assert torch.equal(backend.tensor(addr, PAGE, torch.int32), _pattern(WORDS_PER_PAGE, seed=1))


@pytest.mark.parametrize("page_id", [NUM_PAGES, NUM_PAGES + 100, -1])
def test_create_page_refuses_ids_outside_the_pool(backend: CudaBackend, page_id: int) -> None:
    with pytest.raises(BackendError, match="outside the pool"):
        backend.create_page(page_id)


def test_create_page_refuses_an_existing_id(backend: CudaBackend) -> None:
    backend.create_page(2)
    with pytest.raises(BackendError, match="already exists"):
        backend.create_page(2)


def test_free_range_refuses_a_range_with_mapped_pages(
    backend: CudaBackend, mapped: tuple[int, PhysicalPage]
) -> None:
    addr, _ = mapped
    with pytest.raises(BackendError, match="mapped"):
        backend.free_range(addr)
    with pytest.raises(BackendError, match="not the start"):
        backend.free_range(addr + PAGE)


def test_tensor_refuses_views_past_the_reservation(
    backend: CudaBackend, mapped: tuple[int, PhysicalPage]
) -> None:
    addr, _ = mapped
    with pytest.raises(BackendError, match="runs past"):
        backend.tensor(addr, 5 * PAGE, torch.int32)
    with pytest.raises(BackendError):
        backend.tensor(addr, 0, torch.int32)


def test_import_of_a_non_cuda_fd_raises_and_closes_it(backend: CudaBackend) -> None:
    fd = os.open(os.devnull, os.O_RDONLY)
    with pytest.raises(BackendError):
        backend.import_page(fd, 0)
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(fd)  # import_page took ownership of the fd, even on failure


# --- across processes ----------------------------------------------------------

# Run in a child: import the page from the inherited fd, check the parent's
# pattern, write the child's own. Exit 0 on success, 3 on a mismatch.
_CHILD = textwrap.dedent(
    """
    import sys
    import torch
    from kvdaemon.cuda_vmm import CudaBackend

    fd, page_size = int(sys.argv[1]), int(sys.argv[2])
    words = page_size // 4

    def pattern(seed):
        return torch.arange(words, dtype=torch.int32, device="cuda") * 3 + seed

    backend = CudaBackend(page_size_bytes=page_size)
    backend.start()
    page = backend.import_page(fd, 0)
    addr = backend.reserve(page_size)
    backend.map_page(addr, page)
    view = backend.tensor(addr, page_size, torch.int32)
    if not torch.equal(view, pattern(1)):
        print("child read", view[:4].tolist(), "expected", pattern(1)[:4].tolist())
        sys.exit(3)
    view.copy_(pattern(2))
    torch.cuda.synchronize()
    del view
    backend.close()
    print("child ok")
    """
)


def test_page_crosses_processes_through_an_exported_fd(backend: CudaBackend) -> None:
    addr = backend.reserve(PAGE)
    page = backend.create_page(0)
    backend.map_page(addr, page)
    view = backend.tensor(addr, PAGE, torch.int32)
    view.copy_(_pattern(WORDS_PER_PAGE, seed=1))
    torch.cuda.synchronize()

    fd = backend.export_page(page)
    try:
        child = subprocess.run(
            [sys.executable, "-c", _CHILD, str(fd), str(PAGE)],
            pass_fds=(fd,),
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
        )
    finally:
        os.close(fd)
    assert child.returncode == 0, f"child failed:\n{child.stdout}\n{child.stderr}"
    assert "child ok" in child.stdout

    # The child unmapped and exited; the page and the bytes it wrote live on here.
    torch.cuda.synchronize()
    assert torch.equal(view, _pattern(WORDS_PER_PAGE, seed=2))
