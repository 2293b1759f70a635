"""``GrantChannel``: a tenant's grows and shrinks over one plain socket round trip.

A second ``SOCK_SEQPACKET`` connection to the daemon's handle socket, attached
with ``"channel": "grants"`` (after the lease). Its caller sends a request
frame and reads, in order, the frames of the grant and then the reply: no
ZeroMQ I/O thread and no reader thread sit on the path, so a one-page grant
costs little more than a bare socket round trip plus the work at both ends.

The last grant frame usually travels inside its reply (``"frame"``), so a
small grant wakes this side once. Replies come in request order except for a grow the daemon parks while other
tenants give pages back: its reply arrives later, and its grant frames on the
lease's handle channel instead. The frames read before a reply belong to it.
A request not answered in time stays *outstanding*: its reply (and frames),
whenever read, are kept for ``collect``. One lock serialises callers.

Cost: one ``sendmsg`` and two or more ``recvmsg`` per request.
"""

from __future__ import annotations

import itertools
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from kvdaemon.errors import BadRequest, DaemonUnreachable, NoReply
from kvdaemon.wire.handles import close_fds, recv_frame, send_frame

Frame = tuple[dict[str, Any], list[int]]
ALIVE_POLL_S = 0.1


class GrantChannel:
    """The request/reply socket of one lease (see the module docstring)."""

    def __init__(self, sock: socket.socket, alive: Callable[[], bool]) -> None:
        self._sock = sock
        self._alive = alive
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._outstanding: set[int] = set()
        self._late: dict[int, tuple[dict[str, Any], list[Frame]]] = {}
        self._frames: list[Frame] = []  # read, waiting for the reply they precede
        self._poller = select.poll()  # not select.select: its fds must be under FD_SETSIZE (1024)
        self._poller.register(sock, select.POLLIN)

    @classmethod
    def open(cls, path: str, attach: dict[str, Any], timeout_s: float, alive: Callable[[], bool]) -> GrantChannel:
        """Connect and attach (``attach`` is the lease's attach frame); ``BadRequest``/... if refused."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
            send_frame(sock, {**attach, "channel": "grants"})
            body, fds = recv_frame(sock)
        except (OSError, ConnectionError) as exc:
            sock.close()
            raise DaemonUnreachable(f"cannot open a grant channel: {exc}") from exc
        close_fds(fds)
        if not body.get("ok"):
            sock.close()
            error = body.get("error") or {}
            raise BadRequest(f"grant channel refused: {error.get('message')}")
        sock.settimeout(None)  # reads wait in select, with the deadline; a frame read is whole
        return cls(sock, alive)

    def call(
        self, op: str, args: dict[str, Any], timeout_s: float, keep: bool = False
    ) -> tuple[dict[str, Any], list[Frame]]:
        """Send one request; return its reply and the grant frames that came before it.

        ``NoReply`` (carrying ``request_id``) after ``timeout_s``; with ``keep``
        the request stays outstanding (see ``collect``), else its reply is
        dropped when it comes. ``DaemonUnreachable`` once ``alive()`` fails, or
        when the socket is closed under the send (the daemon died or stopped).
        """
        with self._lock:
            request_id = next(self._ids)
            try:
                send_frame(self._sock, {"id": request_id, "op": op, "args": args})
            except OSError as exc:  # a broken pipe or reset: the daemon's end is gone
                raise DaemonUnreachable(f"the grant channel closed: {exc}") from exc
            found = self._read_until(request_id, time.monotonic() + timeout_s)
            if found is None:
                if keep:
                    self._outstanding.add(request_id)
                error = NoReply(f"the daemon did not answer {op!r} within {timeout_s:g} s")
                error.request_id = request_id  # type: ignore[attr-defined]
                raise error
            return found

    def collect(self, request_id: int) -> tuple[dict[str, Any], list[Frame]] | None:
        """The late reply to outstanding ``request_id`` if it has come (never blocks)."""
        with self._lock:
            if request_id not in self._late:
                self._read_until(-1, 0.0)
            found = self._late.pop(request_id, None)
            if found is not None:
                self._outstanding.discard(request_id)
            return found

    def abandon(self, request_id: int) -> None:
        """Forget outstanding ``request_id``: its reply and grant frames, had or to come, are
        dropped (their fds closed)."""
        with self._lock:
            self._outstanding.discard(request_id)
            _, frames = self._late.pop(request_id, (None, []))
            for _, fds in frames:
                close_fds(fds)

    def close(self) -> None:
        with self._lock:
            for _, frames in self._late.values():
                for _, fds in frames:
                    close_fds(fds)
            for _, fds in self._frames:
                close_fds(fds)
            self._late.clear()
            self._frames.clear()
            self._sock.close()

    def _read_until(self, request_id: int, deadline: float) -> tuple[dict[str, Any], list[Frame]] | None:
        """Read frames until the reply to ``request_id``; keep outstanding ones. Lock held."""
        while True:
            left = deadline - time.monotonic()
            ready = self._poller.poll(1000 * max(0.0, min(left, ALIVE_POLL_S)))  # poll: any fd number
            if not ready:
                if not self._alive():
                    raise DaemonUnreachable("the daemon went away during a grant request")
                if left <= 0:
                    return None
                continue
            try:
                body, fds = recv_frame(self._sock)
            except (ConnectionError, OSError) as exc:
                raise DaemonUnreachable(f"the grant channel closed: {exc}") from exc
            if "grant_id" in body and "ok" not in body:
                self._frames.append((body, fds))
                continue
            frame = body.pop("frame", None)
            if isinstance(frame, dict):  # the last grant frame came with its reply
                self._frames.append((frame, fds))
            else:
                close_fds(fds)
            frames, self._frames = self._frames, []
            rid = body.get("id")
            if rid == request_id:
                return body, frames
            if rid in self._outstanding:
                self._late[rid] = (body, frames)
            else:
                for _, dropped in frames:
                    close_fds(dropped)
