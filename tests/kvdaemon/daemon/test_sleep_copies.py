"""A warm sleep or wake bigger than one slice copies between the loop's other work: its
callers are answered at its end, the tenant's pages stay put meanwhile, and a wake,
a removal or a failure mid-copy ends in one state both sides agree on."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from typing import Any

import pytest

from kvdaemon.daemon import sleep as sleep_module
from kvdaemon.wire.protocol import decode, request

from tests.kvdaemon.daemon.test_service import NUM_PAGES, PAGE_BYTES, Harness, start_sleep

NUM_LOGICAL = 3  # logical pages the sleeper holds: six physical pages, six slices


@pytest.fixture
def h() -> Iterator[Harness]:
    harness = Harness()
    harness.backend.copy_slice_bytes = PAGE_BYTES  # a copy of n pages takes n steps
    harness.service.sleeper.copies.budget_s = 0.0  # one slice per step
    yield harness
    harness.backend.close()


def holding(h: Harness, name: str = "a") -> dict[str, Any]:
    """Register ``name`` with ``NUM_LOGICAL`` logical pages, each physical page filled with its id."""
    reg = h.register(name)
    h.ok("grow", **h.auth(name, reg["token"], logical_pages=list(range(NUM_LOGICAL))))
    for pages in h.service.tenants.named(name).logical.values():
        for page in pages:
            h.backend.copy_in(page, memoryview(bytes([page.page_id + 1]) * PAGE_BYTES))
    return reg


def contents(h: Harness, name: str) -> dict[int, list[int]]:
    """The first byte of each physical page of ``name``, by logical page."""
    out: dict[int, list[int]] = {}
    for lp, pages in sorted(h.service.tenants.named(name).logical.items()):
        for page in pages:
            buf = bytearray(PAGE_BYTES)
            h.backend.copy_out(page, memoryview(buf))
            assert buf == bytes([buf[0]]) * PAGE_BYTES
            out.setdefault(lp, []).append(buf[0])
    return out


def send(h: Harness, routing_id: bytes, request_id: int, op: str, **args: Any) -> dict[str, Any] | None:
    """Dispatch one request; its reply now, or None when deferred."""
    raw = h.service.dispatch(routing_id, request(request_id, op, args))
    h.service.check_invariants()
    return None if raw is None else decode(raw)


def replies_to(h: Harness, routing_id: bytes) -> list[dict[str, Any]]:
    return [decode(payload) for rid, payload in h.replies if rid == routing_id]


def step(h: Harness, num_steps: int = 1) -> None:
    for _ in range(num_steps):
        h.service.step_copies()
        h.service.check_invariants()


def quiesced(h: Harness, name: str, reg: dict[str, Any]) -> int:
    """Ask ``name`` to sleep warm (admin) and answer ``sleep_ready``: the copy starts."""
    sleep_id = start_sleep(h, name)
    assert send(h, b"tenant", 5, "sleep_ready", **h.auth(name, reg["token"], sleep_id=sleep_id)) is None
    return sleep_id


def test_a_big_warm_sleep_answers_at_the_end_of_its_copy_and_others_are_served_meanwhile(h: Harness) -> None:
    reg, other = holding(h, "a"), h.register("b")
    before = contents(h, "a")
    quiesced(h, "a", reg)
    step(h, 2)
    assert h.replies == [] and h.service.sleeper.copies.busy
    assert h.ok("grow", **h.auth("b", other["token"], logical_pages=[0]))["pages"]  # served mid-copy
    row = next(t for t in h.ok("status")["tenants"] if t["name"] == "a")
    assert (row["state"], row["mapped_bytes"], row["sleep_pending"], row["copying"]) == (
        "active", 6 * PAGE_BYTES, "warm", "saving")
    reply = send(h, b"tenant", 6, "shrink", **h.auth("a", reg["token"], logical_pages=[0]))
    assert reply is not None and reply["error"]["code"] == "ASLEEP"
    assert "copied to host memory" in reply["error"]["message"]
    h.tick(30.0)  # past the quiesce deadline: a sleep whose copy runs is not cancelled
    assert h.service.sleeper.copies.busy
    h.service.sleeper.copies.run_all()
    (tenant_reply,), (admin_reply,) = replies_to(h, b"tenant"), replies_to(h, b"admin")
    assert tenant_reply["result"] == admin_reply["result"] == {
        "state": "sleeping-warm", "num_released": 6, "host_bytes": 6 * PAGE_BYTES}
    assert send(h, b"admin", 12, "wake", name="a") is None
    h.service.sleeper.copies.run_all()
    assert sorted(before.values()) == sorted(contents(h, "a").values())  # every byte back
    assert h.ok("status")["tenants"][0]["copying"] is None


def test_a_big_warm_wake_sends_its_grant_only_once_the_bytes_are_in(h: Harness) -> None:
    reg = holding(h, "a")
    before = contents(h, "a")
    quiesced(h, "a", reg)
    h.service.sleeper.copies.run_all()
    h.replies.clear()
    num_grants = len(h.leases.grants)
    assert send(h, b"admin", 20, "wake", name="a") is None
    step(h, 2)
    assert len(h.leases.grants) == num_grants  # the pages are not the tenant's to map yet
    row = h.ok("status")["tenants"][0]
    assert (row["state"], row["mapped_bytes"], row["copying"]) == ("sleeping-warm", 6 * PAGE_BYTES, "restoring")
    assert send(h, b"tenant", 21, "sleep", name="a", token=reg["token"], mode="cold") == {
        "id": 21, "ok": False, "error": {"code": "CONFLICT", "message": (
            "tenant 'a' is waking (its KV being copied back): put it to sleep once it is awake")}}
    shrink = send(h, b"tenant", 22, "shrink", **h.auth("a", reg["token"], logical_pages=[0]))
    assert shrink is not None and shrink["error"]["code"] == "ASLEEP"
    assert send(h, b"tenant", 23, "wake", name="a", token=reg["token"]) is None  # joins the first
    h.service.sleeper.copies.run_all()
    answers = replies_to(h, b"admin") + replies_to(h, b"tenant")
    assert [r["id"] for r in answers] == [20, 23]
    assert all(r["result"] == {"state": "active", "mapped_bytes": 6 * PAGE_BYTES} for r in answers)
    assert len(h.leases.grants) == num_grants + 1 and h.leases.notices[-1][1]["notice"] == "wake"
    assert sorted(before.values()) == sorted(contents(h, "a").values())  # every byte back
    assert h.ok("status")["tenants"][0]["copying"] is None


def test_a_wake_while_the_sleep_copies_cancels_it_and_frees_nothing(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    reg = holding(h, "a")
    before = contents(h, "a")
    num_slices = []
    real = h.backend.copy_out_pages
    monkeypatch.setattr(h.backend, "copy_out_pages", lambda *a: num_slices.append(1) or real(*a))
    sleep_id = quiesced(h, "a", reg)
    while len(num_slices) < 2:  # the host buffer backed, two of the six slices copied
        step(h)
    assert h.ok("wake", name="a") == {"state": "active", "mapped_bytes": 6 * PAGE_BYTES, "cancelled_sleep": True}
    assert not h.service.sleeper.copies.busy
    (tenant_reply,) = replies_to(h, b"tenant")
    assert tenant_reply["error"]["code"] == "CONFLICT"  # the tenant maps its pages back
    assert replies_to(h, b"admin")[0]["error"]["code"] == "CONFLICT"
    assert h.leases.notices[-1][1] == {"notice": "sleep_cancelled", "args": {"sleep_id": sleep_id}}
    assert contents(h, "a") == before
    assert h.service.sleeper.buffers.cached_bytes >= 6 * PAGE_BYTES  # the copy's buffer is kept for the next


def test_a_tenant_gone_mid_copy_stops_it_and_its_pages_come_back(h: Harness) -> None:
    reg = holding(h, "a")
    quiesced(h, "a", reg)
    step(h, 2)
    h.service.remove(h.service.tenants.named("a"), "its lease ended", clean=True)
    assert not h.service.sleeper.copies.busy
    assert all(r["ok"] is False for r in replies_to(h, b"tenant") + replies_to(h, b"admin"))
    assert h.ok("status")["free_bytes"] == NUM_PAGES * PAGE_BYTES


def test_a_tenant_gone_mid_wake_gets_no_grant_and_its_pages_come_back(h: Harness) -> None:
    reg = holding(h, "a")
    quiesced(h, "a", reg)
    h.service.sleeper.copies.run_all()
    num_grants = len(h.leases.grants)
    assert send(h, b"admin", 30, "wake", name="a") is None
    step(h, 2)
    h.service.remove(h.service.tenants.named("a"), "its lease ended", clean=True)
    h.service.sleeper.copies.run_all()
    assert len(h.leases.grants) == num_grants
    assert replies_to(h, b"admin")[-1]["error"]["code"] == "CONFLICT"
    assert h.ok("status")["free_bytes"] == NUM_PAGES * PAGE_BYTES


def test_a_copy_failing_midway_leaves_the_tenant_as_it_was(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    reg = holding(h, "a")
    before = contents(h, "a")
    calls = []
    real = h.backend.copy_out_pages

    def fails_second(pages: list, dest: memoryview) -> None:
        calls.append(len(pages))
        if len(calls) == 2:
            raise OSError(errno.EIO, "Input/output error")
        real(pages, dest)

    monkeypatch.setattr(h.backend, "copy_out_pages", fails_second)
    sleep_id = quiesced(h, "a", reg)
    h.service.sleeper.copies.run_all()
    (tenant_reply,) = replies_to(h, b"tenant")
    assert tenant_reply["error"]["code"] == "BACKEND_ERROR" and "stays active" in tenant_reply["error"]["message"]
    row = h.ok("status")["tenants"][0]
    assert (row["state"], row["mapped_bytes"], row["sleep_pending"]) == ("active", 6 * PAGE_BYTES, None)
    assert contents(h, "a") == before
    retry = send(h, b"tenant", 7, "sleep_ready", **h.auth("a", reg["token"], sleep_id=sleep_id))
    assert retry is not None and retry["error"]["code"] == "CONFLICT"  # a retry after: maps back


def test_retried_sleep_readies_all_get_the_same_end_and_a_flood_keeps_its_latest(h: Harness) -> None:
    reg = holding(h, "a")
    sleep_id = quiesced(h, "a", reg)  # request 5 from b"tenant"
    args = h.auth("a", reg["token"], sleep_id=sleep_id)
    assert send(h, b"other", 6, "sleep_ready", **args) is None  # a retry from a new connection
    flood = [send(h, b"tenant", 100 + i, "sleep_ready", **args) for i in range(sleep_module.MAX_ANSWERS)]
    assert flood == [None] * sleep_module.MAX_ANSWERS  # never an answer before the end
    for i in range(sleep_module.MAX_ANSWERS + 2):  # many connections: the first callers' are kept
        assert send(h, f"c{i}".encode(), 300 + i, "sleep_ready", **args) is None
    h.service.sleeper.copies.run_all()
    answered = [decode(payload) for _, payload in h.replies if decode(payload)["id"] != 77]
    assert all(r["ok"] and r["result"]["state"] == "sleeping-warm" for r in answered)
    ids = {r["id"] for r in answered}  # a peer that sent again: its older calls gave their place
    assert 6 in ids and not ids & {5, *range(100, 100 + sleep_module.MAX_ANSWERS - 1)}
    assert len(ids) == sleep_module.MAX_ANSWERS  # all from the token holder: some of its own dropped


def test_a_wake_flood_answers_every_caller_past_the_bound_at_once(h: Harness) -> None:
    reg = holding(h, "a")
    quiesced(h, "a", reg)
    h.service.sleeper.copies.run_all()
    h.replies.clear()
    num_callers = sleep_module.MAX_ANSWERS + 3
    refused = [send(h, f"c{i}".encode(), 200 + i, "wake", name="a") for i in range(num_callers)]
    assert refused[: sleep_module.MAX_ANSWERS] == [None] * sleep_module.MAX_ANSWERS
    for reply in refused[sleep_module.MAX_ANSWERS :]:  # told at once, not left to time out
        assert reply is not None and reply["error"]["code"] == "CONFLICT" and "ask again" in reply["error"]["message"]
    assert send(h, b"c0", 250, "wake", name="a") is None  # a caller that asks again takes its own place
    h.service.sleeper.copies.run_all()
    answered = {decode(payload)["id"]: decode(payload) for _, payload in h.replies}
    assert all(r["ok"] and r["result"]["state"] == "active" for r in answered.values())
    assert set(answered) == {250, *range(201, 200 + sleep_module.MAX_ANSWERS)}


def test_a_wake_that_waited_for_pages_is_answered_when_its_copy_ends(h: Harness) -> None:
    reg, other = holding(h, "a"), h.register("b")
    quiesced(h, "a", reg)
    h.service.sleeper.copies.run_all()
    h.ok("grow", **h.auth("b", other["token"], logical_pages=list(range(6))))  # 12 of 16 pages: 4 free
    assert send(h, b"admin", 40, "wake", name="a") is None  # parked: b is asked to give pages back
    h.ok("shrink", **h.auth("b", other["token"], logical_pages=[4, 5]))
    h.tick(0.1)  # the parked wake is retried: its pages fit now
    assert replies_to(h, b"admin")[-1]["id"] != 40  # the copy back has started, not ended
    assert h.service.tenants.named("a").waking is not None
    h.service.sleeper.copies.run_all()
    assert replies_to(h, b"admin")[-1] == {"id": 40, "ok": True, "result": {
        "state": "active", "mapped_bytes": 6 * PAGE_BYTES}}


def test_a_grow_waiting_for_pages_gets_those_a_sleep_frees_when_its_copy_ends(h: Harness) -> None:
    reg, other = holding(h, "a"), h.register("b")
    quiesced(h, "a", reg)  # a's six pages go to host memory: 10 of 16 free meanwhile
    grow = send(h, b"b", 50, "grow", **h.auth("b", other["token"], logical_pages=list(range(6))))
    assert grow is None  # twelve pages: it waits for what a gives back
    while h.service.sleeper.copies.busy:
        step(h)
    (answer,) = replies_to(h, b"b")
    assert answer["id"] == 50 and answer["ok"] and len(answer["result"]["pages"]) == 6


def test_a_daemon_stopping_mid_copy_tells_each_caller_what_did_not_happen(h: Harness) -> None:
    reg, other = holding(h, "a"), holding(h, "b")
    quiesced(h, "a", reg)
    h.service.sleeper.copies.run_all()
    assert send(h, b"admin", 60, "wake", name="a") is None
    assert h.service.dispatch(b"admin", request(61, "sleep", {"name": "b", "mode": "warm"})) is None
    notice = h.leases.notices[-1][1]
    assert send(h, b"b", 62, "sleep_ready", **h.auth("b", other["token"], sleep_id=notice["args"]["sleep_id"])) is None
    step(h, 2)
    for tenant in list(h.service.tenants):
        h.service.forget_sleep(tenant, stopping=True)
    errors = {r["id"]: r.get("error") for r in replies_to(h, b"admin") + replies_to(h, b"b") if r["id"] >= 60}
    assert errors[60]["message"] == "the daemon stopped before the tenant woke"
    assert errors[61]["message"] == errors[62]["message"] == "the daemon stopped before the tenant slept"
    assert not h.service.sleeper.copies.busy


def test_a_tenant_whose_lease_ends_mid_wake_gets_no_quarantine_for_pages_it_never_had(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    reg = holding(h, "a")
    quiesced(h, "a", reg)
    h.service.sleeper.copies.run_all()
    assert send(h, b"admin", 70, "wake", name="a") is None
    step(h, 2)
    monkeypatch.setattr(h.service.quarantine, "started", lambda _pid: 123.0)  # its process lives on
    h.service.remove(h.service.tenants.named("a"), "its lease ended", clean=False)
    assert h.service.quarantine.held == [] and h.ok("status")["free_bytes"] == NUM_PAGES * PAGE_BYTES


def test_a_tenant_gone_mid_wake_is_logged_with_the_pages_and_the_warm_copy_it_gave_back(
    h: Harness, caplog: pytest.LogCaptureFixture,
) -> None:
    reg = holding(h, "a")
    quiesced(h, "a", reg)
    h.service.sleeper.copies.run_all()
    assert send(h, b"admin", 30, "wake", name="a") is None
    step(h, 2)  # its wake holds six pages being filled
    tenant = h.service.tenants.named("a")
    h.service.remove(tenant, "its handle channel closed", clean=False)  # killed mid-restore
    assert h.ok("status")["free_bytes"] == NUM_PAGES * PAGE_BYTES
    said = [r.getMessage() for r in caplog.records if "removed" in r.getMessage()]
    assert said == [f"tenant a (pid {tenant.pid}) removed: its handle channel closed; 6 physical page(s) "
                    "(12.0 MiB) back to the pool; its warm KV (12.0 MiB of host memory) dropped"]
