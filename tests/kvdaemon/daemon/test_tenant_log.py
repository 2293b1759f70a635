"""The log of a tenant's state changes, line by line, driven through the service with its
injected clock: registration, limits, grow/shrink and refusal summaries (rate-limited),
sleeps by whom, wakes, and how a tenant left."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import Any

import pytest

from kvdaemon.daemon.tenant import VICTIM_IDLE_S
from kvdaemon.daemon.tenant_log import MAX_LINES_PER_TICK
from kvdaemon.wire.protocol import request

from tests.conftest import PAGE_BYTES, running_daemon, small_spec, wait_until
from tests.kvdaemon.daemon.test_service import Harness, start_sleep

MiB = 1024 * 1024
PAGE = 2 * PAGE_BYTES  # a logical page of small_spec(): 2 segments
SPEC = "1 layers x 2 KV heads x 64, block 16, float16, 2 segments, 4.00 MiB per logical page"


@pytest.fixture
def h(caplog: pytest.LogCaptureFixture) -> Iterator[Harness]:
    caplog.set_level(logging.INFO, logger="kvdaemon")
    harness = Harness(idle_sleep_s=300.0, reclaim_wait_s=2.0, reclaim_escalate_s=0.25)
    yield harness
    harness.backend.close()


def tenant_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    """``lines`` but the reclaim's (a tenant here has no pool to answer reclaim asks)."""
    return [line for line in lines(caplog) if "gave nothing back" not in line[1]]


def lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    """(level, message) of every record so far, then forget them."""
    found = [(r.levelname, r.getMessage()) for r in caplog.records]
    caplog.clear()
    return found


def grow(h: Harness, name: str, reg: dict[str, Any], pages: list[int], **extra: Any) -> dict[str, Any]:
    return h.call("grow", **h.auth(name, reg["token"], logical_pages=pages, **extra))


def test_registration_says_spec_limits_and_policy(h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    h.register("a", max_bytes=16 * MiB)
    assert lines(caplog) == [("INFO", (
        f"tenant a registered (id 1, pid 0): {SPEC}; max 16.0 MiB, min 0 B, weight 1; "
        "operator policy: no operator limits"
    ))]  # fmt: skip
    h.ok("set_limit", name="b", max="25%", weight=2)
    assert lines(caplog) == [("INFO", (
        "policy of b (not registered) is now max 25%, weight 2; applied when it registers"
    ))]  # fmt: skip
    h.register("b", min_bytes=12 * MiB)
    assert lines(caplog) == [("INFO", (
        f"tenant b registered (id 2, pid 0): {SPEC}; max 8.00 MiB, min 8.00 MiB, weight 2; "
        "operator policy: max 25%, weight 2; min 12.0 MiB clamped to 8.00 MiB (above the max)"
    ))]  # fmt: skip
    h.ok("set_limit", name="c", max="none")  # a removed limit (over a config file's, say) is named, not hidden
    assert lines(caplog) == [("INFO", "policy of c (not registered) is now max none; applied when it registers")]


def test_a_limit_change_says_who_what_and_what_is_owed(h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    reg = h.register("a")
    grow(h, "a", reg, [0, 1, 2])
    caplog.clear()
    h.ok("set_limit", name="a", max="2MiB", weight=3)
    assert lines(caplog) == [("INFO", (
        "limits of a set by an admin: max 2.00 MiB, min 0 B, weight 3 (was max 32.0 MiB, min 0 B, "
        "weight 1; revision 1); 10.0 MiB over it, asked back"
    ))]  # fmt: skip
    caplog.clear()
    h.ok("set_limit", name="a", token=reg["token"], max_bytes=64 * MiB)  # the policy's 2 MiB still binds
    assert lines(caplog) == []
    h.ok("set_limit", name="a", token=reg["token"], max_bytes=MiB)
    assert lines(caplog)[0][1].startswith("limits of a set by the tenant itself: max 1.00 MiB")


def test_grows_and_shrinks_are_summarised_at_most_every_10_s(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    reg = h.register("a")
    caplog.clear()
    grow(h, "a", reg, [0, 1])
    h.tick(0.1)  # the first news goes out at the next tick
    assert lines(caplog) == [("INFO", (
        "tenant a: grew 2 logical page(s) (+8.00 MiB) since it registered 0 s ago; now 8.00 MiB mapped"
    ))]  # fmt: skip
    grow(h, "a", reg, [2])
    h.ok("shrink", **h.auth("a", reg["token"], logical_pages=[0, 2]))
    for _ in range(99):  # ten seconds of ticks: one line at the end, none before
        h.tick(0.1)
        assert lines(caplog) == []
    h.tick(0.1)
    assert lines(caplog) == [("INFO", (
        "tenant a: grew 1 logical page(s) (+4.00 MiB), shrank 2 logical page(s) (-8.00 MiB) in the last 10 s; "
        "now 4.00 MiB mapped"
    ))]  # fmt: skip
    h.tick(30.0)
    assert lines(caplog) == []  # nothing new: nothing said


def test_refused_grows_are_a_warning_with_the_reason_then_a_count(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    reg = h.register("a")
    h.ok("set_limit", name="a", max="8MiB")
    grow(h, "a", reg, [0, 1])
    h.tick(0.1)
    caplog.clear()
    assert grow(h, "a", reg, [2])["error"]["code"] == "OVER_LIMIT"
    h.tick(0.1)
    assert lines(caplog) == [("WARNING", (
        "tenant a: a grow of 4.00 MiB refused (OVER_LIMIT: 8.00 MiB mapped, limit 8.00 MiB)"
    ))]  # fmt: skip
    b = h.register("b")
    grow(h, "b", b, [0, 1, 2, 3, 4])  # 20 of the 32 MiB
    caplog.clear()
    for _ in range(3):
        assert grow(h, "a", reg, [2])["error"]["code"] == "OVER_LIMIT"
    h.ok("set_limit", name="a", max="none")
    caplog.clear()
    assert grow(h, "a", reg, [2, 3], min_pages=2, wait_s=0)["error"]["code"] == "NO_MEMORY"
    h.tick(5.0)
    assert [line for line in tenant_lines(caplog) if line[0] == "WARNING"] == []  # within 10 s: counted
    h.tick(5.0)
    assert tenant_lines(caplog) == [("WARNING", (
        "tenant a: 4 grows refused in the last 10 s; the last: a grow of 8.00 MiB refused "
        "(NO_MEMORY: 4.00 MiB free in the pool)"
    ))]  # fmt: skip
    assert [t["refused_grows"] for t in h.ok("status")["tenants"]] == [5, 0]


def test_sleeps_and_wakes_say_who_asked(h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    reg = h.register("a", sleepable=True)
    grow(h, "a", reg, [0])
    h.tick(0.1)
    caplog.clear()
    sleep_id = start_sleep(h, "a")
    h.ok("sleep_ready", **h.auth("a", reg["token"], sleep_id=sleep_id))
    assert lines(caplog) == [("INFO", (
        "tenant a is sleeping-warm (asked by an admin): 2 physical page(s) (4.00 MiB) freed, "
        "4.00 MiB kept in host memory"
    ))]  # fmt: skip
    h.ok("sleep", name="a", mode="cold")
    assert lines(caplog) == [("INFO", (
        "tenant a is sleeping-cold (asked by an admin): warm sleep made cold, its host copy of "
        "4.00 MiB dropped"
    ))]  # fmt: skip
    h.ok("wake", name="a", token=reg["token"])
    assert lines(caplog) == [("INFO", (
        "tenant a is active (woken by the tenant itself (auto-wake or its own call); "
        "was sleeping-cold): 0 B restored"
    ))]  # fmt: skip
    h.service.dispatch(b"a", request(5, "sleep", {"name": "a", "mode": "warm", "token": reg["token"]}))
    sleep_id = h.leases.notices[-1][1]["args"]["sleep_id"]
    h.ok("sleep_ready", **h.auth("a", reg["token"], sleep_id=sleep_id))
    assert lines(caplog)[0][1].startswith("tenant a is sleeping-warm (asked by the tenant itself): ")
    h.ok("wake", name="a")
    assert lines(caplog) == [("INFO", "tenant a is active (woken by an admin; was sleeping-warm): 0 B restored")]


def test_the_idle_policy_and_reclaim_say_so(h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    idle = h.register("idle", sleepable=True)
    h.tick(300.0)
    sleep_id = h.leases.notices[-1][1]["args"]["sleep_id"]
    h.ok("sleep_ready", **h.auth("idle", idle["token"], sleep_id=sleep_id))
    assert [m for _, m in lines(caplog)][-2:] == [
        "tenant idle idle for 300 s: asking it to sleep (warm)",
        "tenant idle is sleeping-warm (idle policy: idle for 300 s): 0 physical page(s) (0 B) freed",
    ]
    victim = h.register("victim", sleepable=True)
    grow(h, "victim", victim, [0, 1, 2, 3, 4, 5])  # 24 of the 32 MiB
    h.clock.advance(VICTIM_IDLE_S)  # idle since: reclaim may sleep it
    wanting = h.register("wanting")
    h.service.dispatch(b"w", request(9, "grow", h.auth("wanting", wanting["token"], logical_pages=[0, 1, 2])))
    h.tick(0.3)
    h.tick(0.3)  # past twice the escalation: the victim is asked to sleep
    sleep_id = [n for tid, n in h.leases.notices if n["notice"] == "sleep"][-1]["args"]["sleep_id"]
    h.ok("sleep_ready", **h.auth("victim", victim["token"], sleep_id=sleep_id))
    messages = [m for _, m in lines(caplog)]
    assert "reclaim: asking victim to sleep (warm) for wanting" in messages
    assert ("tenant victim is sleeping-warm (reclaim: pages wanted by wanting): 12 physical page(s) "
            "(24.0 MiB) freed, 24.0 MiB kept in host memory") in messages  # fmt: skip


def test_a_sleep_refused_or_not_quiesced_is_a_warning(h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    reg = h.register("a")
    caplog.clear()
    sleep_id = start_sleep(h, "a")
    h.ok("sleep_ready", **h.auth("a", reg["token"], sleep_id=sleep_id, refused=True))
    assert lines(caplog) == [("WARNING", (
        "tenant a refused to sleep (asked by an admin): its engine has no quiesce hook"
    ))]  # fmt: skip
    start_sleep(h, "a", "cold")
    h.tick(10.1)
    assert ("WARNING", "tenant a: its sleep (asked by an admin) is cancelled, nothing freed: "
                       "did not quiesce within 10 s") in lines(caplog)  # fmt: skip


def test_leaving_says_whether_it_unregistered_or_its_lease_ended(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    reg = h.register("a")
    grow(h, "a", reg, [0, 1])
    caplog.clear()
    h.ok("unregister", **h.auth("a", reg["token"]))
    assert lines(caplog) == [
        ("INFO", "tenant a: grew 2 logical page(s) (+8.00 MiB) since it registered 0 s ago; now 8.00 MiB mapped"),
        ("INFO", "tenant a unregistered: 4 physical page(s) (8.00 MiB) back to the pool"),
    ]  # the summary it had not had yet, then the leaving
    h.register("late", leased=False)
    caplog.clear()
    h.tick(10.1)
    assert lines(caplog) == [("WARNING", "tenant late (pid 0) removed: it never attached its handle channel within 10 s")]
    gone = h.register("gone")
    grow(h, "gone", gone, [0])
    h.tick(0.1)
    caplog.clear()
    tenant = h.service.tenants.named("gone")
    h.service.remove(tenant, "its lease ended without an unregister (handle channel closed: EOF)", clean=False)
    (record,) = lines(caplog)
    assert record == ("WARNING", (
        "tenant gone (pid 1234) removed: its lease ended without an unregister (handle channel "
        "closed: EOF); 2 physical page(s) (4.00 MiB) back to the pool"
    ))  # fmt: skip


def test_a_live_daemon_logs_each_state_change_of_a_real_pool(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvdaemon")

    def logged(fragment: str) -> str:
        """The one message containing ``fragment``, once the daemon's thread has logged it."""
        wait_until(lambda: any(fragment in r.getMessage() for r in caplog.records), 5, fragment)
        (message,) = [r.getMessage() for r in caplog.records if fragment in r.getMessage()]
        return message

    with running_daemon() as kvd:
        admin = kvd.client()
        engine = kvd.client()
        pool = engine.register("llama-a", small_spec(), auto_wake=True, num_spare_pages=0,
                               num_prefetch_pages=0)  # fmt: skip
        pool.quiesce_hook = lambda: None
        assert logged("tenant llama-a registered").endswith(
            "max 64.0 MiB, min 0 B, weight 1; operator policy: no operator limits"
        )
        blocks = pool.alloc(4)  # one logical page
        assert logged("tenant llama-a: grew").startswith("tenant llama-a: grew 1 logical page(s) (+4.00 MiB)")
        admin.set_limit("llama-a", max_bytes=32 * MiB)
        assert logged("limits of llama-a").startswith("limits of llama-a set by an admin: max 32.0 MiB")
        admin.sleep("llama-a", "warm")
        assert logged("is sleeping-warm") == (
            "tenant llama-a is sleeping-warm (asked by an admin): 2 physical page(s) (4.00 MiB) freed, "
            "4.00 MiB kept in host memory"
        )
        pool.alloc(4)  # asleep with auto-wake: the pool wakes itself
        assert logged("is active") == (
            "tenant llama-a is active (woken by the tenant itself (auto-wake or its own call); "
            "was sleeping-warm): 4.00 MiB restored"
        )
        pool.free(blocks)
        pool.close()
        assert logged("tenant llama-a unregistered").startswith("tenant llama-a unregistered: ")

        lease = engine.lease("qwen-b", small_spec(), num_virtual_pages=8)
        lease.grow([0])
        kvd.as_if_dead()
        lease.abandon()  # as when its process dies: the handle channel closes, no unregister
        assert re.fullmatch(
            r"tenant qwen-b \(pid \d+\) removed: its lease ended without an unregister "
            r"\(handle channel closed: .*\); 2 physical page\(s\) \(4.00 MiB\) back to the pool",
            logged("tenant qwen-b (pid"),
        )
        kvd.check_invariants()


def test_a_tick_writes_at_most_its_lines_and_the_next_ticks_the_rest(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    big = h.register("big")
    grow(h, "big", big, list(range(8)))  # the whole pool
    names = [f"t{i}" for i in range(2 * MAX_LINES_PER_TICK + 5)]
    for name in names:  # each refused once: one WARNING line due per tenant
        assert grow(h, name, h.register(name), [0], wait_s=0)["error"]["code"] == "NO_MEMORY"
    caplog.clear()
    said: list[str] = []
    for _ in range(3):
        h.tick(0.1)
        got = [message for _, message in tenant_lines(caplog)]
        assert len(got) <= MAX_LINES_PER_TICK
        said += got
    refused = [m.split(":")[0].removeprefix("tenant ") for m in said if "refused (NO_MEMORY" in m]
    assert sorted(refused) == sorted(names), "every tenant's refusal is told once, in turn"
    h.tick(0.1)
    assert tenant_lines(caplog) == []


def test_a_registration_under_a_limit_below_its_logical_page_is_a_warning(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    h.ok("set_limit", name="z", max_bytes=0)  # not registered: its logical page is not known yet
    caplog.clear()
    reg = h.register("z")
    assert lines(caplog)[1:] == [("WARNING", (
        "tenant z: its limit of 0 B is under its logical page of 4.00 MiB: it can map nothing until the "
        "limit is raised (kvdaemon limit z --max SIZE)"
    ))]  # fmt: skip
    assert grow(h, "z", reg, [0])["error"]["code"] == "OVER_LIMIT"
