"""The service's policies driven by its injected clock: grow ranges, reclaim escalation,
the sleep exchange's decisions, the idle policy, and a request that hits a bug."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvdaemon.daemon import reclaim
from kvdaemon.daemon.reclaim import MAX_PARKED_PER_TENANT
from kvdaemon.daemon.reclaim_debt import LAPSE_S
from kvdaemon.daemon.tenant import VICTIM_IDLE_S
from kvdaemon.wire.handles import MAX_GROW_PAGES, max_grant_pages
from kvdaemon.wire.protocol import decode, request

from tests.conftest import PAGE_BYTES, small_spec
from tests.kvdaemon.daemon.test_service import NUM_PAGES, Harness, deferred, start_sleep


@pytest.fixture
def h() -> Iterator[Harness]:
    harness = Harness(reclaim_wait_s=2.0, reclaim_escalate_s=0.25, sleep_timeout_s=10.0)
    yield harness
    harness.backend.close()


def grow(h: Harness, name: str, token: str, pages: list[int], **extra: Any) -> dict[str, Any]:
    return h.call("grow", **h.auth(name, token, logical_pages=pages, **extra))


def notices_to(h: Harness, reg: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [n["args"] for tid, n in h.leases.notices if tid == reg["tenant_id"] and n["notice"] == kind]


def test_a_grow_grants_as_many_candidates_as_fit_at_least_its_minimum(h: Harness) -> None:
    reg = h.register("a", max_bytes=6 * PAGE_BYTES)  # 3 logical pages of 2 segments
    reply = grow(h, "a", reg["token"], [0, 1, 2, 3, 4], min_pages=1)
    assert [lp for lp, _ in reply["result"]["pages"]] == [0, 1, 2]  # the limit's worth, in order
    assert reply["result"]["max_bytes"] == 6 * PAGE_BYTES
    assert grow(h, "a", reg["token"], [3], min_pages=1)["error"]["code"] == "OVER_LIMIT"
    b = h.register("b")
    # 10 pages free = 5 logical pages: a minimum of 6 is refused whole, 5 of 7 granted
    assert grow(h, "b", b["token"], list(range(7)), min_pages=6, wait_s=0)["error"]["code"] == "NO_MEMORY"
    assert h.ok("status")["free_bytes"] == 10 * PAGE_BYTES
    assert len(grow(h, "b", b["token"], list(range(7)), min_pages=5)["result"]["pages"]) == 5
    assert grow(h, "b", b["token"], [7], min_pages=2)["error"]["code"] == "BAD_REQUEST"
    refused = {row["name"]: row["refused_grows"] for row in h.ok("status")["tenants"]}
    assert refused == {"a": 1, "b": 1}


def test_reclaim_escalates_with_the_clock(h: Harness) -> None:
    a = h.register("a", sleepable=True)
    b = h.register("b")
    h.ok("grow", **h.auth("a", a["token"], logical_pages=[0, 1, 2, 3, 4, 5]))  # 12 of 16 pages
    h.clock.advance(VICTIM_IDLE_S)  # a idle since: a victim reclaim may sleep
    assert h.service.dispatch(b"b", request(5, "grow", h.auth("b", b["token"], logical_pages=[0, 1, 2]))) is None
    # parked: a is asked at once for just the missing pages (6 wanted, 4 free)
    assert notices_to(h, a, "reclaim") == [{"num_pages": 1, "urgent": True, "expires_at": h.clock() + LAPSE_S}]
    h.tick(0.2)
    assert len(notices_to(h, a, "reclaim")) == 1 and h.replies == []
    h.tick(0.1)  # past escalate_s: every victim asked for what is missing
    assert len(notices_to(h, a, "reclaim")) == 2
    h.tick(0.25)  # past twice that: the longest-idle quiescable victim is slept
    assert [n["mode"] for n in notices_to(h, a, "sleep")] == ["warm"]
    h.tick(1.5)  # past wait_s: refused
    routing_id, payload = h.replies.pop()
    assert routing_id == b"b" and decode(payload)["error"]["code"] == "NO_MEMORY"


def test_victims_slept_counts_a_reclaim_sleep_once_it_is_done_not_when_asked(h: Harness) -> None:
    a = h.register("a", sleepable=True)
    b = h.register("b")
    h.ok("grow", **h.auth("a", a["token"], logical_pages=[0, 1, 2, 3, 4, 5]))
    h.clock.advance(VICTIM_IDLE_S)
    h.service.dispatch(b"b", request(5, "grow", h.auth("b", b["token"], logical_pages=[0, 1, 2])))
    h.tick(0.3)
    h.tick(0.25)  # a is asked to sleep; it never quiesces
    assert len(notices_to(h, a, "sleep")) == 1
    assert h.ok("status")["counters"]["victims_slept"] == 0
    h.tick(11.0)  # past sleep_timeout_s: that sleep is cancelled, nothing freed
    assert h.ok("status")["counters"]["victims_slept"] == 0
    h.service.dispatch(b"b", request(6, "grow", h.auth("b", b["token"], logical_pages=[0, 1, 2])))
    h.tick(0.3)
    h.tick(0.25)  # not asked again: silent since it let a sleep lapse (stopped or hung?)
    assert len(notices_to(h, a, "sleep")) == 1
    h.tick(2.0)  # that grow is refused
    h.ok("heartbeat", **h.auth("a", a["token"]))  # heard from again
    h.service.dispatch(b"b", request(7, "grow", h.auth("b", b["token"], logical_pages=[0, 1, 2])))
    h.tick(0.3)
    h.tick(0.25)  # asked again; this time it quiesces
    assert len(notices_to(h, a, "sleep")) == 2
    sleep_id = notices_to(h, a, "sleep")[-1]["sleep_id"]
    h.ok("sleep_ready", **h.auth("a", a["token"], sleep_id=sleep_id))
    counters = h.ok("status")["counters"]
    assert (counters["victims_slept"], counters["sleeps"]) == (1, 1)


def test_reclaim_sleeps_no_busy_tenant_for_another(h: Harness) -> None:
    a = h.register("a", sleepable=True)
    b = h.register("b")
    h.ok("grow", **h.auth("a", a["token"], logical_pages=[0, 1, 2, 3, 4, 5]))
    h.clock.advance(VICTIM_IDLE_S - 1.0)
    h.ok("heartbeat", **h.auth("a", a["token"], active=True))  # its engine stepped: busy
    h.service.dispatch(b"b", request(5, "grow", h.auth("b", b["token"], logical_pages=[0, 1, 2])))
    h.tick(0.3)
    h.tick(0.25)  # past twice the escalation: a busy a keeps its pages (a wake would take them back)
    assert notices_to(h, a, "sleep") == [] and len(notices_to(h, a, "reclaim")) == 2
    h.tick(1.5)
    routing_id, payload = h.replies.pop()
    assert routing_id == b"b" and decode(payload)["error"]["code"] == "NO_MEMORY"
    assert h.ok("status")["counters"]["victims_slept"] == 0


def test_a_victim_that_gives_back_what_it_can_is_still_idle_for_reclaim(h: Harness) -> None:
    a = h.register("a", sleepable=True)
    b = h.register("b")
    h.ok("grow", **h.auth("a", a["token"], logical_pages=[0, 1, 2, 3, 4, 5]))
    h.clock.advance(VICTIM_IDLE_S)
    h.service.dispatch(b"b", request(5, "grow", h.auth("b", b["token"], logical_pages=[0, 1, 2, 3])))
    h.ok("shrink", **h.auth("a", a["token"], logical_pages=[5]))  # its agent's answer: what is spare
    h.tick(0.3)
    h.tick(0.25)  # still short: the idle engine is slept (its pool's return is not its engine's work)
    assert [n["mode"] for n in notices_to(h, a, "sleep")] == ["warm"]


def test_a_parked_grow_asks_its_victims_again_while_it_waits(h: Harness) -> None:
    a = h.register("a")
    b = h.register("b")
    h.ok("grow", **h.auth("a", a["token"], logical_pages=list(range(6))))
    h.service.dispatch(b"b", request(5, "grow", h.auth("b", b["token"], logical_pages=[0, 1, 2])))
    h.tick(0.3)  # past escalate_s: every victim asked
    h.tick(0.3)  # past twice that: no victim can sleep; asked 0.3 s ago
    assert len(notices_to(h, a, "reclaim")) == 2
    h.tick(0.3)  # 0.6 s since the last ask: asked again, so a's debt does not lapse
    assert notices_to(h, a, "reclaim")[2:] == [{"num_pages": 1, "urgent": True, "expires_at": h.clock() + LAPSE_S}]
    h.tick(0.3)
    assert len(notices_to(h, a, "reclaim")) == 3
    h.tick(0.3)
    assert len(notices_to(h, a, "reclaim")) == 4 and h.replies == []


def test_a_parked_grow_keeps_its_tenant_short_past_starved_s(h: Harness) -> None:
    a = h.register("a")
    b = h.register("b")
    h.ok("grow", **h.auth("a", a["token"], logical_pages=list(range(6))))
    h.service.dispatch(b"b", request(5, "grow", h.auth("b", b["token"], logical_pages=[0, 1, 2])))
    for _ in range(5):
        h.tick(0.3)  # 1.5 s parked: past STARVED_S since it parked, short of wait_s
    assert h.replies == []
    short = {row["name"]: row["short"] for row in h.ok("status")["tenants"]}
    assert short == {"a": False, "b": True}


def test_reclaim_never_sleeps_a_tenant_that_cannot_quiesce(h: Harness) -> None:
    a = h.register("a")  # sleepable defaults to False: a raw pool
    b = h.register("b")
    h.ok("grow", **h.auth("a", a["token"], logical_pages=list(range(6))))
    h.service.dispatch(b"b", request(5, "grow", h.auth("b", b["token"], logical_pages=[0, 1, 2])))
    for _ in range(8):
        h.tick(0.3)
    assert notices_to(h, a, "sleep") == []
    assert decode(h.replies.pop()[1])["error"]["code"] == "NO_MEMORY"


def test_a_grow_served_when_a_victim_returns_pages(h: Harness) -> None:
    a = h.register("a")
    b = h.register("b")
    h.ok("grow", **h.auth("a", a["token"], logical_pages=list(range(6))))
    h.service.dispatch(b"b", request(5, "grow", h.auth("b", b["token"], logical_pages=[0, 1, 2, 3], min_pages=3)))
    h.ok("shrink", **h.auth("a", a["token"], logical_pages=[5]))
    h.tick(0.01)
    reply = decode(h.replies.pop()[1])
    assert [lp for lp, _ in reply["result"]["pages"]] == [0, 1, 2]


def test_sleep_ready_is_idempotent_and_refusal_changes_nothing(h: Harness) -> None:
    reg = h.register("a", sleepable=True)
    h.ok("grow", **h.auth("a", reg["token"], logical_pages=[0]))
    h.service.dispatch(b"cli", request(7, "sleep", {"name": "a", "mode": "warm"}))
    sleep_id = notices_to(h, reg, "sleep")[-1]["sleep_id"]
    first = h.ok("sleep_ready", **h.auth("a", reg["token"], sleep_id=sleep_id))
    assert h.ok("sleep_ready", **h.auth("a", reg["token"], sleep_id=sleep_id)) == first  # a retry
    assert decode(h.replies.pop()[1])["result"] == first
    h.ok("wake", name="a")
    h.service.dispatch(b"cli", request(8, "sleep", {"name": "a", "mode": "cold"}))
    sleep_id = notices_to(h, reg, "sleep")[-1]["sleep_id"]
    refused = h.ok("sleep_ready", **h.auth("a", reg["token"], sleep_id=sleep_id, refused=True))
    assert refused["refused"] is True
    assert decode(h.replies.pop()[1])["error"]["code"] == "CONFLICT"
    row = h.ok("status")["tenants"][0]
    assert (row["state"], row["mapped_bytes"], row["sleepable"]) == ("active", 2 * PAGE_BYTES, False)


def test_sleep_and_wake_again_answer_with_the_state_and_cold_converts_warm(h: Harness) -> None:
    reg = h.register("a")
    h.ok("grow", **h.auth("a", reg["token"], logical_pages=[0]))
    assert h.ok("wake", name="a") == {"state": "active", "mapped_bytes": 2 * PAGE_BYTES, "already": True}
    h.service.dispatch(b"cli", request(7, "sleep", {"name": "a", "mode": "warm"}))
    h.ok("sleep_ready", **h.auth("a", reg["token"], sleep_id=notices_to(h, reg, "sleep")[-1]["sleep_id"]))
    assert h.ok("sleep", name="a", mode="warm")["already"] is True
    cold = h.ok("sleep", name="a", mode="cold")
    assert (cold["state"], cold["host_bytes"]) == ("sleeping-cold", 0)
    assert h.ok("wake", name="a")["mapped_bytes"] == 0


def test_the_idle_policy_sleeps_only_quiescable_tenants(h: Harness) -> None:
    h.service.config = type(h.service.config)(idle_sleep_s=60.0)
    raw = h.register("raw")
    engine = h.register("engine", sleepable=True)
    h.tick(59.0)
    assert h.leases.notices == []
    h.tick(2.0)
    assert notices_to(h, raw, "sleep") == [] and len(notices_to(h, engine, "sleep")) == 1


def test_a_bug_in_one_request_is_internal_and_the_daemon_goes_on(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    reg = h.register("a")

    def broken(*_args: object) -> None:
        raise IndexError("list index out of range")

    monkeypatch.setitem(h.service._ops, "status", broken)
    assert h.error("status") == "INTERNAL"
    monkeypatch.undo()
    assert h.ok("grow", **h.auth("a", reg["token"], logical_pages=[0]))["pages"]
    assert h.ok("status")["free_bytes"] == (NUM_PAGES - 2) * PAGE_BYTES


def test_a_warm_wake_short_of_pages_is_served_by_reclaim_like_a_grow(h: Harness) -> None:
    a = h.register("a")
    h.ok("grow", **h.auth("a", a["token"], logical_pages=[0, 1, 2, 3, 4]))  # 10 of 16 pages
    sleep_id = start_sleep(h, "a", "warm")
    h.ok("sleep_ready", **h.auth("a", a["token"], sleep_id=sleep_id))
    deferred(h)
    b = h.register("b")
    h.ok("grow", **h.auth("b", b["token"], logical_pages=list(range(6))))  # 12 pages: 4 free, a needs 10
    assert h.service.dispatch(b"admin", request(9, "wake", {"name": "a"})) is None  # parked, not refused
    assert notices_to(h, b, "reclaim") == [  # just what is missing
        {"num_pages": 3, "urgent": True, "expires_at": h.clock() + LAPSE_S}]
    assert h.ok("status")["tenants"][0]["state"] == "sleeping-warm"
    assert h.service.dispatch(b"admin", request(10, "wake", {"name": "a"})) is None  # a second waits too
    h.ok("shrink", **h.auth("b", b["token"], logical_pages=[3, 4, 5]))  # b gives its cache back
    h.tick(0.01)
    first, second = sorted((decode(payload) for _, payload in h.replies), key=lambda r: r["id"])
    h.replies.clear()
    assert first["id"] == 9 and first["result"] == {"state": "active", "mapped_bytes": 10 * PAGE_BYTES}
    assert second["id"] == 10 and second["result"]["already"] is True  # found it awake
    assert [n["mode"] for n in notices_to(h, a, "wake")] == ["warm"]
    h.ok("shrink", **h.auth("a", a["token"], logical_pages=[0, 1, 2, 3, 4]))
    sleep_id = start_sleep(h, "a", "warm")
    h.ok("sleep_ready", **h.auth("a", a["token"], sleep_id=sleep_id))
    deferred(h)


def test_a_warm_wake_no_reclaim_can_serve_is_refused_at_once(h: Harness) -> None:
    a = h.register("a")
    h.ok("grow", **h.auth("a", a["token"], logical_pages=[0, 1, 2, 3, 4]))
    sleep_id = start_sleep(h, "a", "warm")
    h.ok("sleep_ready", **h.auth("a", a["token"], sleep_id=sleep_id))
    deferred(h)
    b = h.register("b", min_bytes=12 * PAGE_BYTES)  # what b holds is guaranteed: nothing to reclaim
    h.ok("grow", **h.auth("b", b["token"], logical_pages=list(range(6))))
    assert h.error("wake", name="a") == "NO_MEMORY"
    assert notices_to(h, b, "reclaim") == []
    assert h.ok("status")["tenants"][0]["state"] == "sleeping-warm"


def test_a_tenant_parks_a_bounded_number_of_grows(h: Harness) -> None:
    a = h.register("a")
    h.ok("grow", **h.auth("a", a["token"], logical_pages=list(range(6))))  # 12 of 16 pages
    b = h.register("b")
    for i in range(MAX_PARKED_PER_TENANT):
        assert h.service.dispatch(b"b", request(i, "grow", h.auth("b", b["token"], logical_pages=[0, 1, 2]))) is None
    assert h.error("grow", **h.auth("b", b["token"], logical_pages=[0, 1, 2])) == "NO_MEMORY"  # not parked
    assert len(h.service.reclaimer.parked) == MAX_PARKED_PER_TENANT
    h.tick(2.1)  # every parked grow is answered
    assert len(h.replies) == MAX_PARKED_PER_TENANT and h.service.reclaimer.parked == []


def test_at_most_max_parked_grows_wait_in_all_and_the_rest_still_ask_the_victims(
    h: Harness, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(reclaim, "MAX_PARKED", 2)
    a = h.register("a")
    h.ok("grow", **h.auth("a", a["token"], logical_pages=list(range(6))))  # 12 of 16 pages
    regs = [h.register(name) for name in ("b", "c", "d")]
    for i, (name, reg) in enumerate(zip("bc", regs)):
        assert h.service.dispatch(name.encode(), request(i, "grow", h.auth(name, reg["token"],
                                                                           logical_pages=[0, 1, 2]))) is None
    asked = len(notices_to(h, a, "reclaim"))
    assert h.error("grow", **h.auth("d", regs[2]["token"], logical_pages=[0, 1, 2])) == "NO_MEMORY"  # at once
    assert len(h.service.reclaimer.parked) == 2 and len(notices_to(h, a, "reclaim")) == asked + 1


def test_a_parked_grow_keeps_one_grants_worth_of_candidates_and_retries_in_constant_time(
    h: Harness, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A grow naming tens of thousands of candidates was parked with all of them, and every retry
    (after every request to the daemon) scanned them all: a few such tenants stalled everyone."""
    a = h.register("a")
    b = h.register("b", num_virtual_pages=1 << 16)
    h.ok("grow", **h.auth("a", a["token"], logical_pages=list(range(8))))  # 16 of 16 pages
    nseg = small_spec().num_segments
    for op in ("grow", "shrink"):  # more than one request may name, as the client sends them
        code = h.error(op, **h.auth("b", b["token"], logical_pages=list(range(1, MAX_GROW_PAGES + 2))))
        assert code == "BAD_REQUEST"
    assert h.service.dispatch(b"b", request(5, "grow", h.auth(
        "b", b["token"], logical_pages=list(range(1, MAX_GROW_PAGES + 1)), min_pages=1))) is None  # parked
    (parked,) = h.service.reclaimer.parked
    assert parked.candidates == list(range(1, 1 + max_grant_pages(nseg)))  # no more are ever granted
    attempts = []
    grow = h.service.grants.grow
    monkeypatch.setattr(h.service.grants, "grow", lambda *args: attempts.append(1) or grow(*args))
    for _ in range(5):
        h.ok("status")
        h.tick(0.01)
    assert attempts == [], "no free page: each retry ends at the free count, before the candidates"
    h.ok("shrink", **h.auth("a", a["token"], logical_pages=[7]))
    h.tick(0.01)
    routing_id, payload = h.replies.pop()
    assert routing_id == b"b" and [lp for lp, _ in decode(payload)["result"]["pages"]] == [1]
    assert attempts == [1]
