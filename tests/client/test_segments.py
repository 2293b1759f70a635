"""SegmentMap: unmapping every page at once (a sleep) by runs keeps the page table exact."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvdaemon.client.segments import SegmentMap
from kvdaemon.cuda_vmm import HostBackend

PAGE = 4096


@pytest.fixture
def backend() -> Iterator[HostBackend]:
    backend = HostBackend(num_pages=64, page_size_bytes=PAGE)
    backend.start()
    yield backend
    backend.close()


def test_unmap_all_by_runs_unmaps_exactly_the_mapped_pages_and_maps_back(backend: HostBackend) -> None:
    segments = SegmentMap(backend, num_segments=2, num_virtual_pages=16, page_bytes=PAGE)
    segments.reserve()
    mapped = [0, 1, 2, 5, 7, 8, 15]  # three runs and two lone pages
    for i, lp in enumerate(mapped):
        pages = [backend.create_page(2 * i), backend.create_page(2 * i + 1)]
        segments.map(lp, pages)
        for seg in range(2):
            segments.view(seg, 16 * PAGE, torch.uint8)[lp * PAGE : (lp + 1) * PAGE] = 10 * seg + lp
    held = dict(segments.pages)
    pages = segments.unmap_all()
    assert pages == held and list(pages) == mapped and segments.pages == {}
    for lp in mapped:  # every slot is free again: a map there succeeds, and the bytes came along
        segments.map(lp, pages[lp])
    for seg in range(2):
        view = segments.view(seg, 16 * PAGE, torch.uint8)
        assert [int(view[lp * PAGE]) for lp in mapped] == [10 * seg + lp for lp in mapped]
    for lp in mapped:
        segments.release(segments.unmap(lp))
    segments.free_ranges()
