"""``ControlPeers``: the connections to the control socket, counted and bounded.

ZeroMQ accepts connections on the control socket in its own I/O thread and
keeps no bound on how many; when the process runs out of fds there, libzmq
aborts the whole daemon (an ``accept`` failing with ``EMFILE`` is an assertion
in its IPC listener). This table follows the socket's monitor (an
``ACCEPTED`` event per connection, carrying its fd, and a ``DISCONNECTED``
when ZeroMQ closes it) and the requests' source fds (``spoke``), and keeps at
most ``max_peers`` connections. Past that, the oldest connection that has
never sent a request is shut down at once; one that has (every client's, an
engine's) is never shut down for the bound. A client sends its request as it
connects; ZeroMQ reports the accept before the handshake, so the request may be
read before its ``ACCEPTED`` is (``spoke`` then remembers the fd and its inode
until it is). A flood of silent connections, from one process or from many,
so costs its own connections only: a new client is shut down only if
``max_peers`` more connections arrive before its first request is read (the
loop reads requests before it turns to the monitor, and at most ``batch``
events a round, a quarter of the bound). ZeroMQ closes a shut-down connection
itself; a DEALER reconnects later and is counted again. (A flood of
connections that each send requests is bounded too, but then each new
connection is the one shut down: the uid is the trust boundary, and such a
peer could as well stop the daemon.)

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

A connection is shut down only if its fd named, when its ``ACCEPTED`` was
read, a socket accepted on the control socket's path (an fd number ZeroMQ had
closed and the loop or another thread reused, for a lease say, is never
counted as shut-able), and only while it still names that socket (same inode).

Cost: an ``fstat``, a ``getsockname`` and an ``SO_PEERCRED`` read (for the log)
per connection, an ``fstat`` per request (its fd's number may have been reused);
O(1) per event and per request.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvdaemon.daemon.log_throttle import LogThrottle
from kvdaemon.wire.handles import peer_credentials

log = logging.getLogger("kvdaemon.daemon.control")
MONITOR_ENDPOINT = "inproc://kvdaemon-control-monitor"
MONITOR_QUEUE_EVENTS = 1001  # libzmq's own monitor socket queues 1000, ours 1 (RCVHWM)
MONITOR_BATCH = 256  # events served per loop round, at most
MIN_PEERS = 64
UNKNOWN_PID = -1  # a connection whose peer could not be read
MAX_EARLY = MONITOR_QUEUE_EVENTS  # requests remembered ahead of their ACCEPTED: the monitor's queue


@dataclass
class _Peer:
    pid: int  # for the log
    inode: int | None  # None: not a control connection when read (closed, or the number reused): never shut
    accepted_at: float


def peer_cap(num_reserved_fds: int) -> int:
    """Control connections kept out of ``num_reserved_fds``, the fds the handle channel leaves.

    Half of what the monitor queue leaves of them, and at least ``MIN_PEERS``.
    """
    return max(MIN_PEERS, (num_reserved_fds - MONITOR_QUEUE_EVENTS) // 2)


class ControlPeers:
    """The control socket's connections by fd, those never heard from in accept order."""

    def __init__(self, warnings: LogThrottle, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_peers = 0  # set by ``start``
        self.batch = MONITOR_BATCH  # events served per ``drain``: a quarter of the bound, at most this
        self.warnings = warnings
        self.clock = clock
        self.num_shut = 0  # connections shut down for the bound, since start
        self.monitor: zmq.Socket | None = None
        self._peers: dict[int, _Peer] = {}
        self._silent: dict[int, None] = {}  # fds that never sent a request, oldest first
        self._early: dict[int, int | None] = {}  # fd -> inode: requests read before their ACCEPTED
        self.path = ""  # the control socket's path: its accepted connections' own name

    def __len__(self) -> int:
        return len(self._peers)

    @property
    def num_silent(self) -> int:
        """Connections that have not sent a request yet."""
        return len(self._silent)

    def start(self, ctx: zmq.Context, router: zmq.Socket, max_peers: int, path: str) -> None:
        """Follow ``router``'s accepted and closed connections, keeping at most ``max_peers``;
        poll ``self.monitor`` for them. ``path``: the ipc path ``router`` binds. Call before it binds."""
        self.max_peers, self.path = max_peers, path
        self.batch = max(1, min(MONITOR_BATCH, max_peers // 4))
        router.monitor(MONITOR_ENDPOINT, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        monitor = ctx.socket(zmq.PAIR)
        monitor.setsockopt(zmq.RCVHWM, 1)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.connect(MONITOR_ENDPOINT)
        self.monitor = monitor

    def close(self) -> None:
        """Stop reading the monitor. The router's own close (and the context's term) end it;
        a monitor stopped here could wait on ZeroMQ's I/O thread, itself blocked on a full queue."""
        if self.monitor is not None:
            self.monitor.close(linger=0)
            self.monitor = None

    def drain(self) -> None:
        """Serve up to ``batch`` queued events, shutting down what is past the bound. Read the
        requests first: a client's connection must be known to have spoken."""
        assert self.monitor is not None
        for _ in range(self.batch):
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            event = parse_monitor_message(frames)
            if event["event"] == zmq.EVENT_ACCEPTED:
                self.accepted(int(event["value"]))
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.closed(int(event["value"]))

    def accepted(self, fd: int) -> None:
        """Count the connection ZeroMQ accepted on ``fd``; past the bound, shut one down."""
        if fd in self._peers:  # a close we did not see: count the new connection only
            self.closed(fd)
        now = self.clock()
        pid, inode = _identify(fd, self.path)
        self._peers[fd] = _Peer(pid, inode, now)
        if fd not in self._early or self._early.pop(fd) != inode or inode is None:
            self._silent[fd] = None
        if len(self._peers) > self.max_peers:
            self._shut_one(now)

    def spoke(self, fd: int | None) -> None:
        """The connection on ``fd`` sent a request: it is a client, never shut for the bound. One
        whose ``ACCEPTED`` is not read yet is remembered (fd and inode) until it is."""
        if fd is None or fd < 0:
            return
        peer = self._peers.get(fd)
        inode = _inode(fd)  # also for a known client: its entry may be a closed one's, the number reused
        if peer is not None and inode == peer.inode:
            self._silent.pop(fd, None)
            return
        self._early[fd] = inode  # its ACCEPTED is queued (the table's entry, if any, is a closed one's)
        if len(self._early) > MAX_EARLY:
            del self._early[next(iter(self._early))]

    def closed(self, fd: int) -> None:
        """Forget the connection ZeroMQ closed on ``fd`` (one never counted: nothing)."""
        if self._peers.pop(fd, None) is not None:
            self._silent.pop(fd, None)

    def _shut_one(self, now: float) -> None:
        """Shut down the oldest silent connection (the one just accepted when all others spoke)."""
        fd = next(iter(self._silent))
        peer = self._peers[fd]
        self.closed(fd)  # ZeroMQ's DISCONNECTED for it then finds nothing
        self.num_shut += 1
        _shut_down(fd, peer.inode)
        self.warnings.warning(
            "control-peers", "control socket: %d connections, the most it keeps: shut down one of "
            "process %d that sent no request in %.1f s", self.max_peers, peer.pid, now - peer.accepted_at,
        )


@contextmanager
def _borrowed(fd: int) -> Iterator[socket.socket]:
    """A ``socket`` over ZeroMQ's ``fd``, handed back without closing it (and with no fd of its own)."""
    sock = socket.socket(fileno=fd)
    try:
        yield sock
    finally:
        sock.detach()


def _identify(fd: int, path: str) -> tuple[int, int | None]:
    """``(peer pid, inode)`` of the connection on ``fd``; the inode is None unless ``fd`` names a
    socket accepted on ``path`` (it was closed, or its number reused by something else)."""
    try:
        inode = os.fstat(fd).st_ino
        with _borrowed(fd) as sock:
            if sock.family != socket.AF_UNIX or sock.getsockname() != path:
                return UNKNOWN_PID, None
            try:
                return peer_credentials(sock)[0], inode
            except OSError:  # its peer unreadable: counted, under no pid
                return UNKNOWN_PID, inode
    except OSError:
        return UNKNOWN_PID, None


def _inode(fd: int) -> int | None:
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None


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
