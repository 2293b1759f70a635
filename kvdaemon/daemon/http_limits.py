"""A WSGI server whose cost is bounded whatever its clients do.

:func:`bounded_server` builds a :class:`BoundedServer`: one thread per request
as ``ThreadingMixIn`` would, but

- at most ``max_handlers`` requests are handled at once (so the process never
  holds more than ``max_handlers + 1`` server threads); a connection accepted
  when all are busy takes the slot of the oldest one still sending its
  request (a slow or silent client is closed, a request whose head has come is
  served), waiting at most ``SLOT_WAIT_S``, else it is closed unanswered: slow
  clients cannot keep ``/healthz`` or a scrape out;
- a request must arrive whole (request line and headers) within
  ``request_timeout_s`` of its connection, however slowly its bytes trickle in,
  and every read or write waits at most that long;
- nothing is printed per request or per failed request.

Serving never resolves host names (the standard server calls ``getfqdn``,
which can stall on a machine without DNS).
"""

from __future__ import annotations

import io
import socket
import threading
import time
from typing import Any

from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

MAX_HANDLERS = 8
REQUEST_TIMEOUT_S = 5.0
SLOT_WAIT_S = 1.0


class _DeadlineReader(io.RawIOBase):
    """Reads from a socket until an absolute deadline; past it, raises ``TimeoutError``."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request not received in time")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class _BoundedHandler(WSGIRequestHandler):
    """A request handler that reads against the server's deadline and logs nothing."""

    server: BoundedServer

    def setup(self) -> None:
        self.timeout = self.server.request_timeout_s
        super().setup()
        deadline = time.monotonic() + self.server.request_timeout_s
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, deadline))

    def parse_request(self) -> bool:
        parsed = super().parse_request()  # reads the headers: the head is whole after this
        self.server.head_received(self.connection)  # from now on it is served, not evicted
        return parsed

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass


class BoundedServer(WSGIServer):
    """See the module docstring. Build it with :func:`bounded_server`."""

    request_queue_size = 64  # listen backlog: a burst of connections waits, is not dropped

    def __init__(
        self, host: str, port: int, request_timeout_s: float, max_handlers: int
    ) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.request_timeout_s = request_timeout_s
        self.max_handlers = max_handlers
        self._slots = threading.BoundedSemaphore(max_handlers)
        self._reading: dict[socket.socket, float] = {}  # connections still sending their head
        self._reading_lock = threading.Lock()
        super().__init__((host, port), _BoundedHandler)

    def server_bind(self) -> None:
        """Bind without the host-name lookup of ``HTTPServer.server_bind``."""
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(self.server_address)
        self.server_address = self.socket.getsockname()
        self.server_name = str(self.server_address[0])
        self.server_port = int(self.server_address[1])
        self.setup_environ()

    def process_request(self, request: Any, client_address: Any) -> None:
        """Hand the request to a new thread; when every slot is busy, evict the oldest
        connection still sending its head and wait for its slot (see the module docstring)."""
        if not self._slots.acquire(blocking=False):
            self._evict_slowest()
            if not self._slots.acquire(timeout=SLOT_WAIT_S):
                self.shutdown_request(request)
                return
        with self._reading_lock:
            self._reading[request] = time.monotonic()
        thread = threading.Thread(
            target=self._handle, args=(request, client_address), name="kvdaemon-metrics-request",
            daemon=True,
        )  # fmt: skip
        thread.start()

    def _handle(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - a timed-out or broken request ends only itself
            pass
        finally:
            self.head_received(request)
            self.shutdown_request(request)
            self._slots.release()

    def head_received(self, request: socket.socket) -> None:
        with self._reading_lock:
            self._reading.pop(request, None)

    def _evict_slowest(self) -> None:
        """Shut the oldest connection still sending its request head; its handler then ends."""
        with self._reading_lock:
            if not self._reading:
                return
            oldest = min(self._reading, key=self._reading.__getitem__)
            del self._reading[oldest]
        try:
            oldest.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already gone

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Failed requests (timeouts, resets) print nothing."""


def bounded_server(
    host: str,
    port: int,
    app: Any,
    request_timeout_s: float = REQUEST_TIMEOUT_S,
    max_handlers: int = MAX_HANDLERS,
) -> BoundedServer:
    """A bound (not yet serving) :class:`BoundedServer` for the WSGI ``app``.

    Raises ``OSError`` when ``host:port`` cannot be bound.
    """
    server = BoundedServer(host, port, request_timeout_s, max_handlers)
    server.set_app(app)
    return server
