"""Ask-ahead reclaim: with too few pages free, the daemon asks the largest holder before anyone's grow fails."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvdaemon.daemon.reclaim import ASK_AHEAD_S
from kvdaemon.daemon.reclaim_debt import LAPSE_S
from kvdaemon.daemon.shares import LOW_WATER
from kvdaemon.daemon.tenant import TenantState

from tests.kvdaemon.daemon.test_service import NUM_PAGES, PAGE_BYTES, Harness


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
    assert asks[-1]["expires_at"] == h.clock() + LAPSE_S, "read later than its debt lasts, it is let go"
    hb = h.ok("heartbeat", **h.auth("small", small.token))
    assert hb["now"] == h.clock(), "the clock the ask's expiry reads, for the tenant to place beside its own"


def test_an_ask_ahead_goes_to_the_tenant_past_its_fair_share_not_the_largest(h: Harness) -> None:
    """Fair shares (15 pages less the low water, halved: 7 each): "within" holds 6 pages, all
    reclaimable; "past" holds 10 with 8 of them its minimum. Largest reclaimable first would ask
    "within"; only "past" holds anything past its fair share."""
    reg = h.register("past", min_bytes=8 * PAGE_BYTES)
    h.ok("grow", **h.auth("past", reg["token"], logical_pages=list(range(5))))
    ids = {"past": reg["tenant_id"], **fill(h, {"within": 3})}  # 16 of 16 pages mapped
    h.tick(0.01)
    assert reclaims(h) == [(ids["past"], 1)]


def test_a_guaranteed_tenant_past_its_weighted_part_leaves_the_rest_to_the_others(h: Harness) -> None:
    """"g" is guaranteed 10 pages and holds them: its fair share is its minimum, the other two
    split the rest (2.5 pages each, 2 in whole logical pages), so "b" (4 pages) is past its own."""
    reg = h.register("g", min_bytes=10 * PAGE_BYTES)
    h.ok("grow", **h.auth("g", reg["token"], logical_pages=list(range(5))))
    ids = fill(h, {"b": 2, "c": 1})  # 16 of 16 pages mapped
    h.tick(0.01)
    assert reclaims(h) == [(ids["b"], 1)]


def heartbeat(h: Harness, reg: dict[str, object], name: str) -> dict[str, object]:
    return h.ok("heartbeat", **h.auth(name, reg["token"]))


def test_the_heartbeat_tells_each_tenant_its_fair_share_in_whole_logical_pages(h: Harness) -> None:
    usable = NUM_PAGES - int(NUM_PAGES * LOW_WATER)  # 15 physical pages; a logical page is 2
    a = h.register("a", weight=3.0)
    assert heartbeat(h, a, "a")["fair_bytes"] == usable // 2 * 2 * PAGE_BYTES
    b = h.register("b", weight=1.0)
    assert heartbeat(h, a, "a")["fair_bytes"] == 10 * PAGE_BYTES  # 11.25 pages, in logical pages
    assert heartbeat(h, b, "b")["fair_bytes"] == 2 * PAGE_BYTES  # 3.75
    guaranteed = h.register("g", min_bytes=12 * PAGE_BYTES)
    assert heartbeat(h, guaranteed, "g")["fair_bytes"] == 12 * PAGE_BYTES  # its minimum first
    assert heartbeat(h, a, "a")["fair_bytes"] == 2 * PAGE_BYTES  # 3 pages left: 2.25 of them
    assert heartbeat(h, b, "b")["fair_bytes"] == 0  # 0.75


def test_a_tenant_not_attached_is_told_its_share_as_if_it_were(h: Harness) -> None:
    a = h.register("a")
    unattached = h.register("u", leased=False, weight=3.0)
    assert heartbeat(h, unattached, "u")["fair_bytes"] == 10 * PAGE_BYTES  # 15 * 3/4, not 15 * 3/3
    assert heartbeat(h, a, "a")["fair_bytes"] == 14 * PAGE_BYTES  # "u" holds no share of the others


def test_the_heartbeat_tells_what_a_grow_ahead_of_need_could_take(h: Harness) -> None:
    a = h.register("a")
    assert heartbeat(h, a, "a")["ahead_bytes"] == (NUM_PAGES - int(NUM_PAGES * LOW_WATER)) * PAGE_BYTES
    fill(h, {"b": 7})  # 2 pages free, 1 of them the low water
    assert heartbeat(h, a, "a")["ahead_bytes"] == 1 * PAGE_BYTES


def test_status_gives_every_tenant_the_fair_share_its_heartbeat_is_told(h: Harness) -> None:
    """Status fills the shares once for all tenants; each row must match the per-tenant answer,
    minimums, weights, an unattached tenant and a sleeper included."""
    regs = {
        "a": h.register("a", weight=3.0),
        "b": h.register("b", weight=1.0),
        "g": h.register("g", min_bytes=6 * PAGE_BYTES),
        "u": h.register("u", leased=False, weight=2.0),
        "s": h.register("s", weight=0.5),
    }
    sleeper = h.service.tenants.find("s")
    assert sleeper is not None
    told_awake = heartbeat(h, regs["s"], "s")["fair_bytes"]  # its share as if it were active
    sleeper.state = TenantState.SLEEPING_COLD
    h.service.tenants.changed()  # as the sleeper does when it sleeps one
    rows = {row["name"]: row for row in h.service.status()["tenants"]}
    told = {name: heartbeat(h, reg, name)["fair_bytes"] for name, reg in regs.items() if name != "s"}
    assert {name: rows[name]["fair_bytes"] for name in told} == told
    assert told["g"] == 6 * PAGE_BYTES and told["a"] > told["b"] > 0
    assert rows["s"]["fair_bytes"] == told_awake
