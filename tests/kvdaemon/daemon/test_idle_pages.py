"""A warm sleeper's pages stay backed for its wake; anyone else gets them zeroed; they go back in time."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator

import pytest

from kvdaemon.cuda_vmm import HostBackend
from kvdaemon.daemon.device_pages import DevicePages, Owner
from kvdaemon.daemon.sleep import IDLE_KEEP_S

from tests.conftest import PAGE_BYTES
from tests.kvdaemon.daemon.test_service import NUM_PAGES, Harness, start_sleep


@pytest.fixture
def h() -> Iterator[Harness]:
    harness = Harness()
    yield harness
    harness.backend.close()


def pool_bytes(h: Harness) -> mmap.mmap:
    """The daemon's pool file, mapped here to read and write page bytes."""
    return mmap.mmap(h.backend.pool_fd, NUM_PAGES * PAGE_BYTES, flags=mmap.MAP_SHARED)


def backed_bytes(h: Harness) -> int:
    return os.fstat(h.backend.pool_fd).st_blocks * 512


def grown(h: Harness, name: str, lps: list[int]) -> tuple[str, list[int]]:
    """Register ``name``, grow ``lps``; its token and page ids."""
    token = h.register(name)["token"]
    grant = h.ok("grow", **h.auth(name, token, logical_pages=lps))
    return token, [page_id for _, ids in grant["pages"] for page_id in ids]


def sleep_warm(h: Harness, name: str, token: str) -> None:
    sleep_id = start_sleep(h, name)
    assert h.ok("sleep_ready", **h.auth(name, token, sleep_id=sleep_id))["state"] == "sleeping-warm"


def test_a_warm_wake_gets_its_pages_back_still_backed(h: Harness) -> None:
    token, page_ids = grown(h, "a", [0, 1])
    pool = pool_bytes(h)
    for i, page_id in enumerate(page_ids):
        pool[page_id * PAGE_BYTES : (page_id + 1) * PAGE_BYTES] = bytes([i + 1]) * PAGE_BYTES
    sleep_warm(h, "a", token)
    assert h.ok("status")["free_bytes"] == NUM_PAGES * PAGE_BYTES, "idle pages are free pages"
    assert h.service.pages.num_idle == 4
    assert backed_bytes(h) >= 4 * PAGE_BYTES, "the memory was given back before the wake"
    h.ok("wake", name="a")
    woken = h.leases.grants[-1][2]
    assert sorted(woken) == sorted(page_ids) and h.service.pages.num_idle == 0
    for lp, pages in h.service.tenants.named("a").logical.items():
        for seg, page in enumerate(pages):
            value = 2 * lp + seg + 1
            assert pool[page.page_id * PAGE_BYTES] == value and pool[(page.page_id + 1) * PAGE_BYTES - 1] == value
    pool.close()


def test_another_tenants_grant_of_idle_pages_reads_zero(h: Harness) -> None:
    token, page_ids = grown(h, "a", [0, 1])
    pool = pool_bytes(h)
    for page_id in page_ids:
        pool[page_id * PAGE_BYTES : (page_id + 1) * PAGE_BYTES] = b"\x7f" * PAGE_BYTES
    sleep_warm(h, "a", token)
    _, b_pages = grown(h, "b", list(range(NUM_PAGES // 2)))  # every page: the idle ones too
    assert set(page_ids) <= set(b_pages) and h.service.pages.num_idle == 0
    for page_id in page_ids:
        assert pool[page_id * PAGE_BYTES : (page_id + 1) * PAGE_BYTES].count(0) == PAGE_BYTES
    pool.close()


def test_idle_pages_go_back_to_the_os_in_time(h: Harness) -> None:
    token, _ = grown(h, "a", [0, 1])
    pool = pool_bytes(h)
    pool[: NUM_PAGES * PAGE_BYTES] = b"\x01" * (NUM_PAGES * PAGE_BYTES)  # touch every page
    pool.close()
    sleep_warm(h, "a", token)
    h.tick(IDLE_KEEP_S - 1)
    assert h.service.pages.num_idle == 4
    h.tick(2)
    assert h.service.pages.num_idle == 0
    assert backed_bytes(h) <= (NUM_PAGES - 4) * PAGE_BYTES, "released pages kept their memory"


def test_a_cold_sleep_keeps_nothing_idle(h: Harness) -> None:
    token, _ = grown(h, "a", [0])
    sleep_id = start_sleep(h, "a", "cold")
    h.ok("sleep_ready", **h.auth("a", token, sleep_id=sleep_id))
    assert h.service.pages.num_idle == 0


def test_idle_pages_are_bounded_and_only_where_the_backend_gains() -> None:
    backend = HostBackend(num_pages=8, page_size_bytes=PAGE_BYTES)
    backend.start()
    try:
        pages = DevicePages(backend, max_idle=2)
        taken = pages.alloc([Owner(1, 0, lp) for lp in range(3)])
        pages.free([p.page_id for p in taken], keep_until=5.0)
        assert pages.num_idle == 2 and pages.num_free == 8
        pages.check()
        assert pages.trim(4.9) == 0 and pages.trim(5.0) == 2
        backend.recycles_released_pages = False  # as on CUDA
        none_kept = DevicePages(backend, max_idle=2)
        taken = none_kept.alloc([Owner(1, 0, 0)])
        none_kept.free([taken[0].page_id], keep_until=5.0)
        assert none_kept.num_idle == 0
    finally:
        backend.close()
