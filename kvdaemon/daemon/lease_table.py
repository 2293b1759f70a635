"""The daemon's handle channel: accepted connections, attaches, queued frames, leases.

Every connection is non-blocking with its own ``Outbox``, so a slow or stuck
client never stalls the daemon's loop. A connection becomes a tenant's *lease*
once it sends a valid attach frame; when it closes (EOF, a protocol violation,
a failed send) the table calls ``end_lease``, which frees the tenant's pages.

A failed send only marks the connection dead: sends happen inside ops that hold
the service lock, and ending a lease takes that lock, so the close waits for
``close_dead`` at the end of the loop iteration.

Cost: O(1) per event, plus a scan of the connections in ``expire``.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvdaemon.errors import BadRequest, KVDaemonError
from kvdaemon.wire.handles import Outbox, check_same_uid, close_fds, recv_frame

log = logging.getLogger("kvdaemon.leases")
MAX_UNATTACHED = 256

AttachFn = Callable[[str, str, int], int]
EndLeaseFn = Callable[[int, str, bool], None]


@dataclass
class Conn:
    """One accepted handle connection; ``tenant_id`` is set once attached."""

    sock: socket.socket
    outbox: Outbox
    pid: int
    accepted_at: float = field(default_factory=time.monotonic)
    tenant_id: int | None = None


class LeaseTable:
    """Handle connections of one daemon, registered on the daemon's poller.

    ``attach(name, token, pid)`` returns the tenant id or raises a
    ``KVDaemonError``; ``end_lease(tenant_id, why, expired)`` frees a tenant.
    """

    def __init__(self, poller: zmq.Poller, attach: AttachFn, end_lease: EndLeaseFn) -> None:
        self._poller = poller
        self._attach_fn = attach
        self._end_lease = end_lease
        self._listener: socket.socket | None = None
        self.conns: dict[int, Conn] = {}
        self.leases: dict[int, Conn] = {}
        self._dead: list[tuple[Conn, str]] = []

    def bind(self, path: str) -> int:
        """Listen on ``path`` (the caller sets the umask and mode); return the listener's fd."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(path)
        listener.listen(64)
        listener.setblocking(False)
        self._listener = listener
        self._poller.register(listener.fileno(), zmq.POLLIN)
        return listener.fileno()

    def accept(self) -> None:
        """Accept every pending peer running as our uid, up to ``MAX_UNATTACHED`` waiting."""
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # out of fds: refuse new peers, keep serving the rest
                log.warning("cannot accept a handle connection: %s", exc)
                return
            if sum(1 for c in self.conns.values() if c.tenant_id is None) >= MAX_UNATTACHED:
                log.warning("too many unattached handle connections; refusing one")
                sock.close()
                continue
            try:
                pid = check_same_uid(sock)
            except KVDaemonError as exc:
                log.warning("refused handle connection: %s", exc)
                sock.close()
                continue
            sock.setblocking(False)
            self.conns[sock.fileno()] = Conn(sock, Outbox(sock), pid)
            self._poller.register(sock.fileno(), zmq.POLLIN)

    def handle_events(self, events: dict[Any, int]) -> None:
        """Flush and read the connections the poller reported."""
        for fd, conn in list(self.conns.items()):
            flags = events.get(fd, 0)
            if flags & zmq.POLLOUT:
                self.flush(conn)
            if flags & (zmq.POLLIN | zmq.POLLERR):
                self._read(conn)

    def _read(self, conn: Conn) -> None:
        try:
            body, fds = recv_frame(conn.sock)
        except BlockingIOError:
            return
        except (ConnectionError, OSError, KVDaemonError) as exc:
            self.close(conn, f"handle channel closed: {exc}")
            return
        close_fds(fds)  # clients never send fds
        if conn.tenant_id is not None:
            conn.outbox.push({"notice": "revoked", "args": {"why": "unexpected frame"}})
            self.flush(conn)
            self.close(conn, "unexpected frame on an attached handle channel")
            return
        self._attach(conn, body)

    def _attach(self, conn: Conn, body: dict[str, Any]) -> None:
        name, token = body.get("tenant"), body.get("token")
        try:
            if not isinstance(name, str) or not isinstance(token, str):
                raise BadRequest("attach needs string fields 'tenant' and 'token'")
            tenant_id = self._attach_fn(name, token, conn.pid)
        except KVDaemonError as exc:
            conn.outbox.push({"ok": False, "error": {"code": exc.code, "message": exc.message}})
            self.flush(conn)
            self.close(conn, f"attach refused: {exc}")
            return
        conn.tenant_id = tenant_id
        self.leases[tenant_id] = conn
        conn.outbox.push({"ok": True, "tenant_id": tenant_id})
        self.flush(conn)

    def flush(self, conn: Conn) -> None:
        """Send what the socket takes; watch for writability while frames remain."""
        try:
            done = conn.outbox.flush()
        except OSError as exc:
            self._dead.append((conn, f"send failed: {exc}"))
            return
        fd = conn.sock.fileno()
        if fd in self.conns:
            self._poller.register(fd, zmq.POLLIN if done else zmq.POLLIN | zmq.POLLOUT)

    def close_dead(self) -> None:
        """Close the connections whose sends failed during the last ops."""
        while self._dead:
            conn, why = self._dead.pop()
            self.close(conn, why)

    def close(self, conn: Conn, why: str, expired: bool = True) -> None:
        """Close a connection; an attached one ends its tenant's lease."""
        fd = conn.sock.fileno()
        if self.conns.pop(fd, None) is None:
            return
        self._poller.unregister(fd)
        conn.outbox.discard()
        conn.sock.close()
        if conn.tenant_id is not None:
            self.leases.pop(conn.tenant_id, None)
            self._end_lease(conn.tenant_id, why, expired)

    def expire(self, now: float, timeout_s: float) -> None:
        """Close connections that did not attach within ``timeout_s``."""
        for conn in list(self.conns.values()):
            if conn.tenant_id is None and now - conn.accepted_at > timeout_s:
                self.close(conn, "no attach frame in time")

    def close_all(self) -> None:
        """Close every connection and the listener (daemon shutdown: not lease expiries)."""
        for conn in list(self.conns.values()):
            self.close(conn, "daemon shutting down", expired=False)
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    # -- LeasePort (called by the service) -------------------------------------

    def send_grant(
        self, tenant_id: int, grant_id: int, page_ids: list[int], fds: list[int],
        fd_index: list[int],
    ) -> None:
        conn = self.leases[tenant_id]
        conn.outbox.push_grant(grant_id, page_ids, fds, fd_index)
        self.flush(conn)

    def send_notice(self, tenant_id: int, body: dict[str, Any]) -> None:
        conn = self.leases.get(tenant_id)
        if conn is not None:
            conn.outbox.push(body)
            self.flush(conn)

    def drop_lease(self, tenant_id: int) -> None:
        conn = self.leases.pop(tenant_id, None)
        if conn is not None:
            conn.tenant_id = None
            self.close(conn, "unregistered")
