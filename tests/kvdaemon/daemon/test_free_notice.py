"""``free`` notices: a tenant refused pages is told, once, when the grow it was refused would fit."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvdaemon.daemon.shares import STARVED_S

from tests.kvdaemon.daemon.test_reclaim_share import tokens
from tests.kvdaemon.daemon.test_service import PAGE_BYTES, Harness


@pytest.fixture
def h() -> Iterator[Harness]:
    harness = Harness()
    yield harness
    harness.backend.close()


def frees(h: Harness) -> list[tuple[int, int]]:
    """(tenant id, physical pages said free) of every ``free`` notice so far."""
    return [(tid, body["args"]["num_pages"]) for tid, body in h.leases.notices if body["notice"] == "free"]


def test_a_refused_tenant_is_told_once_when_its_grow_would_fit(h: Harness) -> None:
    ids, tok = tokens(h, {"hog": 6, "a": 2})  # every page mapped
    assert h.error("grow", **h.auth("a", tok["a"], logical_pages=[2, 3], wait_s=0)) == "NO_MEMORY"
    h.ok("shrink", **h.auth("hog", tok["hog"], logical_pages=[5]))  # one logical page free: a wanted two
    assert frees(h) == [], "told before its grow fits"
    h.ok("shrink", **h.auth("hog", tok["hog"], logical_pages=[4]))
    assert frees(h) == [(ids["a"], 4)]
    h.tick(0.1)
    h.ok("status")
    assert len(frees(h)) == 1, "told once per refusal"
    h.clock.advance(0.01)
    assert h.error("grow", **h.auth("a", tok["a"], logical_pages=list(range(2, 8)), wait_s=0)) == "NO_MEMORY"
    h.ok("shrink", **h.auth("hog", tok["hog"], logical_pages=[0, 1, 2, 3]))
    assert frees(h)[1:] == [(ids["a"], 12)], "a new refusal arms it again"


def test_nobody_refused_is_told_nothing_and_a_shortage_expires(h: Harness) -> None:
    _, tok = tokens(h, {"hog": 6, "a": 2})
    h.ok("shrink", **h.auth("hog", tok["hog"], logical_pages=[5]))
    assert frees(h) == [], "no refusal, no notice"
    h.ok("grow", **h.auth("hog", tok["hog"], logical_pages=[5]))
    assert h.error("grow", **h.auth("a", tok["a"], logical_pages=[2], wait_s=0)) == "NO_MEMORY"
    h.tick(STARVED_S)
    h.ok("shrink", **h.auth("hog", tok["hog"], logical_pages=[5]))
    assert frees(h) == [], "a refusal older than STARVED_S is not a shortage"


def test_a_refused_grow_ahead_of_need_arms_no_notice(h: Harness) -> None:
    _, tok = tokens(h, {"hog": 6, "a": 2})
    assert h.error("grow", **h.auth("a", tok["a"], logical_pages=[2], ahead=True)) == "NO_MEMORY"
    h.ok("shrink", **h.auth("hog", tok["hog"], logical_pages=[5, 4]))
    assert frees(h) == []


def test_pages_held_for_another_short_tenant_are_not_announced(h: Harness) -> None:
    ids, tok = tokens(h, {"big": 6, "small": 2})  # small's share is 8 physical pages: it holds 4
    assert h.error("grow", **h.auth("small", tok["small"], logical_pages=[2, 3], wait_s=0)) == "NO_MEMORY"
    h.clock.advance(0.01)
    assert h.error("grow", **h.auth("big", tok["big"], logical_pages=[6, 7], wait_s=0)) == "NO_MEMORY"
    h.ok("shrink", **h.auth("big", tok["big"], logical_pages=[5, 4]))
    assert frees(h) == [(ids["small"], 4)], "the free pages are small's (below its share), not big's"


def test_free_pages_are_promised_once_longest_refused_first(h: Harness) -> None:
    ids, tok = tokens(h, {"hog": 6, "a": 1, "b": 1})  # every page mapped; a and b below their shares
    assert h.error("grow", **h.auth("b", tok["b"], logical_pages=[1], wait_s=0)) == "NO_MEMORY"
    h.clock.advance(0.01)
    assert h.error("grow", **h.auth("a", tok["a"], logical_pages=[1], wait_s=0)) == "NO_MEMORY"
    h.ok("shrink", **h.auth("hog", tok["hog"], logical_pages=[5]))  # room for one of the two grows
    assert frees(h) == [(ids["b"], 2)], "only the longest refused is sent after the pages"
    h.ok("shrink", **h.auth("hog", tok["hog"], logical_pages=[4]))
    assert [tid for tid, _ in frees(h)] == [ids["b"], ids["a"]], "then the next, for the pages not promised"


def test_status_tells_each_tenants_fair_share_and_whether_it_is_short(h: Harness) -> None:
    _, tok = tokens(h, {"hog": 6, "a": 2})  # 16 pages, 1 the low water: 15 halved, in logical pages of 2
    assert h.error("grow", **h.auth("a", tok["a"], logical_pages=[2], wait_s=0)) == "NO_MEMORY"
    rows = {row["name"]: row for row in h.ok("status")["tenants"]}
    assert [rows[name]["fair_bytes"] for name in ("hog", "a")] == [6 * PAGE_BYTES] * 2
    assert (rows["a"]["short"], rows["hog"]["short"]) == (True, False)
    h.tick(STARVED_S)
    assert not any(row["short"] for row in h.ok("status")["tenants"]), "a refusal older than STARVED_S"


def test_a_pass_over_many_short_tenants_walks_the_tenants_once(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, tok = tokens(h, {"hog": 8})  # every page mapped
    names = [f"t{i}" for i in range(6)]
    for name in names:  # each refused at once: short, below its share (2 pages), waiting
        tok[name] = h.register(name)["token"]
        assert h.error("grow", **h.auth(name, tok[name], logical_pages=[0], wait_s=0)) == "NO_MEMORY"
    walks: list[int] = []
    real_active = h.service.shares._active
    monkeypatch.setattr(h.service.shares, "_active", lambda: walks.append(1) or real_active())
    h.clock.advance(0.01)
    assert h.error("grow", **h.auth("t0", tok["t0"], logical_pages=[0], wait_s=0)) == "NO_MEMORY"
    assert len(walks) <= 2, f"{len(walks)} walks over the tenants for one refused grow: one per short tenant"
    walks.clear()
    h.ok("shrink", **h.auth("hog", tok["hog"], logical_pages=[4, 5, 6, 7]))  # free for four of them
    assert len(frees(h)) == 4, "the longest refused are told, each of what the others were not promised"
    assert len(walks) <= 2, f"{len(walks)} walks over the tenants for one pass: one per short tenant is O(n^2)"
