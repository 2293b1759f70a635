"""Abuse of the handle channel (AF_UNIX) and the control channel (ZeroMQ).

Every case ends with proof that the daemon still serves: a fresh lease
registers, attaches, grows and shows up in ``status``, the invariants hold, and
no file descriptor the abuse made the daemon open is left behind.
"""

from __future__ import annotations

import os
import random
import select
import socket
from collections.abc import Callable, Iterator
from contextlib import closing
from typing import Any

import msgpack
import pytest
import zmq

from kvdaemon.client import KVClient
from kvdaemon.daemon import lease_table
from kvdaemon.wire.handles import recv_frame
from kvdaemon.wire.protocol import MAX_MESSAGE_BYTES, decode, encode, request

from tests.conftest import PAGE_BYTES, RunningDaemon, running_daemon, small_spec, wait_until

IO_TIMEOUT_S = 2.0
SEGMENTS = small_spec().num_segments


# -- helpers ---------------------------------------------------------------------------


def open_fds() -> set[int]:
    """File descriptors open in this process, which also runs the daemon."""
    listed = {int(fd) for fd in os.listdir("/proc/self/fd")}
    return {fd for fd in listed if _is_open(fd)}  # drops the listing's own directory fd


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def describe_fds(fds: set[int]) -> list[str]:
    described = []
    for fd in sorted(fds):
        try:
            described.append(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except FileNotFoundError:
            described.append(f"{fd} (closed meanwhile)")
    return described


@pytest.fixture
def kvd(request: pytest.FixtureRequest) -> Iterator[RunningDaemon]:
    """A daemon that has closed, by the end of the test, every fd opened during it.

    Fds other tests left to the garbage collector may close meanwhile; only new
    ones count. ``indirect`` parametrization passes config fields.
    """
    with running_daemon(**getattr(request, "param", {})) as running:
        assert_daemon_serves(running)  # warm up: the first client opens lasting fds
        baseline = open_fds()
        yield running
        try:
            wait_until(lambda: open_fds() <= baseline)
        except AssertionError:
            pytest.fail(f"fds left open: {describe_fds(open_fds() - baseline)}")


@pytest.fixture
def client(kvd: RunningDaemon) -> Iterator[KVClient]:
    with closing(kvd.client()) as control:
        yield control


def rows(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in status["tenants"]}


def assert_daemon_serves(running: RunningDaemon, name: str = "probe") -> None:
    """A fresh lease registers, attaches and grows; then everything goes back."""
    with closing(running.client()) as control:
        lease = control.lease(name, small_spec(), num_virtual_pages=2)
        try:
            granted = lease.grow([0])
            assert list(granted) == [0] and len(granted[0]) == SEGMENTS
            assert rows(control.status())[name]["mapped_bytes"] == SEGMENTS * PAGE_BYTES
            running.check_invariants()
        finally:
            lease.close()
            control.backend().close()
        assert name not in rows(control.status())
    running.check_invariants()


def register(client: KVClient, name: str) -> str:
    """Register ``name`` without attaching; return its token."""
    args = {"name": name, "spec": small_spec().to_wire(), "num_virtual_pages": 4}
    return client.call("register", args)["token"]


def connect(running: RunningDaemon) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(IO_TIMEOUT_S)
    sock.connect(str(running.daemon.paths.handle_socket))
    return sock


def attach_frame(name: str, token: str) -> bytes:
    return encode({"tenant": name, "token": token})


def attach(running: RunningDaemon, name: str, token: str) -> socket.socket:
    sock = connect(running)
    sock.send(attach_frame(name, token))
    body, fds = recv_frame(sock)
    assert body["ok"] is True and fds == [], body
    return sock


def assert_eof(sock: socket.socket) -> None:
    """The daemon closed its end (reset, if our last frames were still unread there)."""
    with pytest.raises(ConnectionError):
        recv_frame(sock)


def refusal(sock: socket.socket) -> str:
    """Read an error reply and the close that follows it; return the error code."""
    body, fds = recv_frame(sock)
    assert fds == [] and body["ok"] is False, body
    assert_eof(sock)
    return body["error"]["code"]


def assert_closed_elsewhere(read_end: int) -> None:
    """Every copy of the pipe's write end is closed: its read end reaches EOF."""
    readable, _, _ = select.select([read_end], [], [], IO_TIMEOUT_S)
    assert readable, "a copy of the write end is still open in the daemon"
    assert os.read(read_end, 1) == b""


def drain_grant(sock: socket.socket, num_pages: int) -> None:
    """Receive a grant's frames on a raw handle socket and close its fds."""
    received = 0
    while received < num_pages:
        body, fds = recv_frame(sock)
        for fd in fds:
            os.close(fd)
        assert fds and len(body["fd_index"]) == len(body["page_ids"]) > 0, body
        assert all(0 <= i < len(fds) for i in body["fd_index"]), body
        received += len(body["page_ids"])
    assert received == num_pages


# -- handle channel --------------------------------------------------------------------

GARBAGE: list[tuple[str, bytes, str | None]] = [  # each told why, then closed
    ("random bytes", random.Random(7).randbytes(200), "BAD_REQUEST"),
    ("undecodable byte", b"\xc1", "BAD_REQUEST"),
    ("msgpack array", encode([1, 2, 3]), "BAD_REQUEST"),
    ("string over the length bound", msgpack.packb({"tenant": "a" * 5000, "token": "x"}), "BAD_REQUEST"),
    ("frame over 64 KiB, truncated", b"\x00" * (100 * 1024), "BAD_REQUEST"),
    ("attach with wrong types", encode({"tenant": 5, "token": ["x"]}), "BAD_REQUEST"),
    ("attach without fields", encode({}), "BAD_REQUEST"),
]


@pytest.mark.parametrize("payload, code", [g[1:] for g in GARBAGE], ids=[g[0] for g in GARBAGE])
def test_handle_garbage_is_refused_and_the_daemon_serves(
    kvd: RunningDaemon, payload: bytes, code: str | None
) -> None:
    with closing(connect(kvd)) as sock:
        sock.send(payload)
        if code is None:
            assert_eof(sock)
        else:
            assert refusal(sock) == code
    assert_daemon_serves(kvd)


def test_attach_with_wrong_token_or_unknown_tenant_is_refused(
    kvd: RunningDaemon, client: KVClient
) -> None:
    token = register(client, "a")
    other = register(client, "b")
    for name, bad_token, code in [
        ("a", "0" * 32, "FORBIDDEN"),
        ("a", other, "FORBIDDEN"),
        ("nobody", token, "UNKNOWN_TENANT"),
    ]:
        with closing(connect(kvd)) as sock:
            sock.send(attach_frame(name, bad_token))
            assert refusal(sock) == code
    # the refusals did not spoil the tenant: its own token still attaches it
    with closing(attach(kvd, "a", token)):
        client.call("grow", {"tenant": "a", "token": token, "logical_pages": [0]})
        kvd.check_invariants()
    wait_until(lambda: "a" not in rows(client.status()))
    client.call("unregister", {"tenant": "b", "token": other})
    assert_daemon_serves(kvd)


def test_peers_that_connect_and_leave_without_a_word(kvd: RunningDaemon) -> None:
    for _ in range(20):
        connect(kvd).close()
    with closing(connect(kvd)) as sock:
        sock.shutdown(socket.SHUT_WR)  # half-closed: the daemon reads EOF and closes
        assert_eof(sock)
    assert_daemon_serves(kvd)


def test_second_attach_to_a_tenant_conflicts(kvd: RunningDaemon, client: KVClient) -> None:
    token = register(client, "a")
    with closing(attach(kvd, "a", token)) as first:
        with closing(connect(kvd)) as second:
            second.send(attach_frame("a", token))
            assert refusal(second) == "CONFLICT"
        # the first channel still carries the lease: a grant arrives on it
        client.call("grow", {"tenant": "a", "token": token, "logical_pages": [0, 1]})
        drain_grant(first, 2 * SEGMENTS)
        assert rows(client.status())["a"]["mapped_bytes"] == 2 * SEGMENTS * PAGE_BYTES
        kvd.check_invariants()
    wait_until(lambda: "a" not in rows(client.status()))
    assert_daemon_serves(kvd)


@pytest.fixture
def fds_delivered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon lets fds arrive, as on kernels without SO_PASSRIGHTS (before Linux 6.16)."""
    monkeypatch.setattr(lease_table, "refuse_fds", lambda listener: False)


def send_with_pipe(sock: socket.socket, payload: bytes, copies: int = 1) -> int:
    """Send ``payload`` with ``copies`` of a pipe's write end; keep only the read end."""
    read_end, write_end = os.pipe()
    try:
        socket.send_fds(sock, [payload], [write_end] * copies)
    finally:
        os.close(write_end)
    return read_end


FD_CASES: list[tuple[str, Callable[[str], bytes], int, str | None]] = [
    ("garbage body", lambda _token: b"\xc1garbage", 1, "BAD_REQUEST"),
    ("wrong token", lambda _token: attach_frame("a", "0" * 32), 1, "FORBIDDEN"),
    ("more fds than a frame may carry", lambda token: attach_frame("a", token), 250, "BAD_REQUEST"),
]


@pytest.mark.parametrize(
    "make_payload, copies, code", [c[1:] for c in FD_CASES], ids=[c[0] for c in FD_CASES]
)
@pytest.mark.usefixtures("fds_delivered")
def test_fds_a_peer_sends_are_closed_by_the_daemon(
    kvd: RunningDaemon, client: KVClient, make_payload: Callable[[str], bytes], copies: int,
    code: str | None,
) -> None:
    token = register(client, "a")
    with closing(connect(kvd)) as sock:
        read_end = send_with_pipe(sock, make_payload(token), copies)
        try:
            assert_closed_elsewhere(read_end)
        finally:
            os.close(read_end)
        if code is None:
            assert_eof(sock)
        else:
            assert refusal(sock) == code
    client.call("unregister", {"tenant": "a", "token": token})
    assert_daemon_serves(kvd)


@pytest.mark.usefixtures("fds_delivered")
def test_fds_on_a_valid_attach_are_closed_and_the_attach_holds(
    kvd: RunningDaemon, client: KVClient
) -> None:
    token = register(client, "a")
    with closing(connect(kvd)) as sock:
        read_end = send_with_pipe(sock, attach_frame("a", token))
        try:
            assert_closed_elsewhere(read_end)
        finally:
            os.close(read_end)
        body, fds = recv_frame(sock)
        assert body["ok"] is True and fds == []
        client.call("grow", {"tenant": "a", "token": token, "logical_pages": [0]})
        drain_grant(sock, SEGMENTS)
    wait_until(lambda: "a" not in rows(client.status()))
    assert_daemon_serves(kvd)


@pytest.mark.usefixtures("fds_delivered")
def test_an_extra_frame_on_an_attached_channel_ends_the_lease(
    kvd: RunningDaemon, client: KVClient
) -> None:
    token = register(client, "a")
    with closing(attach(kvd, "a", token)) as sock:
        client.call("grow", {"tenant": "a", "token": token, "logical_pages": [0, 1, 2]})
        drain_grant(sock, 3 * SEGMENTS)
        assert rows(client.status())["a"]["mapped_bytes"] == 3 * SEGMENTS * PAGE_BYTES
        read_end = send_with_pipe(sock, encode({"tenant": "a", "token": token}))
        try:
            assert_closed_elsewhere(read_end)
        finally:
            os.close(read_end)
        notice, fds = recv_frame(sock)  # the client is told before the channel closes
        assert notice["notice"] == "revoked" and fds == []
        assert_eof(sock)
        status = client.status()
        assert "a" not in rows(status)  # its pages: quarantined while this (live) process may map them
        assert status["quarantined_bytes"] == 3 * SEGMENTS * PAGE_BYTES
        assert status["free_bytes"] + status["quarantined_bytes"] == status["capacity_bytes"]
        kvd.check_invariants()
    assert_daemon_serves(kvd)


@pytest.mark.parametrize("kvd", [{"attach_timeout_s": 0.3}], indirect=True)
def test_unattached_tenant_and_silent_peer_are_dropped_after_the_attach_timeout(
    kvd: RunningDaemon, client: KVClient
) -> None:
    with closing(connect(kvd)) as silent:
        token = register(client, "late")
        elapsed = wait_until(lambda: "late" not in rows(client.status()))
        assert 0.25 <= elapsed <= 1.0, elapsed
        assert_eof(silent)  # accepted before the tenant registered: closed by now
    with closing(connect(kvd)) as sock:
        sock.send(attach_frame("late", token))
        assert refusal(sock) == "UNKNOWN_TENANT"
    kvd.check_invariants()
    assert_daemon_serves(kvd)


# -- control channel -------------------------------------------------------------------


@pytest.fixture
def dealer(kvd: RunningDaemon) -> Iterator[Callable[[], zmq.Socket]]:
    """Raw DEALER sockets on the daemon's control endpoint, closed at teardown."""
    ctx = zmq.Context()
    sockets: list[zmq.Socket] = []

    def make() -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(kvd.daemon.paths.control_endpoint)
        sockets.append(sock)
        return sock

    yield make
    for sock in sockets:
        sock.close(linger=0)
    ctx.term()


def reply_to(sock: zmq.Socket, frames: list[bytes]) -> dict[str, Any]:
    sock.send_multipart(frames)
    assert sock.poll(int(IO_TIMEOUT_S * 1000), zmq.POLLIN), "no reply"
    reply = sock.recv_multipart()
    assert len(reply) == 1, reply
    return decode(reply[0])


def test_control_channel_garbage_is_answered(
    kvd: RunningDaemon, dealer: Callable[[], zmq.Socket]
) -> None:
    sock = dealer()
    rng = random.Random(11)
    for payload in [b"", b"\xc1", rng.randbytes(64), rng.randbytes(4096), encode([1, 2])]:
        reply = reply_to(sock, [payload])
        assert reply["ok"] is False and reply["error"]["code"] == "BAD_REQUEST", reply
    reply = reply_to(sock, [request(1, "status", {}), b"second frame"])
    assert reply["ok"] is False and reply["error"]["code"] == "BAD_REQUEST", reply
    reply = reply_to(sock, [request(2, "status", {})])  # the same peer is still served
    assert reply["id"] == 2 and reply["ok"] is True
    assert_daemon_serves(kvd)


def test_oversize_control_message_drops_only_that_peer(
    kvd: RunningDaemon, dealer: Callable[[], zmq.Socket]
) -> None:
    bystander = dealer()
    assert reply_to(bystander, [request(1, "status", {})])["ok"] is True
    big = dealer()
    big.send(b"\x00" * (MAX_MESSAGE_BYTES + 1))
    assert not big.poll(300, zmq.POLLIN), "the daemon answered an oversize message"
    assert reply_to(bystander, [request(2, "status", {})])["ok"] is True
    kvd.check_invariants()
    assert_daemon_serves(kvd)
