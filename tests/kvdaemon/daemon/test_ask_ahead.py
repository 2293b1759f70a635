"""Ask-ahead reclaim: with too few pages free, the daemon asks the largest holder before anyone's grow fails."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvdaemon.daemon.reclaim import ASK_AHEAD_S
from kvdaemon.daemon.shares import LOW_WATER

from tests.kvdaemon.daemon.test_service import NUM_PAGES, Harness


@pytest.fixture
def h() -> Iterator[Harness]:
    harness = Harness()
    yield harness
    harness.backend.close()


def reclaims(h: Harness) -> list[tuple[int, int]]:
    """(tenant id, logical pages asked) of every reclaim notice so far."""
    return [(tid, body["args"]["num_pages"]) for tid, body in h.leases.notices if body["notice"] == "reclaim"]


def fill(h: Harness, sizes: dict[str, int]) -> dict[str, int]:
    """Register tenants and grow each to ``sizes[name]`` logical pages; their tenant ids."""
    ids = {}
    for name, num in sizes.items():
        reg = h.register(name)
        h.ok("grow", **h.auth(name, reg["token"], logical_pages=list(range(num))))
        ids[name] = reg["tenant_id"]
    return ids


def test_a_full_pool_asks_the_largest_holder_once_per_interval(h: Harness) -> None:
    ids = fill(h, {"small": 2, "big": 6})  # 16 of 16 pages mapped
    assert int(NUM_PAGES * LOW_WATER) >= 1
    h.tick(0.01)
    assert reclaims(h) == [(ids["big"], 1)], "the largest holder is asked for what the low water lacks"
    h.tick(ASK_AHEAD_S / 2)
    assert len(reclaims(h)) == 1, "asked again within the interval"
    h.tick(ASK_AHEAD_S)
    assert len(reclaims(h)) == 2


def test_enough_free_pages_ask_nobody(h: Harness) -> None:
    fill(h, {"a": 3, "b": 3})  # 12 of 16: above the low water
    h.tick(1.0)
    assert reclaims(h) == []


def test_an_ask_ahead_is_not_urgent_and_an_ask_for_a_grow_is(h: Harness) -> None:
    fill(h, {"small": 2, "big": 6})
    h.tick(0.01)
    asks = [body["args"] for _, body in h.leases.notices if body["notice"] == "reclaim"]
    assert [a["urgent"] for a in asks] == [False], "keeping the low water free owes nothing"
    h.ok("shrink", **h.auth("big", h.service.tenants.named("big").token, logical_pages=[5]))
    small = h.service.tenants.named("small")
    assert h.error("grow", **h.auth("small", small.token, logical_pages=[2, 3], wait_s=0)) == "NO_MEMORY"
    asks = [body["args"] for _, body in h.leases.notices if body["notice"] == "reclaim"]
    assert asks[-1]["urgent"] is True, "a grow's real need is owed"
