"""Reclaim debts: a tenant that ignores urgent reclaim asks is counted and shown; one that gives is not."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from kvdaemon.cli import status_view
from kvdaemon.daemon.reclaim_debt import LAPSE_S, ReclaimDebt
from kvdaemon.wire.protocol import request

from tests.kvdaemon.daemon.test_ask_ahead import fill, reclaims
from tests.kvdaemon.daemon.test_service import PAGE_BYTES, Harness


@pytest.fixture
def h() -> Iterator[Harness]:
    harness = Harness(reclaim_sleep=False)  # the hog cannot be slept away: only its debt shows it
    yield harness
    harness.backend.close()


def test_a_debt_is_paid_by_pages_given_back_and_lapses_unpaid_without_them() -> None:
    debt = ReclaimDebt()
    debt.ask(3, now=0.0, requester_id=7)
    debt.ask(2, now=0.5, requester_id=7)  # the largest open ask stands
    assert debt.owed_pages == 3
    debt.give(1)
    assert not debt.lapse(0.5 + LAPSE_S) and debt.owed_pages == 0  # gave some: not unpaid
    debt.ask(2, now=10.0, requester_id=7)
    assert not debt.lapse(10.0 + LAPSE_S / 2) and debt.owed_pages == 2  # not lapsed yet
    assert debt.lapse(10.0 + LAPSE_S) and debt.num_unpaid == 1
    debt.ask(2, now=20.0, requester_id=7)
    debt.give(2)  # paid in full: closed at once
    assert debt.owed_pages == 0 and not debt.lapse(30.0) and debt.num_unpaid == 1


def test_a_debt_ends_when_every_tenant_it_was_asked_for_has_left() -> None:
    debt = ReclaimDebt()
    debt.ask(2, now=0.0, requester_id=7)
    debt.ask(1, now=0.1, requester_id=8)
    debt.requester_left(7)
    assert debt.owed_pages == 2  # still owed to 8
    debt.requester_left(8)
    assert debt.owed_pages == 0 and not debt.lapse(LAPSE_S) and debt.num_unpaid == 0


def park(h: Harness, name: str, token: str, logical_pages: list[int]) -> None:
    """A grow that waits for pages (its reply deferred)."""
    grow = request(99, "grow", h.auth(name, token, logical_pages=logical_pages, wait_s=1.0))
    assert h.service.dispatch(b"w", grow) is None and h.service.reclaimer.parked


def row(h: Harness, name: str) -> dict[str, object]:
    return next(t for t in h.ok("status")["tenants"] if t["name"] == name)


def test_a_tenant_ignoring_urgent_asks_is_shown_and_logged(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvdaemon.reclaim")
    ids = fill(h, {"hog": 7})  # 14 of 16 physical pages, 28 MiB
    honest = h.register("honest")
    h.ok("grow", **h.auth("honest", honest["token"], logical_pages=[0]))
    park(h, "honest", honest["token"], [1, 2])
    assert any(tid == ids["hog"] for tid, _ in reclaims(h))
    assert row(h, "hog")["reclaim_owed_bytes"] == 2 * 2 * PAGE_BYTES  # asked for 2 logical pages
    for _ in range(int((1.0 + LAPSE_S) / 0.25) + 2):  # the grow waits 1 s, asking; the hog gives nothing
        h.tick(0.25)
    hog = row(h, "hog")
    assert (hog["reclaim_owed_bytes"], hog["unpaid_reclaims"]) == (0, 1)
    assert row(h, "honest")["unpaid_reclaims"] == 0
    note = "gave nothing back for 1 urgent reclaim ask(s) since it registered (28.0 MiB held now)"
    assert any(n.startswith(note) for n in status_view.tenant_notes(hog)), status_view.tenant_notes(hog)
    assert [r for r in caplog.records if "gave nothing back" in r.getMessage()]


def test_a_victim_owes_nothing_once_the_tenant_it_was_asked_for_is_gone(h: Harness) -> None:
    fill(h, {"hog": 7})
    wanting = h.register("wanting")
    park(h, "wanting", wanting["token"], [0, 1])
    assert row(h, "hog")["reclaim_owed_bytes"] > 0
    h.ok("unregister", **h.auth("wanting", wanting["token"]))  # it died or left while it waited
    assert row(h, "hog")["reclaim_owed_bytes"] == 0
    for _ in range(int((1.0 + LAPSE_S) / 0.25) + 2):
        h.tick(0.25)
    assert row(h, "hog")["unpaid_reclaims"] == 0  # not blamed for ignoring an ask nobody waits on


def test_a_victim_that_gives_pages_back_owes_nothing(h: Harness) -> None:
    fill(h, {"giver": 7})
    giver = h.service.tenants.named("giver")
    honest = h.register("honest")
    park(h, "honest", honest["token"], [0, 1])
    assert row(h, "giver")["reclaim_owed_bytes"] > 0
    h.service.grants.shrink(giver, [6, 5], h.clock())  # what its pool's agent does when asked
    for _ in range(int((1.0 + LAPSE_S) / 0.25) + 2):
        h.tick(0.25)
    assert (row(h, "giver")["reclaim_owed_bytes"], row(h, "giver")["unpaid_reclaims"]) == (0, 0)
