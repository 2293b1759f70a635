"""A tenant short of pages itself keeps its weighted share from reclaim, and no more."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvdaemon.daemon.shares import STARVED_S

from tests.kvdaemon.daemon.test_ask_ahead import reclaims
from tests.kvdaemon.daemon.test_service import Harness


@pytest.fixture
def h() -> Iterator[Harness]:
    harness = Harness()
    yield harness
    harness.backend.close()


def refused_grow(h: Harness, name: str, token: str, logical_page: int) -> None:
    code = h.error("grow", **h.auth(name, token, logical_pages=[logical_page], wait_s=0))
    assert code == "NO_MEMORY"


def tokens(h: Harness, sizes: dict[str, int]) -> tuple[dict[str, int], dict[str, str]]:
    """Register tenants and grow each to ``sizes[name]`` logical pages: their ids and tokens."""
    ids, toks = {}, {}
    for name, num in sizes.items():
        reg = h.register(name)
        h.ok("grow", **h.auth(name, reg["token"], logical_pages=list(range(num))))
        ids[name], toks[name] = reg["tenant_id"], reg["token"]
    return ids, toks


def test_a_short_tenant_within_its_share_is_not_asked(h: Harness) -> None:
    ids, tok = tokens(h, {"a": 4, "b": 4})  # 8 physical pages each: both at their half
    refused_grow(h, "a", tok["a"], 4)  # a is short itself
    before = len(reclaims(h))
    refused_grow(h, "b", tok["b"], 4)
    assert [r for r in reclaims(h)[before:] if r[0] == ids["a"]] == [], "a keeps its share"
    h.tick(STARVED_S)
    before = len(reclaims(h))
    refused_grow(h, "b", tok["b"], 5)
    assert (ids["a"], 1) in reclaims(h)[before:], "a no longer short: asked again"


def test_a_short_tenant_past_its_share_is_asked_for_the_excess(h: Harness) -> None:
    ids, tok = tokens(h, {"a": 6, "b": 2})  # a: 12 of 16 physical pages, its share is 8
    refused_grow(h, "a", tok["a"], 6)  # a is short itself, yet holds more than its share
    before = len(reclaims(h))
    refused_grow(h, "b", tok["b"], 2)
    assert (ids["a"], 1) in reclaims(h)[before:], "growing all the time keeps no more than a share"


def test_weights_set_the_share(h: Harness) -> None:
    ids, tok = tokens(h, {"a": 6, "b": 2})
    h.ok("set_limit", name="a", weight=3.0)  # a's share: 12 of 16 physical pages
    refused_grow(h, "a", tok["a"], 6)
    before = len(reclaims(h))
    refused_grow(h, "b", tok["b"], 2)
    assert [r for r in reclaims(h)[before:] if r[0] == ids["a"]] == []


def test_free_pages_are_held_for_a_short_tenant_below_its_share(h: Harness) -> None:
    _, tok = tokens(h, {"a": 6, "b": 1})  # a: 12 physical pages (share 8), b: 2; 2 free
    code = h.error("grow", **h.auth("b", tok["b"], logical_pages=[1, 2, 3], wait_s=0))
    assert code == "NO_MEMORY"  # b is short: it needs 6, 2 are free
    assert h.error("grow", **h.auth("a", tok["a"], logical_pages=[6], wait_s=0)) == "NO_MEMORY", \
        "a, past its share, took the pages b is owed"
    h.ok("grow", **h.auth("b", tok["b"], logical_pages=[1], wait_s=0))  # b, within its share, gets them
    h.ok("shrink", **h.auth("b", tok["b"], logical_pages=[1]))
    h.tick(STARVED_S)
    h.ok("grow", **h.auth("a", tok["a"], logical_pages=[6], wait_s=0))  # nobody short any more


def test_a_tenant_within_its_share_is_never_refused_for_another(h: Harness) -> None:
    _, tok = tokens(h, {"a": 2, "b": 2})  # 4 physical pages each (shares of 8); 8 free
    code = h.error("grow", **h.auth("b", tok["b"], logical_pages=[2, 3, 4, 5, 6], wait_s=0))
    assert code == "NO_MEMORY"  # b is short: 10 pages for 8 free, 4 of them owed to it
    h.ok("grow", **h.auth("a", tok["a"], logical_pages=[2, 3], wait_s=0))  # up to a's own share
    assert h.error("grow", **h.auth("a", tok["a"], logical_pages=[4], wait_s=0)) == "NO_MEMORY"
    h.ok("grow", **h.auth("b", tok["b"], logical_pages=[2, 3], wait_s=0))


def test_tenants_that_each_need_more_than_their_share_take_turns(h: Harness) -> None:
    """Short tenants each needing 8 of 16 pages against a share of 5: each held back its room from
    the others, so with three of them 10 of 16 free pages were held and no 8-page grow could fit."""
    _, tok = tokens(h, {"a": 4, "b": 4})  # 8 physical pages each: full
    tok["c"] = h.register("c")["token"]
    need = [0, 1, 2, 3]  # 4 logical pages of 2 segments: 8 physical pages
    assert h.error("grow", **h.auth("c", tok["c"], logical_pages=need, wait_s=0)) == "NO_MEMORY"
    h.tick(0.1)
    h.ok("shrink", **h.auth("b", tok["b"], logical_pages=need))
    assert h.error("grow", **h.auth("b", tok["b"], logical_pages=need, wait_s=0)) == "NO_MEMORY", \
        "c, refused first, is owed its room (5): 3 of the 8 free pages are left for b"
    h.tick(0.1)
    h.ok("shrink", **h.auth("a", tok["a"], logical_pages=need))  # 16 free, b and c short
    h.ok("grow", **h.auth("a", tok["a"], logical_pages=need, wait_s=0))  # c's room held back: 11 left
    assert h.error("grow", **h.auth("b", tok["b"], logical_pages=need, wait_s=0)) == "NO_MEMORY"
    h.ok("grow", **h.auth("c", tok["c"], logical_pages=need, wait_s=0))  # the longest refused
    h.ok("shrink", **h.auth("a", tok["a"], logical_pages=need))
    h.ok("grow", **h.auth("b", tok["b"], logical_pages=need, wait_s=0))  # b's turn
