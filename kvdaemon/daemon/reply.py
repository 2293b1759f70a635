"""Replies owed to requests: answered at once, or later by whoever finishes the op.

An op handler gets the ``Call`` it serves. It returns a result (answered at
once), raises a ``KVDaemonError`` (answered with its code), or returns
``call.defer()``: a ``PendingReply`` that some later step completes exactly
once (a sleep answered when the tenant quiesced, a grow served when pages came
back). Completing sends through the server's reply sink; a second completion is
a no-op, so a racing timeout and success can never answer twice.

Cost: one encode and one sink call per reply.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from kvdaemon.errors import KVDaemonError
from kvdaemon.wire.protocol import reply_error, reply_ok

ReplySink = Callable[[bytes, bytes], None]
"""Sends ``payload`` to the control peer ``routing_id`` (the server's send, never blocking)."""


class PendingReply:
    """The reply to one request, sent once, later (see the module docstring)."""

    def __init__(self, sink: ReplySink, routing_id: bytes, request_id: int | None) -> None:
        self._sink = sink
        self.routing_id = routing_id
        self.request_id = request_id
        self.done = False

    def ok(self, result: object) -> None:
        """Answer with ``result`` (ignored when already answered)."""
        if not self.done:
            self.done = True
            self._sink(self.routing_id, reply_ok(self.request_id, result))

    def fail(self, error: KVDaemonError) -> None:
        """Answer with ``error``'s code and message (ignored when already answered)."""
        if not self.done:
            self.done = True
            self._sink(self.routing_id, reply_error(self.request_id, error))


class Call(NamedTuple):
    """One request being served: who asked, its id, and where late replies go.

    A named tuple (immutable, as a frozen dataclass, at half its cost to make: one per request).
    """

    routing_id: bytes
    request_id: int | None
    sink: ReplySink

    def defer(self) -> PendingReply:
        """The handle to answer this request later; the op returns it instead of a result."""
        return PendingReply(self.sink, self.routing_id, self.request_id)
