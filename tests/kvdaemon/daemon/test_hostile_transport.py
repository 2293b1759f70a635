"""The daemon's transport under hostile peers of the same uid (issue 10, items 7-10, 12).

Each test plays one attack against a daemon in a thread of this process and
asserts what must hold: the loop keeps serving, fds stay within budget, pages
come back, new tenants get in, the log stays short.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from contextlib import closing, contextmanager

import pytest
import zmq

from kvdaemon.client import KVClient
from kvdaemon.daemon import grants, lease_table, server
from kvdaemon.errors import BadRequest, Forbidden, KVDaemonError, UnknownTenant
from kvdaemon.wire.handles import recv_frame
from kvdaemon.wire.protocol import decode, encode, request

from tests.conftest import RunningDaemon, answers, short_dir, small_spec, wait_until

IO_TIMEOUT_S = 5.0
LINGER_S = 20  # longer than IO_TIMEOUT_S: a loop that waits it out fails the test


# -- helpers ---------------------------------------------------------------------------


def connect(kvd: RunningDaemon) -> socket.socket:
    """A raw handle connection."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(IO_TIMEOUT_S)
    sock.connect(str(kvd.daemon.paths.handle_socket))
    return sock


def register_raw(client: KVClient, name: str) -> tuple[socket.socket, str]:
    """Register ``name`` and attach it on a raw handle connection that we read only on demand."""
    args = {"name": name, "spec": small_spec().to_wire(), "num_virtual_pages": 4}
    token = client.call("register", args)["token"]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(IO_TIMEOUT_S)
    sock.connect(str(client.paths.handle_socket))
    sock.send(encode({"tenant": name, "token": token}))
    body, _ = recv_frame(sock)
    assert body["ok"] is True, body
    return sock, token


def read_until_eof(sock: socket.socket) -> list[dict]:
    """Every frame left on ``sock`` up to the daemon's close (fds closed here)."""
    bodies = []
    while True:
        try:
            body, fds = recv_frame(sock)
        except ConnectionError:
            return bodies
        for fd in fds:
            os.close(fd)
        bodies.append(body)


def num_open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def assert_freed(client: KVClient, name: str, num_held_bytes: int | None = None) -> None:
    """``name`` is gone; what it held is quarantined (this test process, its process, lives on
    and may still map it: ``num_held_bytes`` when known) and everything else is free."""
    status = client.status()
    assert name not in {row["name"] for row in status["tenants"]}
    assert status["free_bytes"] + status["quarantined_bytes"] == status["capacity_bytes"]
    if num_held_bytes is not None:
        assert status["quarantined_bytes"] == num_held_bytes


@contextmanager
def lingering_tcp_socket() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A TCP socket with SO_LINGER on and unsent data its peer does not read: closing
    its last reference blocks for ``LINGER_S``. Yields ``(the socket, its peer)``."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sock.connect(server.getsockname())
        peer, _ = server.accept()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, LINGER_S))
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            while True:
                sock.send(b"x" * 4096)
        try:
            yield sock, peer
        finally:
            peer.close()  # unread data: a reset ends any close still lingering


# -- item 7: fds sent on the handle channel ---------------------------------------------


def kernel_refuses_fds() -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
        try:
            probe.setsockopt(socket.SOL_SOCKET, 83, 0)  # SO_PASSRIGHTS
        except OSError:
            return False
    return os.uname().machine in {"x86_64", "aarch64"}


DAEMON_TAKING_FDS = """
import sys
from pathlib import Path
from kvdaemon.daemon import lease_table
from kvdaemon.daemon.config import DaemonConfig
from kvdaemon.daemon.server import Daemon
from kvdaemon.wire.sizes import parse_size
lease_table.refuse_fds = lambda listener: False  # as on kernels without SO_PASSRIGHTS
daemon = Daemon(DaemonConfig(dir=Path(sys.argv[1]), backend="host", capacity=parse_size("64MiB")))
daemon.start()
print("serving", flush=True)
daemon.serve()
"""


@contextmanager
def daemon_taking_fds() -> Iterator[tuple[subprocess.Popen[str], KVClient]]:
    """A daemon process that lets fds arrive; yields it and a client."""
    root = short_dir()
    proc = subprocess.Popen([sys.executable, "-c", DAEMON_TAKING_FDS, str(root)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "serving\n"
        with closing(KVClient(root, timeout_s=IO_TIMEOUT_S)) as client:
            yield proc, client
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(root, ignore_errors=True)


def test_a_lingering_socket_sent_on_the_handle_channel_does_not_freeze_the_loop() -> None:
    with daemon_taking_fds() as (daemon, client), lingering_tcp_socket() as (tcp, peer):
        with closing(socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)) as sock:
            sock.settimeout(IO_TIMEOUT_S)
            daemon.send_signal(signal.SIGSTOP)  # so that the daemon's copy is the last one
            try:
                sock.connect(str(client.paths.handle_socket))  # waits in the listen backlog
                frame = encode({"tenant": "nobody", "token": "x" * 32})
                socket.send_fds(sock, [frame], [tcp.fileno()])
                tcp.close()
            finally:
                daemon.send_signal(signal.SIGCONT)
            body, fds = recv_frame(sock)  # the attach is answered, not stuck behind a close
            assert fds == [] and body["error"]["code"] == "UNKNOWN_TENANT", body
        assert client.status()["tenants"] == []
        peer.settimeout(IO_TIMEOUT_S)
        while peer.recv(1 << 16):  # the daemon closed it: its data, then EOF
            pass
        assert_serves(client)


@pytest.mark.skipif(not kernel_refuses_fds(), reason="the kernel has no SO_PASSRIGHTS")
def test_the_kernel_refuses_fds_sent_to_the_daemon(kvd: RunningDaemon) -> None:
    read_end, write_end = os.pipe()
    try:
        with closing(connect(kvd)) as sock, pytest.raises(PermissionError):
            socket.send_fds(sock, [encode({"tenant": "a", "token": "b"})], [write_end])
    finally:
        os.close(read_end)
        os.close(write_end)
    with closing(kvd.client()) as client:
        assert_serves(client)


def assert_serves(client: KVClient) -> None:
    pool = client.register("probe", small_spec())
    try:
        assert len(pool.alloc(4)) == 4
    finally:
        pool.close()
    assert_freed(client, "probe")


# -- item 8: a lease that never reads its grants ----------------------------------------


def test_a_lease_that_never_reads_its_grants_is_revoked_within_the_fd_budget(
    kvd: RunningDaemon,
) -> None:
    budget = 48
    kvd.daemon.leases.fd_budget = budget
    with closing(kvd.client()) as client:
        client.status()  # the control connection's fds are part of the baseline
        baseline = num_open_fds()
        sock, token = register_raw(client, "hog")
        most_fds, revoked = 0, False
        with closing(sock):
            for _ in range(10 * budget):
                args = {"tenant": "hog", "token": token, "logical_pages": [0]}
                try:
                    client.call("grow", args)
                    client.call("shrink", args)
                except UnknownTenant:
                    revoked = True
                    break
                most_fds = max(most_fds, num_open_fds() - baseline)
            assert revoked, "the lease was never revoked"
            bodies = read_until_eof(sock)
        assert bodies[-1]["notice"] == "revoked", bodies[-1]
        assert most_fds <= budget + 4  # + the lease's own socket and the closer's lag
        assert_freed(client, "hog")
        kvd.check_invariants()
    with closing(kvd.client()) as fresh:  # a new control client still connects
        assert_serves(fresh)


def test_a_grant_channel_that_never_reads_its_grants_is_revoked_within_the_fd_budget(
    kvd: RunningDaemon,
) -> None:
    """Grows and shrinks sent on the tenant's grant channel, their grant frames (a pool fd
    each) never read: the fds the daemon holds for it count against the budget as a lease's do,
    so the channel is revoked (ending its lease) long before the daemon runs out of fds."""
    budget = 48
    kvd.daemon.leases.fd_budget = budget
    with closing(kvd.client()) as client:
        lease, token = register_raw(client, "hog")
        with closing(lease), closing(connect(kvd)) as channel:
            channel.send(encode({"tenant": "hog", "token": token, "channel": "grants"}))
            assert recv_frame(channel)[0]["ok"] is True
            args = {"tenant": "hog", "token": token, "logical_pages": [0]}
            for i in range(10 * budget):
                try:
                    channel.send(encode({"id": 2 * i + 1, "op": "grow", "args": args}))
                    channel.send(encode({"id": 2 * i + 2, "op": "shrink", "args": args}))
                except OSError:  # revoked and closed
                    break
                assert kvd.daemon.leases.num_held_fds() <= budget + 8  # + the connections and the closer's lag
            wait_until(lambda: "hog" not in {t["name"] for t in client.status()["tenants"]}, 5, "never revoked")
            assert {body.get("notice") for body in read_until_eof(channel)} <= {None}  # its unread grants, then EOF
            # told on its lease, where a pool reads notices (an EOF alone reads as its daemon's death)
            assert read_until_eof(lease)[-1].get("notice") == "revoked"
        assert_freed(client, "hog")
        kvd.check_invariants()
        assert_serves(client)


def test_a_lease_that_never_reads_its_notices_is_revoked_past_the_byte_bound(
    kvd: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its own limit changes, each told on its handle channel, never read: the daemon's queue
    for it stays bounded; the lease is revoked, its pages freed, the daemon serves on."""
    bound = 64 << 10
    monkeypatch.setattr(lease_table, "MAX_QUEUED_BYTES", bound)
    with closing(kvd.client()) as client:
        sock, token = register_raw(client, "deaf")
        client.call("grow", {"tenant": "deaf", "token": token, "logical_pages": [0]})
        revoked = False
        with closing(sock):
            for i in range(200_000):
                args = {"name": "deaf", "token": token, "max_bytes": (i % 2 + 1) << 22}
                try:
                    client.call("set_limit", args)
                except UnknownTenant:
                    revoked = True
                    break
                conns = list(kvd.daemon.leases.leases.values())
                assert all(conn.outbox.num_queued_bytes <= bound + 1024 for conn in conns)
            assert revoked, "the lease was never revoked"
            bodies = read_until_eof(sock)
        # its socket buffer was full, so the revoked notice may not have fit: the EOF says it
        assert {body.get("notice") for body in bodies} <= {"limit", "revoked", None}  # None: the grant
        assert_freed(client, "deaf", num_held_bytes=2 * kvd.daemon.service.pages.page_size_bytes)
        kvd.check_invariants()
        assert_serves(client)


def test_the_fd_budget_keeps_headroom_under_the_soft_limit(kvd: RunningDaemon) -> None:
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert kvd.daemon.leases.fd_budget == lease_table.fd_budget(soft)
    assert lease_table.fd_budget(20000) == 15000  # a quarter stays free
    assert lease_table.fd_budget(1024) == 768  # ... and at least FD_RESERVE_MIN
    assert lease_table.fd_budget(300) == 150  # a tiny limit: half


def test_a_failed_export_gives_the_pages_back(
    kvd: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = kvd.daemon.service.backend
    export = backend.export_pages
    calls = []

    def out_of_fds(pages: list) -> tuple[list[int], list[int]]:
        calls.append(len(pages))
        if len(calls) == 2:
            raise OSError(24, "Too many open files")
        return export(pages)

    monkeypatch.setattr(grants, "MAX_FDS_PER_FRAME", 1)  # one export per page
    monkeypatch.setattr(backend, "export_pages", out_of_fds)
    with closing(kvd.client()) as client:
        sock, token = register_raw(client, "a")
        with closing(sock):
            before = num_open_fds()
            with pytest.raises(KVDaemonError) as raised:
                client.call("grow", {"tenant": "a", "token": token, "logical_pages": [0]})
            assert raised.value.code == "BACKEND_ERROR"  # a stable code, named: not an internal error
            assert "could not export page fds: Too many open files [EMFILE]" in raised.value.message
            assert num_open_fds() == before  # the first frame's fd was closed
            status = client.status()
            assert status["free_bytes"] == status["capacity_bytes"]
            kvd.check_invariants()
            monkeypatch.setattr(backend, "export_pages", export)
            client.call("grow", {"tenant": "a", "token": token, "logical_pages": [0]})
            held = client.status()["tenants"][0]["mapped_bytes"]
        wait_until(lambda: client.status()["tenants"] == [], IO_TIMEOUT_S, "lease not ended")
        assert_freed(client, "a", held)


# -- item 9: costly requests and one client flooding --------------------------------------


def test_a_request_of_a_million_empty_arrays_is_refused(kvd: RunningDaemon) -> None:
    costly = encode({"id": 7, "op": "status", "args": {"x": [[[]] * 8192] * 120}})
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(kvd.daemon.paths.control_endpoint)
        dealer.send(costly)
        assert dealer.poll(int(IO_TIMEOUT_S * 1000)), "no reply"
        reply = decode(dealer.recv())
        dealer.close()
    finally:
        ctx.term()
    assert reply["ok"] is False and reply["error"]["code"] == "BAD_REQUEST", reply
    assert "too complex" in reply["error"]["message"]


def test_a_request_with_a_list_too_long_is_refused_at_its_header(kvd: RunningDaemon) -> None:
    client = kvd.client()
    with pytest.raises(BadRequest, match="65536 exceeds max_array_len"):
        client.call("status", {"x": [0] * 65536})
    assert client.status()["tenants"] == []  # and the daemon goes on


FLOODER = """
import sys, zmq
from kvdaemon.wire.protocol import request
dealer = zmq.Context().socket(zmq.DEALER)
dealer.connect(sys.argv[1])
message = request(1, "hello", {})
for num_sent in range(1_000_000_000):
    dealer.send(message)  # blocks while the daemon's queue for us is full
    if num_sent == 3000:
        print("flooding", flush=True)
"""


def test_a_lease_ends_while_another_client_floods_the_control_socket(
    kvd: RunningDaemon,
) -> None:
    with closing(kvd.client()) as client:
        sock, _ = register_raw(client, "a")
        flooder = subprocess.Popen(
            [sys.executable, "-c", FLOODER, kvd.daemon.paths.control_endpoint],
            stdout=subprocess.PIPE, text=True,
        )
        try:
            assert flooder.stdout is not None and flooder.stdout.readline() == "flooding\n"
            assert client.status()["tenants"][0]["name"] == "a"  # answered amid the flood
            sock.close()  # the engine dies: its lease must end although requests keep coming
            wait_until(lambda: "a" not in kvd.daemon.service.tenants, IO_TIMEOUT_S,
                     "the lease did not end during the flood")
            assert flooder.poll() is None, "the flood stopped before the lease ended"
        finally:
            flooder.kill()
            flooder.wait()
        assert_freed(client, "a")


# -- item 10: silent connections on the handle socket -----------------------------------


def open_silent(kvd: RunningDaemon, count: int) -> list[socket.socket]:
    """``count`` connections that never say a word (each connect waits for backlog room)."""
    silent = []
    for _ in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(str(kvd.daemon.paths.handle_socket))
        silent.append(sock)
    return silent


@pytest.mark.parametrize("per_pid_cap", [None, 10_000], ids=["one process", "many processes"])
def test_silent_connections_cannot_keep_a_new_tenant_out(
    kvd: RunningDaemon, monkeypatch: pytest.MonkeyPatch, per_pid_cap: int | None
) -> None:
    if per_pid_cap is not None:  # as if each came from its own process: the total cap applies
        monkeypatch.setattr(lease_table, "MAX_UNATTACHED_PER_PID", per_pid_cap, raising=False)
    silent = open_silent(kvd, 300)
    try:
        with closing(kvd.client()) as client:
            assert_serves(client)
        wait_until(lambda: len(kvd.daemon.leases.conns) <= lease_table.MAX_UNATTACHED,
                 IO_TIMEOUT_S, "more connections waiting than the cap")
    finally:
        for sock in silent:
            sock.close()


# -- item 12: log amplification ---------------------------------------------------------


def send_unread(kvd: RunningDaemon, op: str, num_requests: int, small_buffers: bool = False) -> None:
    """Send ``num_requests`` of ``op`` on one DEALER that never reads a reply, and return once
    the daemon has served them (a registration sent last is seen). ``small_buffers``: this
    side buffers next to nothing either."""
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        if small_buffers:
            dealer.setsockopt(zmq.RCVHWM, 1)
            dealer.setsockopt(zmq.RCVBUF, 4096)
        dealer.connect(kvd.daemon.paths.control_endpoint)
        for request_id in range(num_requests):
            dealer.send(request(request_id, op, {}))
        marker = {"name": "marker", "spec": small_spec().to_wire(), "num_virtual_pages": 1}
        dealer.send(request(num_requests, "register", marker))  # served after all the rest
        with closing(kvd.client()) as client:
            wait_until(lambda: "marker" in {t["name"] for t in client.status()["tenants"]},
                     30, "the requests were not served")
        dealer.close()
    finally:
        ctx.term()


def test_unread_replies_are_counted_not_logged_one_by_one(
    kvd: RunningDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvdaemon.daemon.server")
    num_requests = 20_000
    send_unread(kvd, "hello", num_requests)
    lines = [r for r in caplog.records if "could not reply" in r.getMessage()]
    assert 1 <= len(lines) <= 3, len(lines)
    num_dropped = kvd.daemon.warnings.count("reply")
    assert num_dropped >= num_requests // 2, num_dropped  # most replies could not go out


def test_replies_a_peer_leaves_unread_are_dropped_past_a_few(kvd: RunningDaemon) -> None:
    """Queued replies are bounded in number per peer (not only by ZeroMQ's 1000): a peer
    asking for big replies it never reads cannot grow the daemon's memory with them."""
    num_requests = 200
    with closing(kvd.client()) as client:  # replies of tens of KiB: few fit in socket buffers
        for i in range(300):
            client.call("set_limit", {"name": f"{i:04d}" + "n" * 120, "max_bytes": 1 << 22})
    send_unread(kvd, "status", num_requests, small_buffers=True)
    num_dropped = kvd.daemon.warnings.count("reply")
    assert num_dropped >= num_requests - 4 * server.CONTROL_SNDHWM, num_dropped


# -- pid namespaces ---------------------------------------------------------------------


def test_a_peer_whose_pid_the_daemon_cannot_see_is_refused_at_attach(
    kvd: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SO_PEERCRED reads pid 0 for a peer in a pid namespace the daemon cannot see: such a
    tenant could never be quarantined, so it is refused, saying why."""
    monkeypatch.setattr(lease_table, "check_same_uid", lambda sock: 0)
    with closing(kvd.client()) as client:
        with pytest.raises(Forbidden, match="pid namespace"):
            client.register("a", small_spec())
        assert kvd.daemon.leases.leases == {}
    monkeypatch.undo()
    with closing(kvd.client()) as client:  # a visible peer attaches as ever
        client.register("b", small_spec()).close()


def test_a_daemon_in_its_own_pid_namespace_refuses_tenants_outside_it() -> None:
    """The real case: the daemon in a child pid namespace, the tenant in ours."""
    root = short_dir()
    cmd = ["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-m", "kvdaemon", "start",
           "--foreground", "--dir", str(root), "--backend", "host", "--capacity", "64MiB"]
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    except FileNotFoundError:
        pytest.skip("no unshare(1) here")
    try:
        wait_until(lambda: answers(root) or proc.poll() is not None, 30, "the daemon did not start")
        if proc.poll() is not None:
            pytest.skip(f"cannot make a pid namespace here: {proc.stderr.read()[-300:] if proc.stderr else ''}")
        with closing(KVClient(root, timeout_s=IO_TIMEOUT_S)) as client:
            with pytest.raises(Forbidden, match="pid namespace"):
                client.register("a", small_spec())
    finally:
        proc.kill()  # unshare's child, the daemon, dies with it (--kill-child)
        proc.wait(30)
        shutil.rmtree(root, ignore_errors=True)


def test_refused_and_failing_requests_are_logged_once_per_kind_not_once_each(
    kvd: RunningDaemon, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A client guessing tokens or sending ops the daemon lacks shows in its log (one line per
    kind and interval, whatever names it sends, quoted so that they forge no line); an internal
    error's first line has its traceback."""

    def broken(*_args: object) -> None:
        raise RuntimeError("a bug (a test)")

    monkeypatch.setitem(kvd.daemon.service._ops, "status", broken)
    with closing(kvd.client()) as client, caplog.at_level(logging.WARNING, logger="kvdaemon.service"):
        sock, _ = register_raw(client, "a")
        with closing(sock):
            for i in range(30):
                with pytest.raises(Forbidden):
                    client.call("grow", {"tenant": "a", "token": "x" * 32, "logical_pages": [0]})
                with pytest.raises(KVDaemonError) as unknown:
                    client.call(f"probe-{i}\n2026-01-01 00:00:00 kvdaemon.service WARNING forged", {})
                assert unknown.value.code == "UNKNOWN_OP"
                with pytest.raises(KVDaemonError) as internal:
                    client.call("status", {})
                assert internal.value.code == "INTERNAL"
    records = [r for r in caplog.records if r.name == "kvdaemon.service"]
    assert [r.getMessage() for r in records] == [
        "refused a grow request: FORBIDDEN wrong token for tenant 'a'",
        "refused a 'probe-0\\n2026-01-01 00:00:00 kvdaemon.ser' request: UNKNOWN_OP unknown op "
        "'probe-0\\n2026-01-01 00:00:00 kvdaemon.service WARNING forged'",
        "internal error serving a status request: RuntimeError('a bug (a test)')"]
    assert records[2].exc_info and not records[0].exc_info
    assert kvd.daemon.service.warnings.count("refused:other:UNKNOWN_OP") == 30
