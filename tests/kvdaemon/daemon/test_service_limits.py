"""``set_limit`` and registration under the operator's policies, through ``Service.dispatch``:
policies before registration, the config file's against ``limit``'s, ``none`` and ``reset``,
clamped limits, a tenant's own request bounded by the policy, and a policy kept across a restart."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvdaemon.daemon import limits
from kvdaemon.daemon.policies import parse_policy
from kvdaemon.daemon.policy_book import PolicyBook
from kvdaemon.daemon.policy_file import policy_path

from tests.conftest import PAGE_BYTES, small_spec
from tests.kvdaemon.daemon.test_service import NUM_PAGES, Harness

MiB = 1024 * 1024
CAPACITY = NUM_PAGES * PAGE_BYTES  # 32 MiB
NO_CLAMP: list[Any] = []


@pytest.fixture
def h() -> Iterator[Harness]:
    harness = Harness()
    yield harness
    harness.backend.close()


def config_harness(**policies: dict[str, Any]) -> Harness:
    """A harness whose config file declared ``[tenants.NAME]`` tables."""
    tenants = tuple(sorted((name, parse_policy(fields, name)) for name, fields in policies.items()))
    return Harness(tenants=tenants)


def row(h: Harness, name: str) -> dict[str, Any]:
    (found,) = [t for t in h.ok("status")["tenants"] if t["name"] == name]
    return found


def limits_of(h: Harness, name: str) -> tuple[int, int, float]:
    found = row(h, name)
    return found["max_bytes"], found["min_bytes"], found["weight"]


def limit_notices(h: Harness, tenant_id: int) -> list[dict[str, Any]]:
    return [n["args"] for tid, n in h.leases.notices if tid == tenant_id and n["notice"] == "limit"]


def test_a_policy_set_before_registration_applies_when_it_registers(h: Harness) -> None:
    stored = h.ok("set_limit", name="b", max="25%", weight=2)
    assert stored == {
        "result": "stored", "registered": False, "revision": None, "changed": True, "limit": None,
        "policy": {"max": "25%", "min": None, "weight": 2.0}, "clamped": NO_CLAMP, "warnings": [],
    }  # fmt: skip
    assert h.ok("status")["policies"] == [{
        "name": "b", "registered": False, "max": "25%", "min": None, "weight": 2.0,
        "sources": {"max": "limit", "weight": "limit"},
    }]  # fmt: skip
    reg = h.register("b")
    assert reg["max_bytes"] == 8 * MiB
    assert reg["limit"] == {"max_bytes": 8 * MiB, "min_bytes": 0, "weight": 2.0, "revision": 0}
    assert limits_of(h, "b") == (8 * MiB, 0, 2.0)
    assert h.ok("status")["policies"][0]["registered"] is True
    grow = h.call("grow", **h.auth("b", reg["token"], logical_pages=[0, 1, 2]))  # 12 MiB > 8 MiB
    assert grow["error"]["code"] == "OVER_LIMIT"


def test_the_policy_bounds_the_tenants_own_request(h: Harness) -> None:
    h.ok("set_limit", name="a", max="25%")
    assert h.register("a", max_bytes=16 * MiB)["max_bytes"] == 8 * MiB  # the policy's is smaller
    h.ok("set_limit", name="b", max="25%")
    assert h.register("b", max_bytes=4 * MiB)["max_bytes"] == 4 * MiB  # its own is smaller
    h.ok("set_limit", name="c", max=6 * MiB, weight=0.5)
    reg = h.register("c", min_bytes=12 * MiB, weight=3.0)  # its own min above the policy's max
    assert reg["limit"] == {"max_bytes": 6 * MiB, "min_bytes": 6 * MiB, "weight": 0.5, "revision": 0}


def test_the_config_file_policy_yields_to_limit_field_by_field() -> None:
    h = config_harness(a={"max": "50%", "weight": 3})
    try:
        reg = h.register("a")
        assert limits_of(h, "a") == (16 * MiB, 0, 3.0)
        h.ok("set_limit", name="a", max="8MiB")  # limit's max wins; the config's weight stays
        assert limits_of(h, "a") == (8 * MiB, 0, 3.0)
        assert h.ok("status")["policies"][0]["sources"] == {"max": "limit", "weight": "config"}
        h.ok("set_limit", name="a", max="none")  # no max at all, whatever the config says
        assert limits_of(h, "a") == (CAPACITY, 0, 3.0)
        reset = h.ok("set_limit", name="a", reset=True)  # the config file's apply again
        assert reset["policy"] == {"max": "50%", "min": None, "weight": 3.0}
        assert limits_of(h, "a") == (16 * MiB, 0, 3.0)
        assert [n["max_bytes"] for n in limit_notices(h, reg["tenant_id"])] == [
            8 * MiB, CAPACITY, 16 * MiB,
        ]  # fmt: skip  # the pool was told each change
        assert [n["revision"] for n in limit_notices(h, reg["tenant_id"])] == [1, 2, 3]
    finally:
        h.backend.close()


def test_max_none_gives_the_tenant_its_own_max_back(h: Harness) -> None:
    h.register("a", max_bytes=12 * MiB)
    h.ok("set_limit", name="a", max_bytes=4 * MiB)
    assert limits_of(h, "a")[0] == 4 * MiB
    h.ok("set_limit", name="a", weight=2)
    removed = h.ok("set_limit", name="a", max="none")
    assert removed["limit"] == {"max_bytes": 12 * MiB, "min_bytes": 0, "weight": 2.0}
    assert removed["policy"] == {"max": None, "min": None, "weight": 2.0}
    h.ok("set_limit", name="a", weight="none")  # nothing left: forgotten
    assert h.ok("status")["policies"] == []
    assert limits_of(h, "a") == (12 * MiB, 0, 1.0)


def test_a_limit_above_the_capacity_is_clamped_and_said_so(h: Harness) -> None:
    clamp = [{"field": "max", "requested_bytes": 20 * 1024 * MiB, "applied_bytes": CAPACITY,
              "reason": "above the capacity"}]  # fmt: skip
    assert h.ok("set_limit", name="b", max="20GiB")["clamped"] == clamp  # not registered yet
    h.register("a")
    applied = h.ok("set_limit", name="a", max_bytes=20 * 1024 * MiB)
    assert applied["clamped"] == clamp
    assert applied["limit"]["max_bytes"] == CAPACITY
    assert applied["policy"]["max"] == 20 * 1024 * MiB  # kept as asked: a larger device may follow


@pytest.mark.parametrize(
    ("args", "code"),
    [
        ({}, "BAD_REQUEST"),  # nothing to set
        ({"max": "8MiB", "max_bytes": 8 * MiB}, "BAD_REQUEST"),
        ({"max": "8MiB", "min": "16MiB"}, "BAD_REQUEST"),
        ({"max": "lots"}, "BAD_REQUEST"),
        ({"min": True}, "BAD_REQUEST"),
        ({"weight": "heavy"}, "BAD_REQUEST"),
        ({"weight": 0}, "BAD_REQUEST"),
        ({"max": "8MiB", "reset": "yes"}, "BAD_REQUEST"),
        ({"name": "not a name", "max": "8MiB"}, "BAD_REQUEST"),
        ({"min": "14MiB"}, "NO_MEMORY"),  # 14 MiB next to a's 20 MiB guarantee in 32 MiB
    ],
)
def test_a_refused_set_limit_changes_nothing(h: Harness, args: dict[str, Any], code: str) -> None:
    h.register("a", min_bytes=20 * MiB)
    h.register("b")
    h.ok("set_limit", name="b", max="50%")
    before = h.ok("status")
    assert h.error("set_limit", **{"name": "b", **args}) == code
    assert h.ok("status")["tenants"] == before["tenants"]
    assert h.ok("status")["policies"] == before["policies"]


def test_a_policy_min_that_does_not_fit_refuses_the_registration(h: Harness) -> None:
    h.register("a", min_bytes=16 * MiB)
    stored = h.ok("set_limit", name="b", min="20MiB")  # stored: it fits the capacity alone
    assert stored["result"] == "stored" and stored["warnings"] == [
        "min 20.0 MiB does not fit now: 16.0 MiB of 32.0 MiB are guaranteed to registered tenants; "
        "a tenant 'b' is refused until they release or lower theirs"
    ]
    reply = h.call("register", name="b", spec=small_spec().to_wire(), num_virtual_pages=8)
    assert reply["error"]["code"] == "NO_MEMORY"
    assert reply["error"]["message"] == (
        "min 20.0 MiB of 'b' does not fit: 16.0 MiB of 32.0 MiB already guaranteed"
    )


def test_a_tenants_own_min_is_clamped_to_what_the_operators_promises_leave() -> None:
    h = config_harness(y={"min": "16MiB"})
    x = h.register("x", min_bytes=20 * MiB)
    assert x["limit"]["min_bytes"] == 16 * MiB, "the promise to y is kept"
    assert x["clamped"] == [{"field": "min", "requested_bytes": 20 * MiB, "applied_bytes": 16 * MiB,
                             "reason": "promised by the operator to 'y'"}]  # fmt: skip
    assert h.register("z")["limit"]["min_bytes"] == 0, "a tenant asking no min always fits"
    assert h.register("y")["limit"]["min_bytes"] == 16 * MiB
    assert h.error("set_limit", name="x", token=x["token"], min_bytes=17 * MiB) == "NO_MEMORY"  # y's is held now
    h.backend.close()


def test_a_promise_made_later_leaves_a_held_min_alone_and_clamps_its_rises(h: Harness) -> None:
    x = h.register("x", min_bytes=24 * MiB)  # before any promise
    stored = h.ok("set_limit", name="y", min="16MiB")
    assert len(stored["warnings"]) == 1 and "does not fit now" in stored["warnings"][0]
    assert h.ok("set_limit", name="x", token=x["token"], weight=2.0)["limit"]["min_bytes"] == 24 * MiB
    raised = h.ok("set_limit", name="x", token=x["token"], min_bytes=28 * MiB)
    assert raised["limit"]["min_bytes"] == 24 * MiB, "a rise stops at what it holds: the promise leaves 16 MiB"
    assert raised["clamped"][0]["reason"] == "promised by the operator to 'y'"
    assert h.error("register", name="y", spec=small_spec().to_wire(), num_virtual_pages=8) == "NO_MEMORY"
    h.ok("set_limit", name="x", token=x["token"], min_bytes=8 * MiB)  # x lowers its own: y fits
    assert h.register("y")["limit"]["min_bytes"] == 16 * MiB


def test_the_operators_own_mins_are_first_come_and_an_operator_may_remove_a_policy_min(h: Harness) -> None:
    h.register("t", min_bytes=12 * MiB)
    h.ok("set_limit", name="t", min="4MiB")  # the policy's min replaces its own
    h.ok("set_limit", name="p", min="20MiB")
    removed = h.ok("set_limit", name="t", min="none")  # its own 12 MiB comes back, within the promise
    assert removed["limit"]["min_bytes"] == 12 * MiB, "32 - 20 promised leaves 12"
    h.ok("set_limit", name="p", reset=True)
    assert h.ok("set_limit", name="a", min="16MiB")["warnings"] == []
    stored = h.ok("set_limit", name="b", min="16MiB")  # promises past what is left: the operator's own
    assert stored["warnings"] == [
        "the operator's mins for names not registered add up to 32.0 MiB, past the 20.0 MiB left beside "
        "registered tenants' guarantees: those that register last are refused"
    ]
    assert h.register("a")["limit"]["min_bytes"] == 16 * MiB
    assert h.error("register", name="b", spec=small_spec().to_wire(), num_virtual_pages=8) == "NO_MEMORY"


def test_a_tenant_changes_its_own_request_with_its_token_within_the_policy(h: Harness) -> None:
    h.ok("set_limit", name="a", max="25%")
    reg = h.register("a")
    own = h.ok("set_limit", name="a", token=reg["token"], max_bytes=CAPACITY)
    assert own["limit"]["max_bytes"] == 8 * MiB  # the operator's policy still bounds it
    own = h.ok("set_limit", name="a", token=reg["token"], max_bytes=2 * MiB)
    assert own["limit"]["max_bytes"] == 2 * MiB
    assert h.ok("status")["policies"][0]["max"] == "25%"  # its own request is not the operator's
    assert h.error("set_limit", name="a", token=reg["token"], max="1MiB") == "BAD_REQUEST"
    assert h.error("set_limit", name="a", token="0" * 32, max_bytes=1) == "FORBIDDEN"
    assert h.error("set_limit", name="zz", token="0" * 32, max_bytes=1) == "UNKNOWN_TENANT"


def test_a_tenant_changing_its_own_limits_in_a_loop_logs_a_line_per_interval(
    h: Harness, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.INFO, logger="kvdaemon.limits")
    token = h.register("a")["token"]
    for i in range(100):
        h.ok("set_limit", name="a", token=token, max_bytes=(i % 2 + 1) * MiB)
    own_lines = [r.getMessage() for r in caplog.records if "by the tenant itself" in r.getMessage()]
    assert len(own_lines) == 1, own_lines
    h.ok("set_limit", name="a", max="50%")  # an admin's change is always logged, with the count
    admin_lines = [r.getMessage() for r in caplog.records if "by an admin" in r.getMessage()]
    assert len(admin_lines) == 1 and "(99 more of its own changes before this one" in admin_lines[0]
    monkeypatch.setattr(limits, "OWN_LOG_INTERVAL_S", 0.0)
    h.ok("set_limit", name="a", token=token, max_bytes=3 * MiB)
    last = caplog.records[-1].getMessage()
    assert "by the tenant itself" in last and "more of its own" not in last


def test_an_admin_changing_limits_in_a_loop_logs_a_burst_then_counts(
    h: Harness, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A peer alternating limits of one name wrote a line per call (100 KB/s of log)."""
    caplog.set_level(logging.INFO, logger="kvdaemon.limits")
    h.register("a")
    for i in range(100):
        h.ok("set_limit", name="ghost", max_bytes=(i % 2 + 1) * MiB)  # not registered
        h.ok("set_limit", name="a", max_bytes=(i % 2 + 1) * MiB)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvdaemon.limits"]
    assert len(lines) == limits.ADMIN_LOG_BURST, len(lines)
    monkeypatch.setattr(limits, "ADMIN_LOG_WINDOW_S", 0.0)  # the window has passed
    h.ok("set_limit", name="a", max="50%")
    last = caplog.records[-1].getMessage()
    assert "limits of a set by an admin" in last
    assert f"({200 - limits.ADMIN_LOG_BURST} more admin limit changes before this one, not logged)" in last
    h.ok("set_limit", name="ghost", max="10%")
    assert "not logged" not in caplog.records[-1].getMessage()


def test_a_policy_set_with_limit_is_kept_for_the_next_daemon(tmp_path: Path) -> None:
    first = Harness(policies=PolicyBook({}, policy_path(tmp_path)))
    try:
        first.ok("set_limit", name="b", max="25%", weight=2)
        first.register("a")
        first.ok("set_limit", name="a", max_bytes=4 * MiB)
    finally:
        first.backend.close()
    book = PolicyBook({}, policy_path(tmp_path))
    book.load()  # as the server does at start
    second = Harness(policies=book)
    try:
        assert second.register("b")["limit"]["max_bytes"] == 8 * MiB
        assert second.register("a")["limit"]["max_bytes"] == 4 * MiB
        assert [p["name"] for p in second.ok("status")["policies"]] == ["a", "b"]
    finally:
        second.backend.close()


def test_a_policy_max_under_one_page_says_its_tenant_could_map_nothing(h: Harness) -> None:
    stored = h.ok("set_limit", name="tiny", max=str(PAGE_BYTES // 2))
    assert stored["warnings"] == ["max 1.00 MiB is under one page (2.00 MiB): a tenant 'tiny' could map nothing"]
    assert h.ok("set_limit", name="fits", max=str(PAGE_BYTES))["warnings"] == []
    for i in range(20):
        h.ok("set_limit", name=f"tiny-{i:02d}", max="1KiB")
    warnings = h.ok("status")["warnings"]  # one line each for the first, the rest counted
    assert len(warnings) == limits.MAX_POLICY_WARNINGS and warnings[-1] == "14 more policies with a max under one page"
    assert warnings[0].startswith("policy of tiny: max 1.00 MiB is under one page")


def test_the_config_files_policies_that_cannot_be_given_are_logged_at_start(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvdaemon"):
        config_harness(a={"min": "24MiB"}, b={"min": "16MiB"}, c={"max": "1KiB"}).backend.close()
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "policy of c: max 1.00 KiB is under one page (2.00 MiB): a tenant 'c' could map nothing" in said
    assert ("the operator's mins for names not registered add up to 40.0 MiB, past the 32.0 MiB left beside "
            "registered tenants' guarantees: those that register last are refused") in said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvdaemon"):
        config_harness(a={"min": "16MiB"}, b={"min": "16MiB"}).backend.close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], "policies that fit said nothing"
