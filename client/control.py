"""``ControlChannel``: one DEALER connection to a daemon's control socket.

Each request carries an id; its reply is matched by id. Three ways to wait:

- ``call``: at most ``timeout_s``, then ``NoReply``; its late reply will be
  dropped (ids never repeat). Unless the channel ``keeps`` its socket, the
  socket is dropped too, so a request still queued for a daemon that never
  read it cannot reach the next daemon on that directory (an operator's
  ``shutdown`` must not stop a later daemon). For requests whose outcome the
  caller need not learn (status, hello) or may retry safely.
- ``call_keep``: at most ``timeout_s``; then the request stays *outstanding*
  and ``NoReply`` carries its id. Its reply, when it comes, is kept for
  ``collect``: a grow the caller stopped waiting for is still adopted or given
  back, never lost.
- ``call_until_answered``: as long as the daemon lives. For the steps of an
  exchange whose answer decides what both sides do (a sleep): a timeout is
  not a decision.

A channel may be given ``alive``, a cheap test that the daemon still lives (a
lease's handle channel is open): every wait checks it each ``ALIVE_POLL_S`` and
ends with ``DaemonUnreachable`` as soon as it fails, instead of at the timeout.

Before the first connect the daemon's directory is checked (ours, 0700, not a
symlink): a client never talks to a daemon another user could have planted.
Unsolicited messages are dropped. All calls hold one lock, so threads may share
a channel; a call blocks others for as long as it waits.

Cost: one send and one or more receives per call (ZeroMQ over a unix socket).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from kvdaemon.errors import DaemonUnreachable, NoReply
from kvdaemon.wire.paths import DaemonPaths, check_private_dir, running_pid
from kvdaemon.wire.protocol import MAX_MESSAGE_BYTES, decode, request, result_of

log = logging.getLogger("kvdaemon.client")
ALIVE_POLL_S = 0.1  # how often a wait checks ``alive()``
STILL_WAITING_S = 30.0  # ``call_until_answered`` says it is still waiting this often


class ControlChannel:
    """Requests and replies to the daemon at ``paths`` (see the module docstring)."""

    def __init__(
        self, paths: DaemonPaths, timeout_s: float, alive: Callable[[], bool] = lambda: True,
        keep: bool = False,
    ) -> None:
        self.paths = paths
        self.timeout_s = timeout_s
        self.alive = alive
        self.keep = keep  # a lease's channel: a slow reply must not cost outstanding grows
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sock: zmq.Socket | None = None
        self._outstanding: set[int] = set()
        self._late: dict[int, dict[str, Any]] = {}

    def unreachable(self) -> DaemonUnreachable:
        return DaemonUnreachable(
            f"no kvdaemon running at {self.paths.root} — start it with `kvdaemon start`"
        )

    def _gone(self) -> DaemonUnreachable:
        """The daemon asked is not the one at the directory now: none runs there, or another."""
        now = "no kvdaemon runs there now" if running_pid(self.paths) is None else "another took its place"
        return DaemonUnreachable(
            f"the kvdaemon at {self.paths.root} went away before it answered ({now}); the request "
            "may not have been carried out"
        )

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            if not self.paths.control_socket.exists():
                raise self.unreachable()
            check_private_dir(self.paths.root)
            # The process-wide context: never terminated here, so closing a channel
            # can never block on another channel's sockets.
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            sock.connect(self.paths.control_endpoint)
            self._sock = sock
        return self._sock

    def reset(self) -> None:
        """Drop the socket: replies still on their way are lost, outstanding ones too."""
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._outstanding.clear()
        self._late.clear()

    def call(self, op: str, args: dict[str, Any], timeout_s: float | None = None) -> Any:
        """Send one request and return its result; ``NoReply`` (socket dropped) after ``timeout_s``."""
        with self._lock:
            request_id = self._send(op, args)
            reply = self._wait(request_id, self._deadline(timeout_s))
            if reply is None:
                if not self.keep:
                    self._drop()
                raise self._no_reply(op, timeout_s)
            return result_of(reply)

    def call_keep(self, op: str, args: dict[str, Any], timeout_s: float | None = None) -> Any:
        """As ``call``, but a request not answered in time stays outstanding (see ``collect``)."""
        with self._lock:
            request_id = self._send(op, args)
            reply = self._wait(request_id, self._deadline(timeout_s))
            if reply is None:
                self._outstanding.add(request_id)
                error = self._no_reply(op, timeout_s)
                error.request_id = request_id  # type: ignore[attr-defined]
                raise error
            return result_of(reply)

    def call_until_answered(self, op: str, args: dict[str, Any]) -> Any:
        """Send one request and wait for its reply while ``alive()``; ``DaemonUnreachable`` once not.
        Every ``STILL_WAITING_S`` without one it logs a warning (the daemon is alive, but
        stopped or hung: whoever waits on this, an engine held for a sleep, waits with it)."""
        with self._lock:
            request_id, started = self._send(op, args), time.monotonic()
            while (reply := self._wait(request_id, time.monotonic() + STILL_WAITING_S)) is None:
                waited_s = time.monotonic() - started
                log.warning("the kvdaemon at %s has not answered %r for %.0f s; it is alive (a long copy, or "
                            "stopped or hung): waiting on", self.paths.root, op, waited_s)  # fmt: skip
            return result_of(reply)

    def collect(self, request_id: int) -> dict[str, Any] | None:
        """The late reply to outstanding ``request_id`` if it has come (never blocks), else None."""
        with self._lock:
            if request_id not in self._late and self._sock is not None:
                self._wait(-1, 0.0)  # take in whatever has arrived
            reply = self._late.pop(request_id, None)
            if reply is not None:
                self._outstanding.discard(request_id)
            return reply

    def abandon(self, request_id: int) -> None:
        """Forget outstanding ``request_id``: its reply, had or to come, is dropped."""
        with self._lock:
            self._outstanding.discard(request_id)
            self._late.pop(request_id, None)

    def close(self) -> None:
        self.reset()

    # -- internals (lock held) -------------------------------------------------

    def _deadline(self, timeout_s: float | None) -> float:
        return time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)

    def _no_reply(self, op: str, timeout_s: float | None) -> NoReply:
        wait = self.timeout_s if timeout_s is None else timeout_s
        return NoReply(
            f"the kvdaemon at {self.paths.root} did not answer {op!r} within {wait:g} s"
        )

    def _send(self, op: str, args: dict[str, Any]) -> int:
        sock = self._socket()
        request_id = next(self._ids)
        sock.send(request(request_id, op, args))
        return request_id

    def _wait(self, request_id: int, deadline: float) -> dict[str, Any] | None:
        """The reply to ``request_id`` by ``deadline``; others are kept (outstanding) or dropped.

        ``DaemonUnreachable`` (socket dropped) as soon as ``alive()`` fails.
        """
        sock = self._sock
        assert sock is not None
        while True:
            left_s = deadline - time.monotonic()
            if not sock.poll(int(max(0.0, min(left_s, ALIVE_POLL_S)) * 1000), zmq.POLLIN):
                if not self.alive():
                    self._drop()
                    raise self._gone()
                if left_s <= ALIVE_POLL_S:
                    return None
                continue
            message = decode(sock.recv())
            rid = message.get("id")
            if rid == request_id:
                return message
            if rid in self._outstanding:
                self._late[rid] = message
            else:
                log.debug("dropped an unsolicited control message: %.100r", message)
