"""Grows ahead of need: only pages free above the low water, no reclaim, no shortage."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvdaemon.daemon.shares import LOW_WATER
from kvdaemon.wire.protocol import request

from tests.kvdaemon.daemon.test_ask_ahead import reclaims
from tests.kvdaemon.daemon.test_reclaim_share import tokens
from tests.kvdaemon.daemon.test_service import NUM_PAGES, Harness

NUM_SEGMENTS = 2  # the harness's spec: one logical page is two physical pages


@pytest.fixture
def h() -> Iterator[Harness]:
    harness = Harness()
    yield harness
    harness.backend.close()


def row(h: Harness, name: str) -> dict[str, object]:
    return next(t for t in h.ok("status")["tenants"] if t["name"] == name)


def test_a_grow_ahead_leaves_the_low_water_pages_free(h: Harness) -> None:
    tok = {"a": h.register("a")["token"]}
    low_water = int(NUM_PAGES * LOW_WATER)
    assert low_water >= 1
    got = h.ok("grow", **h.auth("a", tok["a"], logical_pages=list(range(8)), min_pages=1, ahead=True))
    assert len(got["pages"]) == (NUM_PAGES - low_water) // NUM_SEGMENTS
    free = h.ok("status")["free_bytes"] // h.service.pages.page_size_bytes
    assert free >= low_water
    code = h.error("grow", **h.auth("a", tok["a"], logical_pages=[7], ahead=True))
    assert code == "NO_MEMORY", "the low-water pages are not for speculation"
    h.ok("grow", **h.auth("a", tok["a"], logical_pages=[7]))  # real need takes them


def test_a_refused_grow_ahead_asks_nobody_and_is_no_shortage(h: Harness) -> None:
    ids, tok = tokens(h, {"hog": 7, "a": 1})  # every page mapped; hog holds past its share
    refused_before = row(h, "a")["refused_grows"]
    code = h.error("grow", **h.auth("a", tok["a"], logical_pages=[1], wait_s=0, ahead=True))
    assert code == "NO_MEMORY"
    assert reclaims(h) == [], "speculation asks no tenant for pages"
    assert row(h, "a")["refused_grows"] == refused_before, "not counted as a refused grow"
    assert not h.service.shares.is_short(h.service.tenants.named("a"), h.clock.now)
    code = h.error("grow", **h.auth("a", tok["a"], logical_pages=[1], wait_s=0))
    assert code == "NO_MEMORY"
    assert (ids["hog"], 1) in reclaims(h), "real need asks the largest holder"
    assert row(h, "a")["refused_grows"] == refused_before + 1
    assert h.service.shares.is_short(h.service.tenants.named("a"), h.clock.now)


def test_a_grow_ahead_takes_nothing_held_for_a_short_tenant(h: Harness) -> None:
    _, tok = tokens(h, {"big": 5, "small": 1})  # 12 of 16 mapped; small's share is 8
    h.error("grow", **h.auth("small", tok["small"], logical_pages=list(range(1, 7)), wait_s=0))  # short: 6 more
    code = h.error("grow", **h.auth("big", tok["big"], logical_pages=[5], ahead=True))
    assert code == "NO_MEMORY", "the free pages are owed to the short tenant below its share"


@pytest.mark.parametrize("value", [1, "yes", None, [True]])
def test_a_bad_ahead_flag_is_refused_and_changes_nothing(h: Harness, value: object) -> None:
    _, tok = tokens(h, {"a": 1})
    assert h.error("grow", **h.auth("a", tok["a"], logical_pages=[1], ahead=value)) == "BAD_REQUEST"
    assert row(h, "a")["mapped_bytes"] == NUM_SEGMENTS * h.service.pages.page_size_bytes


def test_no_grow_ahead_while_a_grow_is_parked(h: Harness) -> None:
    _, tok = tokens(h, {"hog": 5, "a": 1})  # 12 of 16 mapped: two logical pages free
    tok["b"] = h.register("b")["token"]
    parked = request(999, "grow", h.auth("a", tok["a"], logical_pages=[1, 2, 3]))
    assert h.service.dispatch(b"a", parked) is None and h.service.reclaimer.parked, "a waits for the hog"
    code = h.error("grow", **h.auth("b", tok["b"], logical_pages=[0], ahead=True))
    assert code == "NO_MEMORY", "the pages coming back are the parked grow's"
    assert h.ok("grow", **h.auth("b", tok["b"], logical_pages=[0]))["pages"], "real need is still served"


def test_grows_a_pool_refused_itself_are_counted_from_its_heartbeat(h: Harness) -> None:
    tok = h.register("a", max_bytes=2 * NUM_SEGMENTS * h.service.pages.page_size_bytes)["token"]
    h.ok("heartbeat", **h.auth("a", tok))
    assert (row(h, "a")["refused_grows"], row(h, "a")["refused_seconds_ago"]) == (0, None)
    h.ok("heartbeat", **h.auth("a", tok, refused_grows=3))
    tenant = h.service.tenants.named("a")
    h.clock.advance(7.5)
    assert (row(h, "a")["refused_grows"], row(h, "a")["refused_seconds_ago"]) == (3, 7.5)
    assert tenant.last_refusal == ("3 grow(s) refused by its pool, past the limit it knew then (limit now 8.00 MiB, "
                                  "0 B mapped)")
    for bad in (-1, "3", 1.5, 1 << 63):
        assert h.error("heartbeat", **h.auth("a", tok, refused_grows=bad)) == "BAD_REQUEST"
    assert row(h, "a")["refused_grows"] == 3
    for _ in range(2):  # a tenant feeding the largest count twice: status still encodes
        h.ok("heartbeat", **h.auth("a", tok, refused_grows=(1 << 63) - 1))
    assert row(h, "a")["refused_grows"] == (1 << 63) - 1
