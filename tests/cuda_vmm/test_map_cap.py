"""The OS's cap on a process's mappings: ``AddressBook.num_mappings`` counts them as the kernel
does, and the host backend maps no page past ``max_mappings`` (``vm.max_map_count``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdaemon.cuda_vmm import HostBackend, host
from kvdaemon.cuda_vmm.host import DEFAULT_MAX_MAP_COUNT, MAP_HEADROOM, max_mappings
from kvdaemon.errors import BackendError

from .conftest import PAGE_BYTES, make_host

NUM_SLOTS = 16


def kernel_mappings(start: int, end: int) -> int:
    """The mappings ``/proc/self/maps`` lists that overlap ``[start, end)``."""
    num = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            low, high = (int(part, 16) for part in line.split()[0].split("-"))
            num += low < end and high > start
    return num


@pytest.fixture
def big_host() -> HostBackend:
    backend = make_host(num_pages=NUM_SLOTS)
    yield backend
    backend.close()


def outside(*mine: HostBackend) -> int:
    """What the process's other started host backends map or hold (other tests' still alive)."""
    return host.process_mappings(excluding=mine)


def set_cap(backend: HostBackend, num_mappings: int, *mine: HostBackend) -> None:
    """Let ``backend`` and ``mine`` make ``num_mappings`` in all, whatever else the process maps."""
    backend.max_mappings = num_mappings + outside(backend, *mine)


def page_for(backend: HostBackend, slot: int):  # noqa: ANN201 - a PhysicalPage
    """Slot ``slot``'s page: offsets run backwards, so no two neighbouring slots merge."""
    return backend.create_page(NUM_SLOTS - 1 - slot)


def test_the_book_counts_the_mappings_the_kernel_makes(big_host: HostBackend) -> None:
    start = big_host.reserve(NUM_SLOTS * PAGE_BYTES)
    end = start + NUM_SLOTS * PAGE_BYTES
    book = big_host._book
    assert book.num_mappings == kernel_mappings(start, end) == 1
    pages = {}
    for slot in (5, 6, 0, 15, 9, 8, 7, 3, 4, 1, 2):  # middles, edges, gaps of one slot filled
        pages[slot] = page_for(big_host, slot)
        big_host.map_page(start + slot * PAGE_BYTES, pages[slot])
        assert book.num_mappings == kernel_mappings(start, end), f"after mapping slot {slot}"
    big_host.unmap(start + 7 * PAGE_BYTES, 3 * PAGE_BYTES)  # a run of three at once
    assert book.num_mappings == kernel_mappings(start, end)
    for slot in (0, 15, 3, 1, 2, 6, 4, 5):
        big_host.unmap(start + slot * PAGE_BYTES, PAGE_BYTES)
        assert book.num_mappings == kernel_mappings(start, end), f"after unmapping slot {slot}"
    assert book.num_mappings == 1
    big_host.free_range(start)
    assert book.num_mappings == 0


def test_pages_the_kernel_merges_are_counted_apart_so_an_unmap_never_passes_the_cap(big_host: HostBackend) -> None:
    start = big_host.reserve(NUM_SLOTS * PAGE_BYTES)
    end = start + NUM_SLOTS * PAGE_BYTES
    book = big_host._book
    pages = {slot: big_host.create_page(slot) for slot in range(NUM_SLOTS)}  # slot k maps file page k
    for slot in range(NUM_SLOTS):  # one merged mapping for the kernel
        big_host.map_page(start + slot * PAGE_BYTES, pages[slot])
    assert (book.num_mappings, kernel_mappings(start, end)) == (NUM_SLOTS, 1)
    for slot in range(1, NUM_SLOTS, 2):  # each unmap splits the kernel's mapping: it climbs, the book does not
        before = book.num_mappings
        big_host.unmap(start + slot * PAGE_BYTES, PAGE_BYTES)
        assert book.num_mappings <= before and kernel_mappings(start, end) <= book.num_mappings
    assert kernel_mappings(start, end) == book.num_mappings == NUM_SLOTS  # every other slot: now they agree
    for slot in range(0, NUM_SLOTS, 2):
        big_host.unmap(start + slot * PAGE_BYTES, PAGE_BYTES)
    assert book.num_mappings == kernel_mappings(start, end) == 1


def test_a_map_past_the_cap_is_refused_before_the_os_sees_it(big_host: HostBackend) -> None:
    start = big_host.reserve(NUM_SLOTS * PAGE_BYTES)
    end = start + NUM_SLOTS * PAGE_BYTES
    set_cap(big_host, 2)  # the reservation and one more
    assert big_host.mappable_pages() == 1  # one mapping more: a page at an edge fits, one in the middle not
    middle = start + 4 * PAGE_BYTES
    with pytest.raises(BackendError, match="vm.max_map_count") as refused:
        big_host.map_page(middle, page_for(big_host, 4))
    assert refused.value.driver_code is None  # the backend refused; no mmap was made
    assert kernel_mappings(start, end) == 1 and big_host._book.num_mappings == 1
    with pytest.raises(BackendError, match="not mapped"):
        big_host.unmap(middle, PAGE_BYTES)
    big_host.map_page(start, page_for(big_host, 0))  # an edge slot ends the reservation: one more mapping
    assert big_host._book.num_mappings == kernel_mappings(start, end) == 2
    big_host.unmap(start, PAGE_BYTES)
    set_cap(big_host, 1 + 2 * 3 + 1)
    assert big_host.mappable_pages() == 7
    for slot in (2, 6, 10):  # three apart: each splits a run, two mappings each
        big_host.map_page(start + slot * PAGE_BYTES, page_for(big_host, slot))
    assert big_host.mappable_pages() == 1
    with pytest.raises(BackendError, match="vm.max_map_count"):
        big_host.map_page(start + 13 * PAGE_BYTES, page_for(big_host, 13))
    big_host.map_page(start + 3 * PAGE_BYTES, page_for(big_host, 3))  # beside a mapped slot: one more
    assert big_host._book.num_mappings == kernel_mappings(start, end) == 1 + 2 * 3 + 1


@pytest.mark.parametrize(
    ("text", "expected"),
    [("65530\n", 65530 - 8192), ("1000000", 1000000 - MAP_HEADROOM), ("1000", 750), ("lots", None)],
)
def test_max_mappings_reads_the_os_cap(tmp_path: Path, text: str, expected: int | None) -> None:
    path = tmp_path / "max_map_count"
    path.write_text(text)
    default = DEFAULT_MAX_MAP_COUNT - min(MAP_HEADROOM, DEFAULT_MAX_MAP_COUNT // 4)
    assert max_mappings(str(path)) == (default if expected is None else expected)
    assert max_mappings(str(tmp_path / "absent")) == default


def test_a_started_backend_takes_the_cap_from_the_os(big_host: HostBackend) -> None:
    assert big_host.max_mappings == max_mappings()
    assert big_host.mappable_pages() == big_host.max_mappings - outside()


def test_every_backend_of_the_process_counts_against_one_cap_with_what_each_holds(big_host: HostBackend) -> None:
    second = make_host(num_pages=NUM_SLOTS)
    try:
        start = big_host.reserve(NUM_SLOTS * PAGE_BYTES)
        other = second.reserve(NUM_SLOTS * PAGE_BYTES)
        for backend in (big_host, second):
            set_cap(backend, 2 + 2 * 2, big_host, second)  # both bare ranges and two scattered pages, in all
        big_host.map_page(start + 2 * PAGE_BYTES, page_for(big_host, 2))
        assert second.mappable_pages() == 2, "the other backend's mappings count"
        second.hold_mappings(2)  # a sleeper's room
        assert (big_host.mappable_pages(), second.mappable_pages()) == (0, 0)
        with pytest.raises(BackendError, match="vm.max_map_count"):
            big_host.map_page(start + 6 * PAGE_BYTES, page_for(big_host, 6))
        second.release_mappings(2)
        second.map_page(other + 2 * PAGE_BYTES, page_for(second, 2))
        assert big_host._book.num_mappings + second._book.num_mappings == 6
    finally:
        second.close()
    assert big_host.mappable_pages() == 6 - 3, "a closed backend counts no more"


def test_a_started_backend_counts_against_the_cap_until_closed() -> None:
    backend = make_host()
    assert backend in host._STARTED
    backend.close()
    assert backend not in host._STARTED
