"""The daemon's handle channel: accepted connections, attaches, queued frames, leases.

Every connection is non-blocking with its own ``Outbox``, so a slow or stuck
client never stalls the daemon's loop. A connection becomes a tenant's *lease*
once it sends a valid attach frame; when it closes (EOF, a protocol violation,
a failed send) the table calls ``end_lease``, which frees the tenant's pages.

A failed send only marks the connection dead: sends happen inside ops that hold
the service lock, and ending a lease takes that lock, so the close waits for
``close_dead`` at the end of the loop iteration.

A peer whose pid reads 0 (it runs in a pid namespace the daemon cannot see) is
refused at attach (``FORBIDDEN``, saying why): the daemon could not tell when
its process is gone, so it could not quarantine what that process still maps.

Hostile peers (same uid: anything else is refused at accept) are bounded:

- fds: the kernel refuses fds sent to the daemon where it can; whatever arrives,
  and every connection the table closes, is closed by an ``FdCloser`` thread,
  never on the loop (the last close of a lingering socket blocks for seconds).
- unread grants: the table holds at most ``fd_budget`` fds (connections, queued
  and unread grant fds, fds waiting to be closed), set below the soft
  ``RLIMIT_NOFILE`` with headroom for ZeroMQ and the backend. Over it, the lease
  holding the most unread fds is revoked (told, closed, its pages freed); while
  the rest alone is over it, no new connection is accepted.
- unread notices and replies: a connection whose queued frames pass
  ``MAX_QUEUED_BYTES`` (a peer that stopped reading while the daemon kept
  telling it things: hours of reclaim asks, or a flood of its own limit
  changes) is revoked the same way, so no peer grows the daemon's memory.
- silent connections: at most ``MAX_UNATTACHED`` wait to attach, and at most
  ``MAX_UNATTACHED_PER_PID`` per peer pid. A new one that finds them full
  evicts the oldest of the pid holding the most, so connections that never
  speak cannot keep a new tenant out; an attach frame sent with the connect is
  served at accept.
- warnings any peer can trigger are rate-limited (``LogThrottle``).

Grant channels: an attached tenant may open one more connection, attached with
``"channel": "grants"``, on which it sends ``grow`` and ``shrink`` requests and
reads their replies, each preceded by the frames of its grant: one plain
socket round trip, without ZeroMQ's I/O threads or the client's reader thread.
Requests are served in order. A grant channel and its lease end together:
a grant in flight on a channel that closed leaves both sides unsure of it.

Cost: O(1) per event; O(leases) per grant frame to check the fd budget, plus
a scan of the waiting connections per accept.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvdaemon.daemon.fd_closer import FdCloser
from kvdaemon.daemon.log_throttle import LogThrottle
from kvdaemon.errors import BadRequest, Conflict, Forbidden, KVDaemonError
from kvdaemon.wire.handles import (
    Outbox, check_same_uid, close_fds, recv_frame, refuse_fds,
)
from kvdaemon.wire.protocol import REQUEST_LIMITS

log = logging.getLogger("kvdaemon.leases")
MAX_UNATTACHED = 256
MAX_UNATTACHED_PER_PID = 16
MAX_ACCEPTS_PER_ROUND = 64
LISTEN_BACKLOG = 512
MAX_QUEUED_BYTES = 4 << 20  # a connection's unsent frames; past it its lease is revoked
FD_RESERVE_MIN = 256  # fds kept for ZeroMQ's connections, the backend, logs, metrics
POLLIN, POLLOUT = int(zmq.POLLIN), int(zmq.POLLOUT)  # plain ints: flag enums cost on every event
READABLE = POLLIN | int(zmq.POLLERR)

AttachFn = Callable[[str, str, int], tuple[int, dict[str, Any]]]
"""Binds a lease: (name, token, pid) -> (tenant id, what its ``ok`` reply tells besides)."""
GrantsAttachFn = Callable[[str, str, int], int]
EndLeaseFn = Callable[[int, str, bool], None]
RequestFn = Callable[[dict[str, Any], Callable[[bytes, bytes], None]], bytes | None]
"""Serves one decoded request with the given reply sink; returns the reply, or None if deferred."""


UNSEEN_PEER = (
    "the handle-socket peer runs in a pid namespace this daemon cannot see (its pid reads 0), so the "
    "daemon could not tell when its process is gone and could hand its pages to another tenant while "
    "it still maps them: run the daemon in the host's pid namespace (Kubernetes: hostPID: true; "
    "docker run --pid=host) or in the engines' own"
)


def _channel(conn: Conn) -> str:
    """``handle channel`` or ``grant channel``: which of a tenant's connections, for the log."""
    return "grant channel" if conn.grants else "handle channel"


def fd_budget(soft_limit: int) -> int:
    """The fds the handle channel may hold under ``soft_limit``.

    A quarter of the limit, and at least ``FD_RESERVE_MIN`` fds, stay free for the
    rest of the daemon; under a tiny limit, half.
    """
    return max(soft_limit // 2, soft_limit - max(FD_RESERVE_MIN, soft_limit // 4))


@dataclass
class Conn:
    """One accepted handle connection; ``tenant_id`` is set once attached.

    ``closing`` is why the connection is being closed, once it is: nothing more
    is queued to it.
    """

    sock: socket.socket
    outbox: Outbox
    pid: int
    accepted_at: float = field(default_factory=time.monotonic)
    tenant_id: int | None = None
    closing: str | None = None
    grants: bool = False  # a tenant's grant channel, not its lease
    watching_out: bool = False  # registered for POLLOUT (frames wait for room)


class LeaseTable:
    """Handle connections of one daemon, registered on the daemon's poller.

    ``attach(name, token, pid)`` returns the tenant id or raises a
    ``KVDaemonError``; ``end_lease(tenant_id, why, expired)`` frees a tenant.
    """

    def __init__(
        self, poller: zmq.Poller, attach: AttachFn, end_lease: EndLeaseFn,
        attach_grants: GrantsAttachFn | None = None, serve_request: RequestFn | None = None,
    ) -> None:
        self._poller = poller
        self._attach_fn = attach
        self._end_lease = end_lease
        self._attach_grants_fn = attach_grants
        self._serve_request = serve_request
        self.grant_conns: dict[int, Conn] = {}
        self._serving: Conn | None = None  # the grant channel whose request is being served
        self._listener: socket.socket | None = None
        self._accepting = False
        self.conns: dict[int, Conn] = {}
        self.leases: dict[int, Conn] = {}
        self._waiting: dict[int, Conn] = {}  # unattached, oldest first
        self._dead: list[tuple[Conn, str]] = []
        self._closer = FdCloser()
        self.warnings = LogThrottle(log)
        self.fds_refused = False  # whether the kernel refuses fds sent to us
        self.fd_budget = 0  # set by ``bind`` from the soft RLIMIT_NOFILE

    def bind(self, path: str) -> int:
        """Listen on ``path`` (the caller sets the umask and mode); return the listener's fd.

        Call after raising the soft ``RLIMIT_NOFILE``: the fd budget is derived from it.
        """
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(path)
        self.fds_refused = refuse_fds(listener)
        listener.listen(LISTEN_BACKLOG)
        listener.setblocking(False)
        self._listener = listener
        self.fd_budget = fd_budget(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        self._closer.start()
        self._set_accepting(True)
        return listener.fileno()

    # -- accepting ---------------------------------------------------------------

    def accept(self) -> None:
        """Accept pending peers running as our uid, at most ``MAX_ACCEPTS_PER_ROUND``."""
        assert self._listener is not None
        for _ in range(MAX_ACCEPTS_PER_ROUND):
            if self.num_held_fds() >= self.fd_budget:
                self.warnings.warning("paused", "handle channel over its fd budget; not accepting")
                self._set_accepting(False)
                return
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # out of fds: refuse new peers, keep serving the rest
                self.warnings.warning("accept", "cannot accept a handle connection: %s", exc)
                return
            try:
                pid = check_same_uid(sock)
            except KVDaemonError as exc:
                self.warnings.warning("refused", "refused handle connection: %s", exc)
                self._closer.close_socket(sock)
                continue
            sock.setblocking(False)
            self._make_room(pid)
            conn = Conn(sock, Outbox(sock), pid)
            self.conns[sock.fileno()] = conn
            self._waiting[sock.fileno()] = conn
            self._poller.register(sock.fileno(), POLLIN)
            self._read(conn)  # an attach frame sent right after connect is served now

    def _make_room(self, pid: int) -> None:
        """Evict a waiting connection if ``pid``'s or everyone's quota of them is full."""
        per_pid = Counter(conn.pid for conn in self._waiting.values())
        if per_pid[pid] >= MAX_UNATTACHED_PER_PID:
            hog = pid
        elif len(self._waiting) >= MAX_UNATTACHED:
            hog = max(per_pid, key=lambda p: per_pid[p])
        else:
            return
        oldest = next(conn for conn in self._waiting.values() if conn.pid == hog)
        self.warnings.warning(
            "evicted", "too many handle connections waiting to attach; closed one of pid %d", hog
        )
        self.close(oldest, "evicted: too many connections waiting to attach")

    def _set_accepting(self, accepting: bool) -> None:
        if self._listener is None or accepting == self._accepting:
            return
        if accepting:
            self._poller.register(self._listener.fileno(), POLLIN)
        else:
            self._poller.unregister(self._listener.fileno())
        self._accepting = accepting

    # -- reading -----------------------------------------------------------------

    def handle_events(self, events: dict[Any, int]) -> None:
        """Flush and read the connections the poller reported."""
        for fd, flags in list(events.items()):
            conn = self.conns.get(fd) if isinstance(fd, int) else None
            if conn is None:
                continue
            if flags & POLLOUT:
                self.flush(conn)
            if flags & READABLE and conn.closing is None:
                self._read(conn)

    def _read(self, conn: Conn) -> None:
        try:
            body, fds = recv_frame(conn.sock, REQUEST_LIMITS, self._closer.close_fds)
        except BlockingIOError:
            return
        except KVDaemonError as exc:  # undecodable, truncated, too many fds
            if conn.tenant_id is None or conn.grants:  # a peer waiting for a reply is told why
                conn.outbox.push({"ok": False, "error": {"code": exc.code, "message": exc.message}})
                self.flush(conn)
            self.close(conn, f"{_channel(conn)} closed: {exc}")
            return
        except (ConnectionError, OSError) as exc:
            self.close(conn, f"{_channel(conn)} closed: {exc}")
            return
        self._closer.close_fds(fds)  # clients never send fds
        if conn.grants:
            self._request(conn, body)
            return
        if conn.tenant_id is not None:
            self._revoke(conn, "unexpected frame")
            self.close(conn, "unexpected frame on an attached handle channel")
            return
        self._attach(conn, body)

    def _attach(self, conn: Conn, body: dict[str, Any]) -> None:
        name, token = body.get("tenant"), body.get("token")
        try:
            if not isinstance(name, str) or not isinstance(token, str):
                raise BadRequest("attach needs string fields 'tenant' and 'token'")
            if conn.pid <= 0:
                raise Forbidden(UNSEEN_PEER)
            if body.get("channel") == "grants":
                self._attach_grants(conn, name, token)
                return
            tenant_id, told = self._attach_fn(name, token, conn.pid)
        except KVDaemonError as exc:
            conn.outbox.push({"ok": False, "error": {"code": exc.code, "message": exc.message}})
            self.flush(conn)
            self.close(conn, f"attach refused: {exc}")
            return
        conn.tenant_id = tenant_id
        self._waiting.pop(conn.sock.fileno(), None)
        self.leases[tenant_id] = conn
        conn.outbox.push({**told, "ok": True, "tenant_id": tenant_id})
        self.flush(conn)

    def _attach_grants(self, conn: Conn, name: str, token: str) -> None:
        """Bind ``conn`` as the grant channel of an attached tenant (one per tenant)."""
        if self._attach_grants_fn is None or self._serve_request is None:
            raise BadRequest("this daemon has no grant channels")
        tenant_id = self._attach_grants_fn(name, token, conn.pid)
        if tenant_id in self.grant_conns:
            raise Conflict(f"tenant {name!r} already has a grant channel")
        conn.tenant_id, conn.grants = tenant_id, True
        self._waiting.pop(conn.sock.fileno(), None)
        self.grant_conns[tenant_id] = conn
        conn.outbox.push({"ok": True, "tenant_id": tenant_id})
        self.flush(conn)

    def _request(self, conn: Conn, body: dict[str, Any]) -> None:
        """Serve a grow or shrink from a grant channel; its grant frames go out on it too."""
        assert self._serve_request is not None
        if body.get("op") not in ("grow", "shrink"):
            body = {"id": body.get("id"), "op": "grant-channel:" + str(body.get("op"))[:32]}
        self._serving = conn
        try:
            reply = self._serve_request(body, lambda _rid, payload: self._reply(conn, payload))
        finally:
            self._serving = None
        if reply is not None:
            self._reply(conn, reply)

    def _reply(self, conn: Conn, payload: bytes) -> None:
        if conn.closing is None and conn.sock.fileno() in self.conns:
            conn.outbox.push_reply(payload)
            self.flush(conn)
            self._bound_bytes(conn)

    # -- sending -----------------------------------------------------------------

    def flush(self, conn: Conn) -> None:
        """Send what the socket takes; watch for writability while frames remain."""
        try:
            done = conn.outbox.flush()
        except OSError as exc:
            self._mark_dead(conn, f"send failed: {exc}")
            return
        fd = conn.sock.fileno()
        if fd in self.conns and conn.watching_out == done:  # watch for room only while frames wait
            conn.watching_out = not done
            self._poller.register(fd, POLLIN if done else POLLIN | POLLOUT)

    def num_held_fds(self) -> int:
        """Fds the handle channel holds: connections, unread grant fds, fds being closed."""
        unread = sum(conn.outbox.num_unread_fds for conn in self.leases.values())
        unread += sum(conn.outbox.num_unread_fds for conn in self.grant_conns.values())
        return len(self.conns) + unread + self._closer.num_pending

    def _bound_fds(self) -> None:
        """Revoke the connections (leases or grant channels: either ends its lease) holding the
        most unread fds while over ``fd_budget``. O(connections) while over it."""
        if self.num_held_fds() <= self.fd_budget:
            return
        conns = [*self.leases.values(), *self.grant_conns.values()]
        for conn in conns:
            conn.outbox.refresh()  # count only what peers have not read by now
        while self.num_held_fds() > self.fd_budget:
            live = [conn for conn in conns if conn.closing is None]
            hog = max(live, key=lambda conn: conn.outbox.num_unread_fds, default=None)
            if hog is None or hog.outbox.num_unread_fds == 0:
                return
            self._revoke(
                hog, f"{hog.outbox.num_unread_fds} page fds unread, over the daemon's "
                f"budget of {self.fd_budget}",
            )

    def _bound_bytes(self, conn: Conn) -> None:
        """Revoke ``conn`` (its lease, or its grant channel and so its lease) once its unsent
        frames pass ``MAX_QUEUED_BYTES``: its peer has stopped reading."""
        queued = conn.outbox.num_queued_bytes
        if queued > MAX_QUEUED_BYTES and conn.closing is None:
            self._revoke(conn, f"{queued} bytes of frames unread, over the daemon's bound of {MAX_QUEUED_BYTES}")

    def _revoke(self, conn: Conn, why: str) -> None:
        """Tell the peer its lease is revoked and close the connection after this loop round (a
        grant channel's: its lease too, told there, where the pool reads its notices)."""
        lease = self.leases.get(conn.tenant_id) if conn.grants else None  # type: ignore[arg-type]
        if lease is not None and lease.closing is None:
            conn.outbox.discard()  # its grants' fds close now
            self._mark_dead(conn, f"revoked: {why}")
            conn = lease
        self.warnings.warning("revoked", "revoked a lease of pid %d: %s", conn.pid, why)
        conn.outbox.discard()  # grants it has not read: their fds close now
        conn.outbox.push({"notice": "revoked", "args": {"why": why}})
        self.flush(conn)
        self._mark_dead(conn, f"revoked: {why}")

    def _mark_dead(self, conn: Conn, why: str) -> None:
        if conn.closing is None:
            conn.closing = why
            self._dead.append((conn, why))

    # -- closing -----------------------------------------------------------------

    def close_dead(self) -> None:
        """Close the connections whose sends failed during the last ops; resume accepting."""
        while self._dead:
            conn, why = self._dead.pop()
            self.close(conn, why)
        if not self._accepting and self.num_held_fds() < self.fd_budget:
            self._set_accepting(True)

    def close(self, conn: Conn, why: str, expired: bool = True) -> None:
        """Close a connection; an attached one ends its tenant's lease.

        The peer sees EOF at once (``shutdown``); the socket itself is closed by
        the closer thread, as its unread frames may hold fds whose release blocks.
        """
        fd = conn.sock.fileno()
        if self.conns.pop(fd, None) is None:
            return
        self._waiting.pop(fd, None)
        conn.closing = conn.closing or why
        self._poller.unregister(fd)
        conn.outbox.discard()
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_RDWR)
        self._closer.close_socket(conn.sock)
        if conn.grants:  # a grant in flight may be lost with it: the lease ends too
            self.grant_conns.pop(conn.tenant_id, None)  # type: ignore[arg-type]
            lease = self.leases.get(conn.tenant_id)  # type: ignore[arg-type]
            if lease is not None:
                self.close(lease, why, expired)
        elif conn.tenant_id is not None:
            self.leases.pop(conn.tenant_id, None)
            grant_conn = self.grant_conns.get(conn.tenant_id)
            if grant_conn is not None:
                self.close(grant_conn, "its lease ended")
            self._end_lease(conn.tenant_id, why, expired)

    def expire(self, now: float, timeout_s: float) -> None:
        """Close connections that did not attach within ``timeout_s``; report counted warnings."""
        for conn in list(self._waiting.values()):
            if now - conn.accepted_at <= timeout_s:
                break  # oldest first: the rest are younger
            self.close(conn, "no attach frame in time")
        self.warnings.flush()

    def close_all(self) -> None:
        """Close every connection and the listener (daemon shutdown: not lease expiries)."""
        for conn in list(self.conns.values()):
            self.close(conn, "daemon shutting down", expired=False)
        if self._listener is not None:
            self._set_accepting(False)
            self._closer.close_socket(self._listener)
            self._listener = None
        self._closer.stop()

    # -- LeasePort (called by the service) -------------------------------------

    def send_grant(
        self, tenant_id: int, grant_id: int, page_ids: list[int], fds: list[int],
        fd_index: list[int],
    ) -> None:
        serving = self._serving
        conn = serving if serving is not None and serving.tenant_id == tenant_id else self.leases[tenant_id]
        if conn.closing is not None:  # revoked or dead: the frames could never be read
            close_fds(fds)
            return
        conn.outbox.push_grant(grant_id, page_ids, fds, fd_index)
        if conn is not serving:  # a grant channel's frames go out with the reply, back to back
            self.flush(conn)
        self._bound_fds()

    def send_notice(self, tenant_id: int, body: dict[str, Any]) -> None:
        conn = self.leases.get(tenant_id)
        if conn is not None and conn.closing is None:
            conn.outbox.push(body)
            self.flush(conn)
            self._bound_bytes(conn)

    def drop_lease(self, tenant_id: int) -> None:
        """Close a tenant's connections without ending its lease (it unregistered)."""
        conn = self.leases.pop(tenant_id, None)
        if conn is not None:
            conn.tenant_id = None
        grant_conn = self.grant_conns.get(tenant_id)
        if grant_conn is not None:
            self.close(grant_conn, "unregistered")
        if conn is not None:
            self.close(conn, "unregistered")
