"""SegmentMap: unmapping every page at once (a sleep) by runs keeps the page table exact."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeVar

import pytest
import torch

from kvdaemon.client.segments import SegmentMap
from kvdaemon.cuda_vmm import HostBackend
from kvdaemon.errors import BackendError

PAGE = 4096
B = TypeVar("B", bound=HostBackend)


def _running(kind: type[B]) -> Iterator[B]:
    """A started host backend of 64 pages of ``PAGE`` bytes, closed after the test."""
    backend = kind(num_pages=64, page_size_bytes=PAGE)
    backend.start()
    yield backend
    backend.close()


@pytest.fixture
def backend() -> Iterator[HostBackend]:
    yield from _running(HostBackend)


def test_unmap_all_by_runs_unmaps_exactly_the_mapped_pages_and_maps_back(backend: HostBackend) -> None:
    segments = _reserved(backend)
    mapped = [0, 1, 2, 5, 7, 8, 15]  # three runs and two lone pages
    for i, lp in enumerate(mapped):
        pages = [backend.create_page(2 * i), backend.create_page(2 * i + 1)]
        segments.map(lp, pages)
        for seg in range(2):
            segments.view(seg, 16 * PAGE, torch.uint8)[lp * PAGE : (lp + 1) * PAGE] = 10 * seg + lp
    held = dict(segments.pages)
    assert segments.mappings_made() == backend._book.num_mappings - 2 == 2 * (7 + 3 - 1)  # 3 gaps: 7 + 3 each
    pages = segments.unmap_all()
    assert pages == held and list(pages) == mapped and segments.pages == {}
    assert segments.mappings_made() == 0 and backend._book.num_mappings == 2
    for lp in mapped:  # every slot is free again: a map there succeeds, and the bytes came along
        segments.map(lp, pages[lp])
    for seg in range(2):
        view = segments.view(seg, 16 * PAGE, torch.uint8)
        assert [int(view[lp * PAGE]) for lp in mapped] == [10 * seg + lp for lp in mapped]
    for lp in mapped:
        segments.release(segments.unmap(lp))
    segments.free_ranges()


def test_what_a_sleeper_holds_covers_its_pages_however_the_wake_places_them(backend: HostBackend) -> None:
    segments = _reserved(backend)
    for lp in range(4):  # each segment's pages follow each other in the file: the kernel merges them
        segments.map(lp, [backend.create_page(lp), backend.create_page(8 + lp)])
    assert backend._book.num_mappings == 2 * (4 + 1)  # counted apart, though the kernel merged them
    assert segments.mappings_made() == 2 * (4 + 1 - 1), "as if no page merged: a wake's pages need not"
    for lp in range(4):
        segments.release(segments.unmap(lp))
    segments.free_ranges()


class CountingBackend(HostBackend):
    """A host backend that records each unmap call's (address, size)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.unmaps: list[tuple[int, int]] = []

    def unmap(self, addr: int, size_bytes: int) -> None:
        self.unmaps.append((addr, size_bytes))
        super().unmap(addr, size_bytes)


@pytest.fixture
def counting() -> Iterator[CountingBackend]:
    yield from _running(CountingBackend)


def _reserved(backend: HostBackend, num_segments: int = 2) -> SegmentMap:
    """A segment map of 16 virtual pages a segment, its ranges reserved, nothing mapped."""
    segments = SegmentMap(backend, num_segments=num_segments, num_virtual_pages=16, page_bytes=PAGE)
    segments.reserve()
    return segments


def _mapped(backend: HostBackend, lps: list[int], num_segments: int = 2) -> SegmentMap:
    segments = _reserved(backend, num_segments)
    for i, lp in enumerate(lps):
        segments.map(lp, [backend.create_page(num_segments * i + seg) for seg in range(num_segments)])
    return segments


def test_drop_pages_unmaps_each_run_once_per_segment_and_frees_the_handles(counting: CountingBackend) -> None:
    segments = _mapped(counting, [0, 1, 2, 3, 5, 6, 9])
    segments.drop_pages([6, 2, 3, 5, 9])  # runs 2-3 and 5-6, lone 9; any order
    base0, base1 = segments.bases
    assert sorted(counting.unmaps) == sorted(
        [(base + lp * PAGE, n * PAGE) for base in (base0, base1) for lp, n in ((2, 2), (5, 2), (9, 1))])
    assert sorted(segments.pages) == [0, 1]
    # the handles went back (their ids can be made again) and every slot is free again
    for i, lp in ((2, 2), (3, 3), (4, 5), (5, 6), (6, 9)):
        segments.map(lp, [counting.create_page(2 * i), counting.create_page(2 * i + 1)])
    segments.drop_pages(segments.pages)
    assert segments.pages == {}
    segments.free_ranges()


def test_unmap_pages_of_a_page_not_mapped_raises_before_unmapping_anything(counting: CountingBackend) -> None:
    segments = _mapped(counting, [0, 1])
    held = dict(segments.pages)
    with pytest.raises(KeyError):
        segments.unmap_pages([1, 4])
    assert counting.unmaps == [] and segments.pages == held
    segments.drop_pages([0, 1])
    segments.free_ranges()


def test_an_unmap_the_backend_refuses_half_way_maps_back_what_it_unmapped(
    backend: HostBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    segments = _reserved(backend)
    mapped = [0, 1, 4, 5, 9]  # three runs, two segments: six unmaps
    for i, lp in enumerate(mapped):
        segments.map(lp, [backend.create_page(2 * i), backend.create_page(2 * i + 1)])
        for seg in range(2):
            segments.view(seg, 16 * PAGE, torch.uint8)[lp * PAGE] = 10 * seg + lp
    held, real, calls = dict(segments.pages), backend.unmap, [0]

    def unmap(addr: int, size_bytes: int) -> None:
        calls[0] += 1
        if calls[0] == 4:  # the second run's second segment
            raise BackendError("munmap failed: out of memory (a test)")
        real(addr, size_bytes)

    monkeypatch.setattr(backend, "unmap", unmap)
    with pytest.raises(BackendError, match="a test"):
        segments.unmap_all()
    monkeypatch.undo()
    assert segments.pages == held
    slots = [base + lp * PAGE for base in segments.bases for lp in mapped]
    assert all(slot in backend._book._mapped for slot in slots), "the table lists pages no longer mapped"
    for seg in range(2):  # every page is mapped again, with its bytes: reading it does not fault
        view = segments.view(seg, 16 * PAGE, torch.uint8)
        assert [int(view[lp * PAGE]) for lp in mapped] == [10 * seg + lp for lp in mapped]
    for pages in segments.unmap_all().values():
        segments.release(pages)
    segments.free_ranges()


def test_a_map_whose_rollback_is_refused_leaves_the_page_stuck_until_it_can_be_unmapped(
    backend: HostBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    segments = _reserved(backend)
    pages = {lp: [backend.create_page(2 * lp), backend.create_page(2 * lp + 1)] for lp in (3, 4, 5)}
    real_map_pages, real_unmap, calls = backend.map_pages, backend.unmap, [0]
    stuck_slot = segments.bases[0] + 4 * PAGE

    def map_pages(addr: int, run: list) -> None:
        calls[0] += 1
        if calls[0] == 2:  # segment 1's run, after segment 0's mapped
            raise BackendError("mmap failed: out of memory (a test)")
        real_map_pages(addr, run)

    def unmap(addr: int, size_bytes: int) -> None:
        if addr <= stuck_slot < addr + size_bytes:
            raise BackendError("munmap failed: out of memory (a test)")
        real_unmap(addr, size_bytes)

    monkeypatch.setattr(backend, "map_pages", map_pages)
    monkeypatch.setattr(backend, "unmap", unmap)
    with pytest.raises(BackendError, match="mmap failed"):
        segments.map_many(pages)
    assert segments.pages == {} and segments.stuck == {4: pages[4]}
    mapped = [backend.is_mapped(base + lp * PAGE) for base in segments.bases for lp in (3, 4, 5)]
    assert mapped == [False, True, False, False, False, False]
    assert segments.unmap_stuck() == {} and segments.stuck == {4: pages[4]}, "refused again: still stuck"
    monkeypatch.undo()
    assert segments.unmap_stuck() == {4: pages[4]} and segments.stuck == {}
    assert not backend.is_mapped(stuck_slot)
    segments.release([page for lp_pages in pages.values() for page in lp_pages])
    segments.free_ranges()


def test_a_single_page_map_whose_rollback_is_refused_leaves_it_stuck(
    backend: HostBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    segments = _reserved(backend, num_segments=3)
    pages = [backend.create_page(i) for i in range(3)]
    real_map_page, calls = backend.map_page, [0]

    def map_page(addr: int, page: object) -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise BackendError("mmap failed: out of memory (a test)")
        real_map_page(addr, page)

    def unmap(addr: int, size_bytes: int) -> None:
        raise BackendError("munmap failed: out of memory (a test)")

    monkeypatch.setattr(backend, "map_page", map_page)
    monkeypatch.setattr(backend, "unmap", unmap)
    with pytest.raises(BackendError, match="mmap failed"):
        segments.map(7, pages)
    monkeypatch.undo()
    assert segments.pages == {} and segments.stuck == {7: pages}
    assert [backend.is_mapped(base + 7 * PAGE) for base in segments.bases] == [True, True, False]
    assert segments.unmap_stuck() == {7: pages}
    segments.release(pages)
    segments.free_ranges()
