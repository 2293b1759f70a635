"""The daemon's ops, driven through ``Service.dispatch`` with raw msgpack bytes."""

from __future__ import annotations

import errno
import logging
import os
import random
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest

from kvdaemon.cuda_vmm import HostBackend
from kvdaemon.cuda_vmm.backend import MemInfo
from kvdaemon.errors import BackendError
from kvdaemon.daemon.config import DaemonConfig
from kvdaemon.daemon.policy_book import PolicyBook
from kvdaemon.daemon import limits
from kvdaemon.daemon import service as service_module
from kvdaemon.daemon import sleep as sleep_module
from kvdaemon.daemon.service import Service
from kvdaemon.wire.messages import LimitNotice
from kvdaemon.wire.protocol import MAX_INT, PROTOCOL_VERSION, Args, decode, encode, request

from tests.conftest import PAGE_BYTES, small_spec

NUM_PAGES = 16


class FakeLeases:
    """Records grants (closing their fds) in place of the server's handle channel."""

    def __init__(self) -> None:
        self.grants: list[tuple[int, int, list[int]]] = []
        self.dropped: list[int] = []
        self.notices: list[tuple[int, dict[str, Any]]] = []

    def send_grant(
        self, tenant_id: int, grant_id: int, page_ids: list[int], fds: list[int],
        fd_index: list[int],
    ) -> None:
        for fd in fds:
            os.close(fd)
        self.grants.append((tenant_id, grant_id, page_ids))

    def drop_lease(self, tenant_id: int) -> None:
        self.dropped.append(tenant_id)

    def send_notice(self, tenant_id: int, body: dict[str, Any]) -> None:
        self.notices.append((tenant_id, body))


class FakeClock:
    """The service's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


class Harness:
    """A service over a 16-page host pool and a fake clock, with helpers that speak raw bytes.

    Deferred replies land in ``replies`` as ``(routing id, payload)``.
    """

    def __init__(self, policies: PolicyBook | None = None, **config: Any) -> None:
        self.backend = HostBackend(num_pages=NUM_PAGES, page_size_bytes=PAGE_BYTES)
        self.backend.start()
        self.leases = FakeLeases()
        self.clock = FakeClock()
        self.replies: list[tuple[bytes, bytes]] = []
        self.service = Service(
            self.backend, self.leases, DaemonConfig(**config),
            sink=lambda rid, payload: self.replies.append((rid, payload)), clock=self.clock,
            policies=policies,
        )
        self._next_id = 0

    def tick(self, seconds: float) -> None:
        """Move the clock and run the service's timers."""
        self.service.tick(self.clock.advance(seconds))
        self.service.check_invariants()

    def raw(self, payload: bytes, routing_id: bytes = b"c1") -> dict[str, Any]:
        reply = decode(self.service.dispatch(routing_id, payload))
        self.service.check_invariants()
        return reply

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        self._next_id += 1
        reply = self.raw(request(self._next_id, op, args))
        assert reply["id"] == self._next_id
        return reply

    def ok(self, op: str, **args: Any) -> Any:
        reply = self.call(op, **args)
        assert reply["ok"], reply
        return reply["result"]

    def error(self, op: str, **args: Any) -> str:
        reply = self.call(op, **args)
        assert reply["ok"] is False, reply
        return reply["error"]["code"]

    def register(self, name: str = "a", leased: bool = True, **extra: Any) -> dict[str, Any]:
        args = {"name": name, "spec": small_spec().to_wire(), "num_virtual_pages": 8, **extra}
        result = self.ok("register", **args)
        if leased:
            self.service.attach(name, result["token"], pid=1234)
        return result

    def auth(self, name: str, token: str, **extra: Any) -> dict[str, Any]:
        return {"tenant": name, "token": token, **extra}


@pytest.fixture
def h() -> Iterator[Harness]:
    harness = Harness()
    yield harness
    harness.backend.close()


def test_hello_checks_the_protocol_version(h: Harness) -> None:
    info = h.ok("hello", version=PROTOCOL_VERSION)
    assert info["backend"] == "host" and info["capacity_bytes"] == NUM_PAGES * PAGE_BYTES
    assert h.error("hello", version=PROTOCOL_VERSION + 1) == "VERSION_MISMATCH"


def test_grow_and_shrink_logical_pages(h: Harness) -> None:
    reg = h.register()
    grant = h.ok("grow", **h.auth("a", reg["token"], logical_pages=[0, 3]))
    assert [lp for lp, _ in grant["pages"]] == [0, 3]
    assert all(len(ids) == 2 for _, ids in grant["pages"])  # one page per segment
    status = h.ok("status")
    assert status["tenants"][0]["mapped_bytes"] == 4 * PAGE_BYTES
    assert status["free_bytes"] == (NUM_PAGES - 4) * PAGE_BYTES
    assert h.ok("shrink", **h.auth("a", reg["token"], logical_pages=[3]))["num_released"] == 1
    assert h.ok("status")["free_bytes"] == (NUM_PAGES - 2) * PAGE_BYTES


def test_grow_over_limit_and_out_of_memory_change_nothing(h: Harness) -> None:
    # a's guarantee covers all it may hold, so reclaim cannot help b: NO_MEMORY at once
    a = h.register("a", max_bytes=4 * PAGE_BYTES, min_bytes=4 * PAGE_BYTES)
    b = h.register("b")
    assert h.error("grow", **h.auth("a", a["token"], logical_pages=[0, 1, 2])) == "OVER_LIMIT"
    h.ok("grow", **h.auth("a", a["token"], logical_pages=[0, 1]))
    h.ok("grow", **h.auth("b", b["token"], logical_pages=[0, 1, 2, 3, 4]))
    before = h.ok("status")
    assert h.error("grow", **h.auth("b", b["token"], logical_pages=[5, 6])) == "NO_MEMORY"
    after = h.ok("status")
    assert after["free_bytes"] == before["free_bytes"] == 2 * PAGE_BYTES


def test_names_tokens_and_ownership(h: Harness) -> None:
    a = h.register("a")
    b = h.register("b")
    assert h.error("register", name="a", spec=small_spec().to_wire(), num_virtual_pages=1) == "CONFLICT"
    assert h.error("grow", **h.auth("a", b["token"], logical_pages=[0])) == "FORBIDDEN"
    assert h.error("grow", **h.auth("zed", a["token"], logical_pages=[0])) == "UNKNOWN_TENANT"
    h.ok("grow", **h.auth("b", b["token"], logical_pages=[0]))
    assert h.error("shrink", **h.auth("a", a["token"], logical_pages=[0])) == "BAD_REQUEST"
    assert h.error("shrink", **h.auth("a", b["token"], logical_pages=[0])) == "FORBIDDEN"
    assert h.error("grow", **h.auth("b", b["token"], logical_pages=[0])) == "BAD_REQUEST"


def test_grow_needs_an_attached_lease(h: Harness) -> None:
    reg = h.register("a", leased=False)
    assert h.error("grow", **h.auth("a", reg["token"], logical_pages=[0])) == "CONFLICT"


def test_unregister_frees_everything(h: Harness) -> None:
    reg = h.register("a")
    h.ok("grow", **h.auth("a", reg["token"], logical_pages=[0, 1]))
    assert h.ok("unregister", **h.auth("a", reg["token"]))["num_released"] == 4
    assert h.ok("status") == {**h.ok("status"), "free_bytes": NUM_PAGES * PAGE_BYTES, "tenants": []}
    assert h.leases.dropped == [reg["tenant_id"]]


def test_min_bytes_guarantees_must_fit(h: Harness) -> None:
    h.register("a", min_bytes=12 * PAGE_BYTES)
    code = h.error(
        "register", name="b", spec=small_spec().to_wire(), num_virtual_pages=4,
        min_bytes=8 * PAGE_BYTES,
    )
    assert code == "NO_MEMORY"
    assert h.error("set_limit", name="a", min_bytes=8 * PAGE_BYTES, max_bytes=PAGE_BYTES) == "BAD_REQUEST"


def test_set_limit_revisions(h: Harness) -> None:
    reg = h.register("a")
    assert h.ok("set_limit", name="a", max_bytes=8 * PAGE_BYTES, revision=5)["revision"] == 5
    # the same revision with the same values: applied again, nothing changes
    again = h.ok("set_limit", name="a", max_bytes=8 * PAGE_BYTES, revision=5)
    assert {k: again[k] for k in ("result", "revision", "changed")} == {
        "result": "applied", "revision": 5, "changed": False,
    }  # fmt: skip
    assert h.error("set_limit", name="a", max_bytes=4 * PAGE_BYTES, revision=5) == "CONFLICT"
    assert h.error("set_limit", name="a", max_bytes=2 * PAGE_BYTES, revision=4) == "STALE"
    assert h.ok("status")["tenants"][0]["max_bytes"] == 8 * PAGE_BYTES
    # without a revision: the next one
    assert h.ok("set_limit", name="a", weight=2.5)["revision"] == 6
    row = h.ok("status")["tenants"][0]
    assert (row["max_bytes"], row["weight"]) == (8 * PAGE_BYTES, 2.5)
    # the new limit binds grows at once
    assert h.error("grow", **h.auth("a", reg["token"], logical_pages=[0, 1, 2, 3, 4])) == "OVER_LIMIT"
    assert h.error("set_limit", name="nobody", max_bytes=1, token="x" * 32) == "UNKNOWN_TENANT"
    # each applied change told the tenant its limits; the idempotent replay did not
    assert [n["args"]["revision"] for _, n in h.leases.notices if n["notice"] == "limit"] == [5, 6]


def test_a_limit_that_changes_nothing_spends_no_revision(h: Harness) -> None:
    h.register("a")
    assert h.ok("set_limit", name="a", max_bytes=8 * PAGE_BYTES)["revision"] == 1
    again = h.ok("set_limit", name="a", max_bytes=8 * PAGE_BYTES)
    assert (again["revision"], again["changed"]) == (1, False)
    assert h.ok("set_limit", name="a", max="none")["changed"] is True  # the tenant's own max again
    assert h.ok("set_limit", name="a", max="none")["revision"] == 2
    assert [n["args"]["revision"] for _, n in h.leases.notices if n["notice"] == "limit"] == [1, 2]


def test_a_limit_revision_always_has_a_next_on_the_wire(h: Harness) -> None:
    reg = h.register("a")
    last = limits.MAX_REVISION
    for wrong in (last + 1, MAX_INT):
        assert h.error("set_limit", name="a", max_bytes=8 * PAGE_BYTES, revision=wrong) == "BAD_REQUEST"
    for jump in (2, last):  # a tenant's own change may not jump: it would shut the operator out
        assert h.error("set_limit", name="a", token=reg["token"], max_bytes=8 * PAGE_BYTES,
                       revision=jump) == "BAD_REQUEST"
    assert h.ok("set_limit", name="a", token=reg["token"], max_bytes=8 * PAGE_BYTES, revision=1)["revision"] == 1
    assert h.ok("set_limit", name="a", token=reg["token"], max_bytes=8 * PAGE_BYTES, revision=1)["changed"] is False
    assert h.ok("set_limit", name="a", max_bytes=8 * PAGE_BYTES, revision=last)["revision"] == last
    assert h.error("set_limit", name="a", max_bytes=4 * PAGE_BYTES) == "BAD_REQUEST"  # no next one
    assert h.ok("status")["tenants"][0]["max_bytes"] == 8 * PAGE_BYTES  # nothing changed
    notices = [n["args"] for _, n in h.leases.notices if n["notice"] == "limit"]
    assert [LimitNotice.parse(Args(n)).revision for n in notices] == [1, last]  # every notice parses


def test_lowering_a_limit_below_mapped_tells_the_limit_once(h: Harness) -> None:
    """The limit notice is the whole ask: the pool pays what it holds past it (an ask for the
    excess besides, served on another wake-up, had it give back a page twice)."""
    reg = h.register("a")
    h.ok("grow", **h.auth("a", reg["token"], logical_pages=[0, 1, 2]))  # 6 pages
    h.ok("set_limit", name="a", max_bytes=3 * PAGE_BYTES)
    tenant_id, notice = h.leases.notices[-1]
    assert (tenant_id, notice["notice"], notice["args"]["max_bytes"]) == (reg["tenant_id"], "limit", 3 * PAGE_BYTES)
    assert [n for _, n in h.leases.notices if n["notice"] == "reclaim"] == []
    assert h.error("set_limit", name="a") == "BAD_REQUEST"


GARBAGE: list[bytes] = [
    b"",
    b"\xc1",  # never-used msgpack byte
    b"\x92\x01\x02",  # an array, not a map
    encode("hello"),
    encode({"id": 1}),
    encode({"id": 1, "op": 5}),
    encode({"id": "x", "op": "status", "args": []}),
    encode({"id": "x", "op": "set_limit", "args": {"name": "a", "max_bytes": 4 * PAGE_BYTES}}),
    encode({"id": True, "op": "set_limit", "args": {"name": "b", "weight": 2.0}}),
    b"\x91" * 100_000 + b"\x90",
    encode({"id": 1, "op": "nope", "args": {}}),
    encode({"id": 1, "op": "register", "args": {"name": 5}}),
    encode({"id": 1, "op": "register", "args": {"name": "a", "spec": "big"}}),
    encode({"id": 1, "op": "register", "args": {"name": "../etc", "spec": {}}}),
    encode({"id": 1, "op": "hello", "args": {"version": True}}),
    encode({"id": 1, "op": "set_limit", "args": {"name": "a", "max_bytes": -1}}),
    encode({"id": 1, "op": "set_limit", "args": {"name": "a", "weight": float("nan")}}),
    encode({1: 2}),
    msgpack.packb({"id": 1, "op": "status", "args": {"x": "y" * 5000}}),
    msgpack.packb({"id": 1, "op": "status", "args": {"x": list(range(100000))}}),
]


@pytest.mark.parametrize("payload", GARBAGE)
def test_garbage_gets_an_error_and_changes_nothing(h: Harness, payload: bytes) -> None:
    reg = h.register("a")
    h.ok("grow", **h.auth("a", reg["token"], logical_pages=[0]))
    before = h.ok("status")
    reply = h.raw(payload)
    assert reply["ok"] is False
    assert reply["error"]["code"] in {"BAD_REQUEST", "UNKNOWN_OP", "UNKNOWN_TENANT"}
    after = h.ok("status")
    for row in before["tenants"] + after["tenants"]:
        row.pop("idle_seconds")
    for whole in (before, after):
        whole.pop("device_free_bytes")  # the machine's RAM available: not the daemon's to keep
    assert after == before


@pytest.mark.parametrize(
    "payload, message",
    [
        (encode({"id": "x", "op": "status", "args": {}}), "field 'id' must be an integer, got str"),
        (encode({"op": "status", "args": {}}), "field 'id' must be an integer, got NoneType"),
        (b"\x91" * 100_000 + b"\x90", "undecodable message: nested too deeply"),
        (b"\xc1", "undecodable message: FormatError"),  # msgpack's own message is empty
    ],
)
def test_a_request_without_an_integer_id_is_refused_with_its_reason(h: Harness, payload: bytes, message: str) -> None:
    reply = h.raw(payload)
    assert reply == {"id": None, "ok": False, "error": {"code": "BAD_REQUEST", "message": message}}


@pytest.mark.parametrize(
    "pages, code",
    [
        ([-1], "BAD_REQUEST"),
        ([8], "BAD_REQUEST"),  # past the tenant's virtual pages
        ([2**64 - 1], "BAD_REQUEST"),
        ([1, 1], "BAD_REQUEST"),
        ("0", "BAD_REQUEST"),
        ([True], "BAD_REQUEST"),
        (list(range(70000)), "BAD_REQUEST"),
    ],
)
def test_bad_page_lists(h: Harness, pages: object, code: str) -> None:
    reg = h.register("a")
    reply = h.raw(encode({"id": 9, "op": "grow", "args": h.auth("a", reg["token"], logical_pages=pages)}))
    assert reply["ok"] is False and reply["error"]["code"] == code
    assert h.ok("status")["free_bytes"] == NUM_PAGES * PAGE_BYTES


def test_random_bytes_never_break_the_service(h: Harness) -> None:
    rng = random.Random(1234)
    reg = h.register("a")
    for _ in range(500):
        payload = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        assert h.raw(payload)["ok"] is False
    h.ok("grow", **h.auth("a", reg["token"], logical_pages=[0]))


def test_a_non_ascii_token_is_forbidden_not_a_crash(h: Harness) -> None:
    h.register("a")
    assert h.error("grow", **h.auth("a", "é" * 8, logical_pages=[0])) == "FORBIDDEN"


def test_max_bytes_is_clamped_to_capacity(h: Harness) -> None:
    h.register("a", max_bytes=2**62)
    assert h.ok("status")["tenants"][0]["max_bytes"] == NUM_PAGES * PAGE_BYTES


def test_huge_grow_is_refused_before_any_work(h: Harness) -> None:
    reg = h.ok("register", name="big", spec=small_spec().to_wire(), num_virtual_pages=1 << 16)
    h.service.attach("big", reg["token"], pid=1)
    reply = h.call("grow", **h.auth("big", reg["token"], logical_pages=list(range(60000))))
    assert reply["error"] == {"code": "BAD_REQUEST",  # refused at the list's header
                              "message": "undecodable message: 60000 exceeds max_array_len(8192)"}
    reply = h.call("grow", **h.auth("big", reg["token"], logical_pages=list(range(5000))))
    assert reply["error"] == {"code": "BAD_REQUEST",  # more than any client names at once
                              "message": "field 'logical_pages' has 5000 items, more than 4096"}
    code = h.error("grow", **h.auth("big", reg["token"], logical_pages=list(range(3000))))
    assert code == "OVER_LIMIT"  # refused by arithmetic, before any page or owner is built


def test_a_spec_that_could_never_hold_a_page_is_refused_at_registration(h: Harness) -> None:
    big = small_spec(num_layers=2048).to_wire()  # 4096 segments: one logical page is 8 GiB
    reply = h.call("register", name="big", spec=big, num_virtual_pages=1)
    assert reply["error"]["code"] == "BAD_REQUEST"
    assert "more than the 33554432 bytes it could ever hold here: use fewer layers" in reply["error"]["message"]
    small = small_spec().to_wire()  # 2 segments: 4 MiB a logical page, above its own limit
    reply = h.call("register", name="tiny", spec=small, num_virtual_pages=1, max_bytes=PAGE_BYTES)
    assert reply["error"] == {"code": "BAD_REQUEST", "message": (
        f"one logical page of this spec takes {2 * PAGE_BYTES} bytes (2 segments of a {PAGE_BYTES}-byte page), "
        f"more than its max_bytes of {PAGE_BYTES}: it could never map a block; raise its limit")}
    assert h.ok("status")["tenants"] == []


def start_sleep(h: Harness, name: str, mode: str = "warm") -> int:
    """Ask ``name`` to sleep; the reply is deferred. Returns the sleep id the tenant was told."""
    assert h.service.dispatch(b"admin", request(77, "sleep", {"name": name, "mode": mode})) is None
    tenant_id, notice = h.leases.notices[-1]
    assert tenant_id == h.service.tenants.named(name).tenant_id and notice["notice"] == "sleep"
    return notice["args"]["sleep_id"]


def deferred(h: Harness) -> dict[str, Any]:
    routing_id, payload = h.replies.pop()
    assert routing_id == b"admin"
    return decode(payload)


def test_sleep_waits_for_the_tenant_then_frees_its_pages(h: Harness) -> None:
    reg = h.register("a")
    h.ok("grow", **h.auth("a", reg["token"], logical_pages=[0, 1]))
    sleep_id = start_sleep(h, "a")
    assert h.replies == []  # nothing answered before the tenant quiesced
    assert h.error("grow", **h.auth("a", reg["token"], logical_pages=[2])) == "ASLEEP"
    assert h.error("sleep_ready", **h.auth("a", reg["token"], sleep_id=sleep_id + 1)) == "CONFLICT"
    done = h.ok("sleep_ready", **h.auth("a", reg["token"], sleep_id=sleep_id))
    assert done["state"] == "sleeping-warm" and done["host_bytes"] == 4 * PAGE_BYTES
    reply = deferred(h)
    assert reply["id"] == 77 and reply["ok"] and reply["result"] == done
    status = h.ok("status")
    assert status["free_bytes"] == NUM_PAGES * PAGE_BYTES
    assert status["tenants"][0]["host_bytes"] == 4 * PAGE_BYTES
    assert h.ok("wake", name="a")["mapped_bytes"] == 4 * PAGE_BYTES
    assert h.leases.notices[-1][1]["notice"] == "wake"


def test_a_warm_sleep_that_cannot_copy_to_host_memory_fails_and_frees_nothing(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    reg = h.register("a")
    h.ok("grow", **h.auth("a", reg["token"], logical_pages=[0, 1]))
    sleep_id = start_sleep(h, "a", "warm")

    def no_memory(*_args: object) -> None:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(h.backend, "copy_out_pages", no_memory)
    assert h.error("sleep_ready", **h.auth("a", reg["token"], sleep_id=sleep_id)) == "BACKEND_ERROR"
    failed = deferred(h)["error"]  # the admin's sleep is answered too, with why
    assert failed["code"] == "BACKEND_ERROR" and "stays active" in failed["message"]
    row = h.ok("status")["tenants"][0]
    assert (row["state"], row["mapped_bytes"], row["sleep_pending"]) == ("active", 4 * PAGE_BYTES, None)
    assert h.error("sleep_ready", **h.auth("a", reg["token"], sleep_id=sleep_id)) == "CONFLICT"  # a retry: maps back


def test_a_sleep_that_times_out_is_cancelled_and_frees_nothing(h: Harness) -> None:
    reg = h.register("a")
    h.ok("grow", **h.auth("a", reg["token"], logical_pages=[0]))
    sleep_id = start_sleep(h, "a", "cold")
    h.tick(9.9)
    assert h.replies == []  # still within the quiesce deadline
    h.tick(0.2)
    assert deferred(h)["error"]["code"] == "CONFLICT"
    assert h.leases.notices[-1][1] == {"notice": "sleep_cancelled", "args": {"sleep_id": sleep_id}}
    assert h.error("sleep_ready", **h.auth("a", reg["token"], sleep_id=sleep_id)) == "CONFLICT"
    row = h.ok("status")["tenants"][0]
    assert (row["state"], row["mapped_bytes"]) == ("active", 2 * PAGE_BYTES)


def test_a_wake_cancels_a_pending_sleep_and_frees_nothing(h: Harness) -> None:
    reg = h.register("a")
    h.ok("grow", **h.auth("a", reg["token"], logical_pages=[0]))
    sleep_id = start_sleep(h, "a", "warm")
    assert h.ok("status")["tenants"][0]["sleep_pending"] == "warm"
    assert h.ok("wake", name="a") == {"state": "active", "mapped_bytes": 2 * PAGE_BYTES, "cancelled_sleep": True}
    failed = deferred(h)["error"]
    assert failed["code"] == "CONFLICT" and "sleep cancelled, woken by an admin before it slept" in failed["message"]
    assert h.leases.notices[-1][1] == {"notice": "sleep_cancelled", "args": {"sleep_id": sleep_id}}
    assert h.error("sleep_ready", **h.auth("a", reg["token"], sleep_id=sleep_id)) == "CONFLICT"  # maps back
    row = h.ok("status")["tenants"][0]
    assert (row["state"], row["mapped_bytes"], row["sleep_pending"]) == ("active", 2 * PAGE_BYTES, None)
    assert h.ok("wake", name="a")["already"] is True


def test_a_tenant_leaving_mid_sleep_answers_the_caller(h: Harness) -> None:
    reg = h.register("a")
    start_sleep(h, "a")
    h.ok("unregister", **h.auth("a", reg["token"]))
    assert deferred(h)["ok"] is False


def test_a_request_refused_as_a_whole_is_answered_under_its_id(h: Harness) -> None:
    """A string past the decoder's limit (a 5000-character name) still gets its error reply
    under the request's id, so the sender is answered rather than left to time out."""
    reply = h.raw(request(31, "register", {"name": "x" * 5000, "spec": {}}))
    assert (reply["id"], reply["ok"], reply["error"]["code"]) == (31, False, "BAD_REQUEST")


def register_unattached(h: Harness, conn: bytes, name: str) -> dict[str, Any]:
    """Register ``name`` on control connection ``conn`` a millisecond after the last; not attached."""
    h.clock.advance(0.001)
    args = {"name": name, "spec": small_spec().to_wire(), "num_virtual_pages": 8}
    h._next_id += 1
    reply = h.raw(request(h._next_id, "register", args), routing_id=conn)
    assert reply["ok"], reply
    return reply["result"]


def test_registrations_never_attached_cannot_keep_a_new_tenant_out(
    h: Harness, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(service_module, "MAX_UNATTACHED_PER_CONN", 4)
    monkeypatch.setattr(service_module, "MAX_UNATTACHED", 6)

    honest = register_unattached(h, b"honest", "honest")  # registered; its attach follows
    for i in range(10):  # one connection's flood drops its own oldest
        register_unattached(h, b"flood", f"sq{i}")
    assert [t.name for t in h.service.tenants] == ["honest", "sq6", "sq7", "sq8", "sq9"]
    for i in range(10):  # a second connection: past 6 in all, the connection holding most loses its oldest
        register_unattached(h, b"flood2", f"sr{i}")
    names = [t.name for t in h.service.tenants]
    assert "honest" in names and len(names) == 6, names
    h.service.attach("honest", honest["token"], pid=1234)  # the honest tenant was never dropped
    assert h.ok("status")["counters"]["never_attached"] == 15  # 20 registered by the floods, 5 of them left
    evicted = [r.getMessage() for r in caplog.records if "evicted" in r.getMessage()]
    assert evicted == ["tenant sq0 (pid 0) removed: evicted: 4 tenants it registered on one connection were "
                       "waiting to attach (5 in all)"]  # one line a while
    registered = [r.getMessage() for r in caplog.records if " registered" in r.getMessage()]
    assert len(registered) < 20  # the flood's registrations are one line a while too


def test_a_flood_from_many_connections_drops_its_own_registrations(
    h: Harness, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each flooding connection holds one registration waiting at a time, as an honest one does in
    the milliseconds before it attaches: the tie went to the oldest waiting, the honest one's."""
    monkeypatch.setattr(service_module, "MAX_UNATTACHED", 6)

    for i in range(12):  # ten connections start a flood: the first two registrations are dropped
        register_unattached(h, b"flood%d" % (i % 10), f"warm{i}")
    for round_no in range(3):
        honest = register_unattached(h, b"honest%d" % round_no, f"honest{round_no}")  # its attach follows ...
        for i in range(20):  # ... after twenty more registrations of the flood
            register_unattached(h, b"flood%d" % (i % 10), f"f{round_no}-{i}")
        assert f"honest{round_no}" in h.service.tenants, "the honest registration was dropped"
        h.service.attach(f"honest{round_no}", honest["token"], pid=1234)
    assert h.ok("status")["counters"]["never_attached"] == 72 - 5  # the flood's, but the 5 still waiting


def test_the_daemon_holds_at_most_max_tenants(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service_module, "MAX_TENANTS", 3)
    for name in ("a", "b", "c"):
        h.register(name)
    reply = h.call("register", name="d", spec=small_spec().to_wire(), num_virtual_pages=8)
    assert reply["error"]["code"] == "CONFLICT"
    assert reply["error"]["message"] == "the daemon holds its most tenants, 3; unregister one first"
    assert "d" not in h.service.tenants
    h.ok("unregister", **h.auth("a", h.service.tenants.find("a").token))
    h.register("d")


def test_silent_seconds_count_from_a_tenants_last_request_with_its_token(h: Harness) -> None:
    reg = h.register("a")
    h.clock.advance(30)
    assert h.ok("status")["tenants"][0]["silent_seconds"] == 30
    h.error("heartbeat", **h.auth("a", "0" * 32))  # a wrong token is not the tenant speaking
    assert h.ok("status")["tenants"][0]["silent_seconds"] == 30
    h.ok("heartbeat", **h.auth("a", reg["token"]))
    h.clock.advance(2)
    assert h.ok("status")["tenants"][0]["silent_seconds"] == 2


def test_status_shows_no_more_in_use_than_mapped(h: Harness) -> None:
    """The used bytes come from the tenant's last heartbeat, which lags a shrink or a sleep."""
    reg = h.register("a")
    h.ok("grow", **h.auth("a", reg["token"], logical_pages=[0, 1]))
    h.ok("heartbeat", **h.auth("a", reg["token"], used_bytes=3 * PAGE_BYTES))
    assert h.ok("status")["tenants"][0]["used_bytes"] == 3 * PAGE_BYTES
    h.ok("shrink", **h.auth("a", reg["token"], logical_pages=[1]))
    assert h.ok("status")["tenants"][0]["used_bytes"] == 2 * PAGE_BYTES  # one logical page: 2 segments


def test_status_says_what_the_device_itself_has_free(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness()
    monkeypatch.setattr(h.backend, "mem_info", lambda: MemInfo(free_bytes=3 * PAGE_BYTES, total_bytes=1 << 40))
    assert h.service.status()["device_free_bytes"] == 3 * PAGE_BYTES

    def broken() -> MemInfo:
        raise BackendError("cuMemGetInfo failed", "CUDA_ERROR_UNKNOWN")

    monkeypatch.setattr(h.backend, "mem_info", broken)
    assert h.service.status()["device_free_bytes"] is None  # unknown, and status still answers


def test_a_refused_registration_is_logged_once_per_code_a_while(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvdaemon")
    h.register("a", min_bytes=10 * PAGE_BYTES)
    spec = small_spec().to_wire()
    for _ in range(3):  # the same refusal again and again: one line, the rest counted
        assert h.error("register", name="a", spec=spec, num_virtual_pages=8) == "CONFLICT"
    guaranteed = 10 * PAGE_BYTES  # with a's, more than the 16 pages
    assert h.error("register", name="b", spec=spec, num_virtual_pages=8, min_bytes=guaranteed) == "NO_MEMORY"
    lines = [r.getMessage() for r in caplog.records if "registration of tenant" in r.getMessage()]
    assert lines == [
        "registration of tenant 'a' refused (CONFLICT): a tenant named 'a' is already registered",
        lines[1],
    ]
    assert lines[1].startswith("registration of tenant 'b' refused (NO_MEMORY): ")


def test_a_pool_built_on_other_pages_is_refused_at_registration(h: Harness) -> None:
    spec = small_spec().to_wire()
    reply = h.call("register", name="a", spec=spec, num_virtual_pages=8, page_size=PAGE_BYTES // 2)
    assert reply["error"]["code"] == "CONFLICT"
    assert f"restart the daemon with --page-size {PAGE_BYTES // 2}" in reply["error"]["message"]
    assert h.ok("status")["tenants"] == []
    h.ok("register", name="a", spec=spec, num_virtual_pages=8, page_size=PAGE_BYTES)  # its own: welcome
