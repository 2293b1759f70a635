"""``ControlPeers``: the control socket's connections counted, and the newest of the
process holding the most shut down past the bound (a flood once made libzmq abort
the daemon on ``EMFILE``)."""

from __future__ import annotations

import logging
import os
import random
import resource
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import closing, contextmanager

import pytest

from kvdaemon.client import KVClient
from kvdaemon.daemon import control_peers
from kvdaemon.daemon.control_peers import ControlPeers
from kvdaemon.daemon.log_throttle import LogThrottle

from tests.conftest import RunningDaemon, short_dir, wait_until

IO_TIMEOUT_S = 5.0


# -- helpers ---------------------------------------------------------------------------


def peers(max_peers: int) -> ControlPeers:
    """A table with no monitor: the tests feed it accepts and closes."""
    table = ControlPeers(LogThrottle(logging.getLogger("test.control_peers")))
    table.max_peers = max_peers
    return table


@contextmanager
def connections(num: int) -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    """``num`` connected pairs ``(ours, far end)``, both ends in this process."""
    pairs = [socket.socketpair() for _ in range(num)]
    try:
        yield pairs
    finally:
        for ours, far in pairs:
            ours.close()
            far.close()


CONNECTOR = """
import socket, sys
socks = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sys.argv[1])
    socks.append(s)
print("connected", flush=True)
sys.stdin.read()
"""


@contextmanager
def foreign_connections(num: int) -> Iterator[tuple[int, list[socket.socket]]]:
    """``num`` connections accepted here from another process; yields its pid and our ends."""
    path = short_dir() / "l.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(num)
    proc = subprocess.Popen([sys.executable, "-c", CONNECTOR, str(path), str(num)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    accepted: list[socket.socket] = []
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "connected\n"
        accepted = [listener.accept()[0] for _ in range(num)]
        yield proc.pid, accepted
    finally:
        for sock in accepted:
            sock.close()
        listener.close()
        proc.kill()
        proc.wait()


def was_shut(ours: socket.socket) -> bool:
    """Whether the table shut down our end ``ours`` (it then reads EOF at once)."""
    ours.setblocking(False)
    try:
        return ours.recv(1) == b""
    except BlockingIOError:
        return False


# -- bookkeeping --------------------------------------------------------------------------


def test_connections_are_counted_by_process_and_forgotten_when_closed() -> None:
    table = peers(max_peers=8)
    with connections(3) as pairs:
        for ours, _ in pairs:
            table.accepted(ours.fileno())
        assert len(table) == 3 and table.num_held(os.getpid()) == 3
        table.closed(pairs[0][0].fileno())
        table.closed(pairs[0][0].fileno())  # a second close of the same fd changes nothing
        table.closed(12345)  # an fd never counted: nothing
        assert len(table) == 2 and table.num_held(os.getpid()) == 2
        assert not any(was_shut(ours) for ours, _ in pairs)
    assert table.num_shut == 0


def test_an_accept_on_an_fd_still_counted_replaces_it() -> None:
    table = peers(max_peers=8)
    with connections(1) as pairs:
        fd = pairs[0][0].fileno()
        table.accepted(fd)
        table.accepted(fd)  # its close was not seen: the new connection only
        assert len(table) == 1 and table.num_held(os.getpid()) == 1


def test_past_the_bound_the_newcomer_of_the_process_holding_most_is_shut_down() -> None:
    table = peers(max_peers=2)
    with connections(3) as pairs:
        for ours, _ in pairs:
            table.accepted(ours.fileno())
        assert len(table) == 2 and table.num_shut == 1
        pairs[2][1].settimeout(IO_TIMEOUT_S)
        assert pairs[2][1].recv(1) == b"", "the far end of the newest did not see it shut down"
        assert not was_shut(pairs[0][0]) and not was_shut(pairs[1][0])
        table.closed(pairs[2][0].fileno())  # ZeroMQ's close of it, reported after: nothing more
        assert len(table) == 2 and table.num_held(os.getpid()) == 2


def test_a_flooding_process_loses_its_own_connections_not_another_process() -> None:
    table = peers(max_peers=4)
    with connections(2) as ours, foreign_connections(4) as (flooder_pid, theirs):
        table.accepted(ours[0][0].fileno())
        for sock in theirs[:3]:
            table.accepted(sock.fileno())
        assert len(table) == 4 and table.num_held(flooder_pid) == 3
        table.accepted(theirs[3].fileno())  # the flooder's next: its own newest goes
        assert table.num_held(flooder_pid) == 3 and was_shut(theirs[3])
        table.accepted(ours[1][0].fileno())  # a newcomer from the light process: the flooder's newest goes
        assert table.num_held(os.getpid()) == 2 and table.num_held(flooder_pid) == 2
        assert was_shut(theirs[2]) and not was_shut(theirs[1])
        assert not was_shut(ours[0][0]) and not was_shut(ours[1][0])
        assert table.num_shut == 2


def test_the_process_holding_most_stays_exact_as_connections_come_and_go() -> None:
    table = peers(max_peers=3)
    with connections(3) as ours, foreign_connections(3) as (other_pid, theirs):
        for sock in theirs[:2]:
            table.accepted(sock.fileno())
        table.accepted(ours[0][0].fileno())
        for sock in theirs[:2]:
            table.closed(sock.fileno())  # the other process leaves its lead
        table.accepted(ours[1][0].fileno())
        table.accepted(theirs[2].fileno())
        table.accepted(ours[2][0].fileno())  # past the bound: this process holds 3, the other 1
        assert table.num_held(os.getpid()) == 2 and table.num_held(other_pid) == 1
        assert was_shut(ours[2][0]) and not was_shut(theirs[2]) and not was_shut(ours[1][0])


def test_an_fd_number_reused_by_another_socket_is_not_shut_down() -> None:
    table = peers(max_peers=2)
    with connections(1) as ours, foreign_connections(2) as (other_pid, theirs):
        for sock in theirs:
            table.accepted(sock.fileno())
        table._peers[theirs[1].fileno()].inode = -1  # as if ZeroMQ closed it and the number came back
        table.accepted(ours[0][0].fileno())  # the other's newest is forgotten, its socket untouched
        assert table.num_held(other_pid) == 1 and table.num_shut == 1
        assert not was_shut(theirs[1]) and not was_shut(theirs[0])


def test_the_victim_is_always_of_a_process_holding_the_most(monkeypatch: pytest.MonkeyPatch) -> None:
    """Random accepts and closes from 6 processes against a recount from scratch."""
    rng = random.Random(7)
    pid_of: dict[int, int] = {}
    shut_fds: list[int] = []
    monkeypatch.setattr(control_peers, "_identify", lambda fd: (pid_of[fd], fd))
    monkeypatch.setattr(control_peers, "_shut_down", lambda fd, inode: shut_fds.append(fd))
    table = peers(max_peers=12)
    open_fds: dict[int, int] = {}  # fd -> pid, in accept order: the model
    for fd in range(1, 3000):
        if open_fds and rng.random() < 0.45:
            gone = rng.choice(list(open_fds))
            del open_fds[gone]
            table.closed(gone)
            continue
        pid_of[fd] = pid = rng.randrange(6)
        open_fds[fd] = pid
        counts = Counter(open_fds.values())
        table.accepted(fd)
        if len(open_fds) <= 12:
            assert not shut_fds
            continue
        victim = shut_fds.pop()
        top = max(counts.values())
        assert counts[open_fds[victim]] == top, (counts, open_fds[victim])
        if counts[pid] == top:
            assert victim == fd, "the newcomer's own process holds the most: the newcomer goes"
        assert victim == max(f for f, p in open_fds.items() if p == open_fds[victim]), "not the newest"
        del open_fds[victim]
        assert len(table) == 12
        assert all(table.num_held(p) == n for p, n in Counter(open_fds.values()).items())


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
