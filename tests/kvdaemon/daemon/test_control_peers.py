"""``ControlPeers``: the control socket's connections counted, and past the bound a
silent one shut down, never one that sent a request (a flood once made libzmq
abort the daemon on ``EMFILE``)."""

from __future__ import annotations

import logging
import os
import random
import resource
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import closing, contextmanager

import pytest

from kvdaemon.client import KVClient
from kvdaemon.daemon import control_peers, server
from kvdaemon.daemon.control_peers import ControlPeers
from kvdaemon.daemon.log_throttle import LogThrottle

from tests.conftest import RunningDaemon, running_daemon, short_dir, small_spec, wait_until

IO_TIMEOUT_S = 5.0


# -- helpers ---------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def peers(max_peers: int, clock: Clock | None = None) -> ControlPeers:
    """A table with no monitor: the tests feed it accepts, requests and closes."""
    table = ControlPeers(LogThrottle(logging.getLogger("test.control_peers")), clock or Clock())
    table.max_peers = max_peers
    table.path = ""  # the name of a socketpair's ends, as the control socket's path is its connections'
    return table


@contextmanager
def connections(num: int) -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    """``num`` connected pairs ``(ours, far end)``: the table is fed ``ours``."""
    pairs = [socket.socketpair() for _ in range(num)]
    try:
        yield pairs
    finally:
        for ours, far in pairs:
            ours.close()
            far.close()


def was_shut(ours: socket.socket) -> bool:
    """Whether the table shut down our end ``ours`` (it then reads EOF at once)."""
    ours.setblocking(False)
    try:
        return ours.recv(1) == b""
    except BlockingIOError:
        return False


def reads_eof(sock: socket.socket) -> bool:
    """Whether ``sock`` reaches EOF now, past whatever the daemon sent first (ZMTP's greeting)."""
    sock.setblocking(False)
    try:
        while sock.recv(4096):
            pass
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    return True


# -- bookkeeping --------------------------------------------------------------------------


def test_connections_are_counted_and_forgotten_when_closed() -> None:
    table = peers(max_peers=8)
    with connections(3) as pairs:
        for ours, _ in pairs:
            table.accepted(ours.fileno())
        assert len(table) == 3 and table.num_silent == 3
        table.spoke(pairs[1][0].fileno())
        table.spoke(12345)  # a request from an fd never counted: nothing
        assert len(table) == 3 and table.num_silent == 2
        table.closed(pairs[0][0].fileno())
        table.closed(pairs[0][0].fileno())  # a second close of the same fd changes nothing
        table.closed(12345)
        assert len(table) == 2 and table.num_silent == 1
        assert not any(was_shut(ours) for ours, _ in pairs)
    assert table.num_shut == 0


def test_an_accept_on_an_fd_still_counted_replaces_it() -> None:
    table = peers(max_peers=8)
    with connections(1) as pairs:
        fd = pairs[0][0].fileno()
        table.accepted(fd)
        table.spoke(fd)
        table.accepted(fd)  # its close was not seen: the new connection only, silent
        assert len(table) == 1 and table.num_silent == 1


def test_past_the_bound_the_oldest_silent_connection_is_shut_down() -> None:
    table = peers(max_peers=3)
    with connections(5) as pairs:
        client, flood = pairs[0][0], [ours for ours, _ in pairs[1:3]]
        table.accepted(client.fileno())
        table.spoke(client.fileno())  # a client: its request came
        for sock in flood:
            table.accepted(sock.fileno())
        table.accepted(pairs[3][0].fileno())  # a newcomer: the oldest silent one makes room
        pairs[1][1].settimeout(IO_TIMEOUT_S)
        assert pairs[1][1].recv(1) == b"", "the far end of the oldest silent did not see it shut down"
        assert was_shut(flood[0]) and not was_shut(pairs[3][0]) and not was_shut(client)
        table.closed(flood[0].fileno())  # ZeroMQ's close of it, reported after: nothing more
        table.spoke(pairs[3][0].fileno())
        table.accepted(pairs[4][0].fileno())
        assert was_shut(flood[1]) and not was_shut(pairs[4][0])
        assert len(table) == 3 and table.num_silent == 1 and table.num_shut == 2


def test_a_connection_that_sent_a_request_is_never_shut_down() -> None:
    table = peers(max_peers=2)
    with connections(4) as pairs:
        for ours, _ in pairs[:2]:
            table.accepted(ours.fileno())
            table.spoke(ours.fileno())
        for ours, _ in pairs[2:]:
            table.accepted(ours.fileno())  # only the newcomer is silent: it goes
            assert was_shut(ours)
        assert not was_shut(pairs[0][0]) and not was_shut(pairs[1][0])
        assert len(table) == 2 and table.num_shut == 2


def test_an_fd_number_reused_by_another_socket_is_not_shut_down() -> None:
    table = peers(max_peers=1)
    with connections(2) as pairs:
        old, newcomer = pairs[0][0], pairs[1][0]
        table.accepted(old.fileno())
        table._peers[old.fileno()].inode = -1  # as if ZeroMQ closed it and the number came back
        table.accepted(newcomer.fileno())  # the old one is forgotten, its socket untouched
        assert len(table) == 1 and table.num_shut == 1
        assert not was_shut(old) and not was_shut(newcomer)


def test_a_request_read_before_its_accept_marks_the_connection_a_client() -> None:
    """ZeroMQ reports the accept before the handshake: the first request may come first."""
    table = peers(max_peers=1)
    with connections(3) as pairs:
        client, newcomer, stranger = pairs[0][0], pairs[1][0], pairs[2][0]
        table.spoke(client.fileno())  # read before its ACCEPTED
        table.accepted(client.fileno())
        assert table.num_silent == 0
        table.spoke(stranger.fileno())
        table.accepted(newcomer.fileno())  # the bound: the newcomer is the only silent one
        assert was_shut(newcomer) and not was_shut(client)
        table.spoke(None)  # a request without a source fd: nothing
        table.spoke(-1)
        assert len(table) == 1 and table.num_silent == 0


def test_a_request_on_a_reused_number_of_a_known_client_is_remembered_for_the_new_one() -> None:
    """The entry is a closed client's (its DISCONNECTED still queued); the request is the new
    connection's, whose ACCEPTED comes after."""
    table = peers(max_peers=8)
    with connections(1) as pairs:
        fd = pairs[0][0].fileno()
        table.accepted(fd)
        table.spoke(fd)
        table._peers[fd].inode = -1  # as if the number now named the next connection
        table.spoke(fd)  # the new connection's first request
        table.closed(fd)  # the old one's DISCONNECTED
        table.accepted(fd)  # the new one's ACCEPTED: a client already
        assert table.num_silent == 0


def test_an_early_request_from_a_number_since_reused_does_not_count() -> None:
    table = peers(max_peers=8)
    with connections(1) as pairs:
        fd = pairs[0][0].fileno()
        table.spoke(fd)
        table._early[fd] = -1  # as if the number then named another socket
        table.accepted(fd)
        assert table.num_silent == 1


def test_an_fd_that_is_not_a_control_connection_is_never_shut_down() -> None:
    """An ACCEPTED read after ZeroMQ closed the connection and the number went to, say, a lease."""
    table = peers(max_peers=1)
    table.path = "/run/kvdaemon/control.sock"  # the socketpair's ends are not named so
    with connections(2) as pairs:
        reused, newcomer = pairs[0][0], pairs[1][0]
        table.accepted(reused.fileno())
        table.accepted(newcomer.fileno())  # past the bound: the oldest silent is forgotten, untouched
        assert len(table) == 1 and table.num_shut == 1
        assert not was_shut(reused) and not was_shut(newcomer)


def test_victims_are_the_oldest_silent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Random accepts, requests and closes against a model kept from scratch."""
    rng = random.Random(7)
    shut_fds: list[int] = []
    monkeypatch.setattr(control_peers, "_identify", lambda fd, path: (1, fd))  # fd numbers, not fds
    monkeypatch.setattr(control_peers, "_inode", lambda fd: fd)
    monkeypatch.setattr(control_peers, "_shut_down", lambda fd, inode: shut_fds.append(fd))
    table = peers(max_peers=12)
    open_fds: list[int] = []  # the model: open fds in accept order
    spoken: set[int] = set()
    for fd in range(1, 4000):
        roll = rng.random()
        if open_fds and roll < 0.3:
            gone = open_fds.pop(rng.randrange(len(open_fds)))
            spoken.discard(gone)
            table.closed(gone)
            continue
        if open_fds and roll < 0.5:
            speaker = rng.choice(open_fds)
            spoken.add(speaker)
            table.spoke(speaker)
            continue
        open_fds.append(fd)
        table.accepted(fd)
        if len(open_fds) <= 12:
            assert not shut_fds
            continue
        victim = shut_fds.pop()
        assert victim == next(f for f in open_fds if f not in spoken)
        open_fds.remove(victim)
        assert len(table) == 12 and table.num_silent == len([f for f in open_fds if f not in spoken])


def test_the_cap_leaves_the_monitor_queue_and_half_the_rest() -> None:
    assert control_peers.peer_cap(5000) == (5000 - control_peers.MONITOR_QUEUE_EVENTS) // 2
    assert control_peers.peer_cap(256) == control_peers.MIN_PEERS


# -- in a daemon ---------------------------------------------------------------------------


def test_the_daemon_counts_its_control_clients(kvd: RunningDaemon) -> None:
    before = len(kvd.daemon.control_peers)
    clients = [KVClient(kvd.dir, timeout_s=IO_TIMEOUT_S) for _ in range(3)]
    try:
        for client in clients:
            client.status()
        wait_until(lambda: len(kvd.daemon.control_peers) == before + 3, IO_TIMEOUT_S, "not counted")
    finally:
        for client in clients:
            client.close()
    wait_until(lambda: len(kvd.daemon.control_peers) == before, IO_TIMEOUT_S, "closes not seen")


def test_a_silent_flood_leaves_clients_and_engines_their_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "_control_peer_cap", lambda: 16)
    with running_daemon("64MiB") as kvd:
        engine = kvd.client()
        pool = engine.register("a", small_spec())
        pool.alloc(1)
        flood: list[socket.socket] = []
        try:
            for _ in range(200):  # connections that never speak (nor ZMTP): past the bound many times
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(str(kvd.daemon.paths.control_socket))
                flood.append(sock)
            wait_until(lambda: kvd.daemon.control_peers.num_shut >= 200 - 16, IO_TIMEOUT_S, "the flood stayed")
            assert len(kvd.daemon.control_peers) <= 16
            with closing(KVClient(kvd.dir, timeout_s=IO_TIMEOUT_S)) as newcomer:
                assert [t["name"] for t in newcomer.status()["tenants"]] == ["a"]  # a new client gets in
            assert engine.status()["tenants"][0]["mapped_bytes"] > 0  # the engine's client was kept
            pool.lease.heartbeat(active=True)  # and so was its lease's control connection
            assert sum(reads_eof(sock) for sock in flood) >= 200 - 16
        finally:
            for sock in flood:
                sock.close()
        pool.close()


FLOOD_LIMIT = 6144  # the daemon's fd limit: the flood opens more connections than that
NUM_FLOOD = 6500

DAEMON = """
import resource, signal, sys
from pathlib import Path
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), int(sys.argv[2])))
from kvdaemon.daemon.config import DaemonConfig
from kvdaemon.daemon.server import Daemon
from kvdaemon.wire.sizes import parse_size
daemon = Daemon(DaemonConfig(dir=Path(sys.argv[1]), backend="host", capacity=parse_size("64MiB")))
daemon.start()
signal.signal(signal.SIGTERM, lambda *_: daemon.stop())
print("serving", daemon.control_peers.max_peers, flush=True)
daemon.serve()
print("stopped", flush=True)
"""

FLOODER = """
import sys, zmq
ctx = zmq.Context()
ctx.set(zmq.MAX_SOCKETS, int(sys.argv[2]) + 16)
socks = []
for _ in range(int(sys.argv[2])):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(sys.argv[1])
    socks.append(s)
print("connected", flush=True)
sys.stdin.read()
"""


def num_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.skipif(resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 2 * NUM_FLOOD + 256,
                    reason="the flooder needs more fds than the hard limit allows")
def test_a_connection_flood_past_the_fd_limit_leaves_the_daemon_serving() -> None:
    root = short_dir()
    daemon = subprocess.Popen([sys.executable, "-c", DAEMON, str(root), str(FLOOD_LIMIT)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    flooder: subprocess.Popen[str] | None = None
    try:
        assert daemon.stdout is not None
        first = daemon.stdout.readline().split()
        assert first[:1] == ["serving"], first
        max_peers = int(first[1])
        assert max_peers + control_peers.MONITOR_QUEUE_EVENTS < FLOOD_LIMIT // 4
        with closing(KVClient(root, timeout_s=IO_TIMEOUT_S)) as client:
            client.status()
            flooder = subprocess.Popen(
                [sys.executable, "-c", FLOODER, f"ipc://{root / 'control.sock'}", str(NUM_FLOOD)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=raise_fd_limit,
            )
            assert flooder.stdout is not None and flooder.stdout.readline() == "connected\n"
            for _ in range(3):  # the flood's sockets keep reconnecting: the daemon keeps serving
                assert daemon.poll() is None, "the daemon died in the flood"
                assert client.status()["tenants"] == []
                assert num_fds(daemon.pid) <= max_peers + control_peers.MONITOR_QUEUE_EVENTS + 128
            with closing(KVClient(root, timeout_s=IO_TIMEOUT_S)) as newcomer:
                assert newcomer.status()["tenants"] == []  # a new client gets in amid the flood
        daemon.terminate()  # stopped while the flood goes on: the teardown must not hang
        out, err = daemon.communicate(timeout=30)
        assert out.strip() == "stopped", err[-2000:]
        assert f"the most it keeps: shut down one of process {flooder.pid}" in err
    finally:
        if flooder is not None:
            flooder.kill()
            flooder.wait()
        daemon.kill()
        daemon.wait()


def raise_fd_limit() -> None:
    """In the flooder: the soft fd limit up to the hard one."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
