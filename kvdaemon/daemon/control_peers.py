"""``ControlPeers``: the connections to the control socket, counted and bounded.

ZeroMQ accepts connections on the control socket in its own I/O thread and
keeps no bound on how many; when the process runs out of fds there, libzmq
aborts the whole daemon (an ``accept`` failing with ``EMFILE`` is an assertion
in its IPC listener). This table follows the socket's monitor (an
``ACCEPTED`` event per connection, carrying its fd, and a ``DISCONNECTED``
when ZeroMQ closes it) and keeps at most ``max_peers`` connections: past that,
one is shut down at once, the newest of the process holding the most (the one
that just arrived when its own process holds the most). A process flooding the
socket so loses its own connections, never another process's, and a new
client always gets in. ZeroMQ closes a shut-down connection itself; a DEALER
reconnects later and is counted again.

Invariants:

- every fd in the table is one ZeroMQ accepted and has not yet reported
  closed; with one ZeroMQ I/O thread, a ``DISCONNECTED`` is reported before the
  ``ACCEPTED`` of a connection that reuses its fd number.
- at most ``max_peers`` connections remain once ``drain`` has run to the end
  of the queue.
- connections accepted and not yet seen here are at most the monitor queue's
  length (about ``MONITOR_QUEUE_EVENTS``): libzmq's monitor is a PAIR socket,
  whose sends block ZeroMQ's I/O thread (and so its accepts) while the queue
  to us is full. ``peer_cap`` leaves that many fds, and the handle channel's
  budget, under the fd limit.

A connection is shut down only while its fd still names the socket accepted
(same inode), so an fd number ZeroMQ closed and another thread reused is not
touched.

Cost: one ``SO_PEERCRED`` read and one ``fstat`` per connection; O(1) per
event (count buckets find the process holding the most).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvdaemon.daemon.log_throttle import LogThrottle
from kvdaemon.wire.handles import peer_credentials

log = logging.getLogger("kvdaemon.daemon.control")
MONITOR_ENDPOINT = "inproc://kvdaemon-control-monitor"
MONITOR_QUEUE_EVENTS = 1001  # libzmq's own monitor socket queues 1000, ours 1 (RCVHWM)
MONITOR_BATCH = 256  # events served per loop round
MIN_PEERS = 64
UNKNOWN_PID = -1  # a connection whose peer could not be read


@dataclass
class _Peer:
    pid: int
    inode: int | None  # None: the fd could not be read (already closed)


def peer_cap(num_reserved_fds: int) -> int:
    """Control connections kept out of ``num_reserved_fds``, the fds the handle channel leaves.

    Half of what the monitor queue leaves of them, and at least ``MIN_PEERS``.
    """
    return max(MIN_PEERS, (num_reserved_fds - MONITOR_QUEUE_EVENTS) // 2)


class ControlPeers:
    """The control socket's connections by fd and by peer pid, bounded by ``max_peers``."""

    def __init__(self, warnings: LogThrottle) -> None:
        self.max_peers = 0  # set by ``start``
        self.warnings = warnings
        self.num_shut = 0  # connections shut down for the bound, since start
        self.monitor: zmq.Socket | None = None
        self._router: zmq.Socket | None = None
        self._peers: dict[int, _Peer] = {}
        self._fds_by_pid: dict[int, dict[int, None]] = {}  # pid -> its fds, oldest first
        self._pids_by_count: dict[int, set[int]] = {}
        self._max_count = 0

    def __len__(self) -> int:
        return len(self._peers)

    def start(self, ctx: zmq.Context, router: zmq.Socket, max_peers: int) -> None:
        """Follow ``router``'s accepted and closed connections, keeping at most ``max_peers``;
        poll ``self.monitor`` for them. Call before ``router`` binds."""
        self.max_peers = max_peers
        router.monitor(MONITOR_ENDPOINT, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        monitor = ctx.socket(zmq.PAIR)
        monitor.setsockopt(zmq.RCVHWM, 1)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.connect(MONITOR_ENDPOINT)
        self._router, self.monitor = router, monitor

    def close(self) -> None:
        """Stop reading the monitor. The router's own close (and the context's term) end it;
        a monitor stopped here could wait on ZeroMQ's I/O thread, itself blocked on a full queue."""
        if self.monitor is not None:
            self.monitor.close(linger=0)
            self.monitor = None

    def drain(self) -> None:
        """Serve up to ``MONITOR_BATCH`` queued events, then shut down what is past the bound."""
        assert self.monitor is not None
        for _ in range(MONITOR_BATCH):
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            event = parse_monitor_message(frames)
            if event["event"] == zmq.EVENT_ACCEPTED:
                self.accepted(event["value"])
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.closed(event["value"])

    def accepted(self, fd: int) -> None:
        """Count the connection ZeroMQ accepted on ``fd``; past the bound, shut one down."""
        if fd in self._peers:  # a close we did not see: count the new connection only
            self.closed(fd)
        pid, inode = _identify(fd)
        self._peers[fd] = _Peer(pid, inode)
        self._fds_by_pid.setdefault(pid, {})[fd] = None
        self._move(pid, len(self._fds_by_pid[pid]) - 1)
        if len(self._peers) > self.max_peers:
            self._shut_one(pid)

    def closed(self, fd: int) -> None:
        """Forget the connection ZeroMQ closed on ``fd`` (one never counted: nothing)."""
        peer = self._peers.pop(fd, None)
        if peer is None:
            return
        fds = self._fds_by_pid[peer.pid]
        del fds[fd]
        self._move(peer.pid, len(fds) + 1)
        if not fds:
            del self._fds_by_pid[peer.pid]

    def num_held(self, pid: int) -> int:
        """Connections counted for process ``pid``."""
        return len(self._fds_by_pid.get(pid, ()))

    def _move(self, pid: int, old_count: int) -> None:
        """Move ``pid`` from bucket ``old_count`` to its count now; keep ``_max_count`` exact."""
        new_count = self.num_held(pid)
        if old_count:
            bucket = self._pids_by_count[old_count]
            bucket.discard(pid)
            if not bucket:
                del self._pids_by_count[old_count]
        if new_count:
            self._pids_by_count.setdefault(new_count, set()).add(pid)
        if new_count > self._max_count:
            self._max_count = new_count
        elif old_count == self._max_count and old_count not in self._pids_by_count:
            self._max_count = new_count  # the only pid at the top came down by one

    def _shut_one(self, newcomer_pid: int) -> None:
        """Shut down the newest connection of the process holding the most (the newcomer's on a tie)."""
        top = self._pids_by_count[self._max_count]
        pid = newcomer_pid if newcomer_pid in top else next(iter(top))
        fd = next(reversed(self._fds_by_pid[pid]))
        peer = self._peers[fd]
        self.closed(fd)  # ZeroMQ's DISCONNECTED for it then finds nothing
        self.num_shut += 1
        _shut_down(fd, peer.inode)
        self.warnings.warning(
            "control-peers", "control socket: %d connections, the most it keeps: shut down one of "
            "process %d, which holds %d", self.max_peers, pid, self.num_held(pid) + 1,
        )


@contextmanager
def _borrowed(fd: int) -> Iterator[socket.socket]:
    """A ``socket`` over ZeroMQ's ``fd``, handed back without closing it (and with no fd of its own)."""
    sock = socket.socket(fileno=fd)
    try:
        yield sock
    finally:
        sock.detach()


def _identify(fd: int) -> tuple[int, int | None]:
    """``(peer pid, inode)`` of the socket on ``fd``; the inode is None if ``fd`` is closed."""
    try:
        inode = os.fstat(fd).st_ino
    except OSError:
        return UNKNOWN_PID, None
    try:
        with _borrowed(fd) as sock:
            return peer_credentials(sock)[0], inode
    except OSError:  # not a socket any more, or its peer unreadable: counted apart
        return UNKNOWN_PID, inode


def _shut_down(fd: int, inode: int | None) -> None:
    """Shut the socket on ``fd`` down for reading and writing (ZeroMQ then closes it), if ``fd``
    still names the socket seen at accept."""
    if inode is None:
        return  # it was closed before it could be read: its DISCONNECTED is queued
    try:
        if os.fstat(fd).st_ino != inode:
            return
        with _borrowed(fd) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # closed meanwhile (the peer left): nothing to shut down
        pass
