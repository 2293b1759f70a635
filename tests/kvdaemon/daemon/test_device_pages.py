"""Pages whose release fails are retired: never granted again, and the rest of the pool works on."""

from __future__ import annotations

import ctypes
import errno
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdaemon.cli.status_view import header_lines
from kvdaemon.cuda_vmm import HostBackend
from kvdaemon.daemon.device_pages import DevicePages, Owner
from kvdaemon.errors import NoMemory

from tests.conftest import PAGE_BYTES
from tests.kvdaemon.daemon.test_service import NUM_PAGES, Harness

NUM = 6


@pytest.fixture
def backend() -> Iterator[HostBackend]:
    host = HostBackend(num_pages=NUM, page_size_bytes=PAGE_BYTES)
    host.start()
    yield host
    host.close()


def failing_release(backend: HostBackend, monkeypatch: pytest.MonkeyPatch, page_ids: set[int]) -> list[int]:
    """Make the backend's release of ``page_ids`` fail as a sealed pool file's would: each hole
    punched over one of them fails (a run with one in it too, then each of its pages is tried).
    Returns the number of pages each punch asked for, as they come."""
    punch = backend._libc.fallocate
    asked: list[int] = []

    def fallocate(fd: int, mode: int, offset: int, size_bytes: int) -> int:
        first = offset // PAGE_BYTES
        asked.append(size_bytes // PAGE_BYTES)
        if page_ids & set(range(first, first + size_bytes // PAGE_BYTES)):
            ctypes.set_errno(errno.EPERM)
            return -1
        return punch(fd, mode, offset, size_bytes)

    monkeypatch.setattr(backend._libc, "fallocate", fallocate)
    return asked


def owners(n: int, start: int = 0) -> list[Owner]:
    return [Owner(1, 0, lp) for lp in range(start, start + n)]


def test_a_page_whose_release_fails_is_retired(backend: HostBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    pages = DevicePages(backend)
    bad = pages.alloc(owners(1))[0].page_id
    failing_release(backend, monkeypatch, {bad})
    pages.free([bad])
    assert (pages.num_retired, pages.num_free) == (1, NUM - 1)
    pages.check()
    granted = [p.page_id for p in pages.alloc(owners(NUM - 1, 1))]
    assert bad not in granted and len(set(granted)) == NUM - 1, "the others are granted, the retired one never"
    with pytest.raises(NoMemory):
        pages.alloc(owners(1, NUM))
    pages.free(granted)
    assert pages.num_free == NUM - 1
    pages.check()


def test_free_releases_each_run_of_consecutive_pages_at_once(
    backend: HostBackend, monkeypatch: pytest.MonkeyPatch,
) -> None:
    pages = DevicePages(backend)
    granted = [p.page_id for p in pages.alloc(owners(NUM))]
    assert granted == list(range(NUM))
    asked = failing_release(backend, monkeypatch, set())
    pages.free([5, 0, 1, 3, 2])  # runs 0-3 and 5
    assert asked == [4, 1]
    pages.check()
    again = [p.page_id for p in pages.alloc(owners(3, NUM))]
    assert again == [1, 2, 3], "the last freed (2, 3, 1) go out first, in page id order"
    asked = failing_release(backend, monkeypatch, {1})
    pages.free(again + [4])
    assert asked == [4, 1, 1, 1, 1], "the run 1-4 failed: then each of its pages"
    assert (pages.num_retired, pages.num_free) == (1, NUM - 1)
    pages.check()


def test_an_idle_page_that_cannot_be_released_for_a_fresh_grant_is_retired(
    backend: HostBackend, monkeypatch: pytest.MonkeyPatch,
) -> None:
    pages = DevicePages(backend, max_idle=NUM)
    all_ids = [p.page_id for p in pages.alloc(owners(NUM))]
    pages.free(all_ids, keep_until=10.0)  # all idle: a fresh grant must release one first
    assert pages.num_idle == NUM
    failing_release(backend, monkeypatch, set(all_ids[:2]))
    page = pages.alloc(owners(1))[0]
    assert page.page_id == all_ids[2], "the two that failed were skipped, the next one released"
    assert (pages.num_retired, pages.num_free) == (2, NUM - 3)
    pages.check()
    assert pages.trim(now=11.0) == NUM - 3
    assert (pages.num_retired, pages.num_free) == (2, NUM - 3)
    pages.check()


def test_a_grant_that_retires_the_last_free_pages_is_refused_whole(
    backend: HostBackend, monkeypatch: pytest.MonkeyPatch,
) -> None:
    pages = DevicePages(backend, max_idle=NUM)
    all_ids = [p.page_id for p in pages.alloc(owners(NUM))]
    pages.free(all_ids, keep_until=10.0)
    failing_release(backend, monkeypatch, set(all_ids[1:]))
    with pytest.raises(NoMemory):
        pages.alloc(owners(2))
    assert (pages.num_retired, pages.num_free, pages.num_idle) == (NUM - 1, 1, 0)
    pages.check()


def test_status_counts_retired_pages_and_grants_go_on(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness()
    try:
        token = h.register("a")["token"]
        grant = h.ok("grow", **h.auth("a", token, logical_pages=[0]))
        bad = grant["pages"][0][1][0]
        failing_release(h.backend, monkeypatch, {bad})
        h.ok("shrink", **h.auth("a", token, logical_pages=[0]))
        status = h.ok("status")
        assert status["retired_bytes"] == PAGE_BYTES
        assert status["free_bytes"] == (NUM_PAGES - 1) * PAGE_BYTES
        assert any(line.startswith("retired ") for line in header_lines(Path("/run/kvd"), status))
        more = h.ok("grow", **h.auth("a", token, logical_pages=list(range(7))))
        assert bad not in [page_id for _, ids in more["pages"] for page_id in ids]
    finally:
        h.backend.close()
