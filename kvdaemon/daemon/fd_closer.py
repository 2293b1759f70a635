"""``FdCloser``: closes what a peer may have handed the daemon, off the loop thread.

The last close of a file runs its release in the closing thread, and some
releases block: a TCP socket with ``SO_LINGER`` and unsent data waits out its
linger time, a unix socket releases the fds still queued in it (which may be
such sockets), a FUSE file waits for its server. A peer can make the daemon
hold the last reference to such a file: fds it sends on the handle channel (on
kernels without ``SO_PASSRIGHTS``), or frames left unread in a connection the
daemon closes. So the daemon loop never closes those itself: it queues them
here and one worker thread closes them in order.

Before closing a socket fd the worker turns its linger off, so the common trick
(a lingering TCP socket) costs nothing; anything else that blocks stalls only
the worker. ``num_pending`` counts what is queued, for the caller's fd budget.

Invariant: everything queued is closed exactly once (unless the process exits first).
Cost: O(1) for the caller; the worker may block per close as long as the release takes.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import struct
import threading

log = logging.getLogger("kvdaemon.daemon.fd_closer")
_NO_LINGER = struct.pack("ii", 0, 0)


class FdCloser:
    """A queue of fds and sockets to close, and the thread that closes them."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[int | socket.socket | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._num_pending = 0
        self._thread: threading.Thread | None = None

    @property
    def num_pending(self) -> int:
        """Fds queued and not closed yet."""
        return self._num_pending

    def start(self) -> None:
        """Start the worker; until then, and after ``stop``, closes happen at once in the caller."""
        self._thread = threading.Thread(target=self._run, name="kvdaemon-fd-closer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Let the worker finish what is queued and exit; does not wait for it."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread = None

    def close_fds(self, fds: list[int]) -> None:
        """Queue raw fds (now owned by the closer)."""
        for fd in fds:
            self._put(fd)

    def close_socket(self, sock: socket.socket) -> None:
        """Queue a socket object (now owned by the closer)."""
        self._put(sock)

    def _put(self, item: int | socket.socket) -> None:
        if self._thread is None:
            _close(item)
            return
        with self._lock:
            self._num_pending += 1
        self._queue.put(item)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                _close(item)
            except Exception:  # a thread that must survive anything: log and go on
                log.exception("could not close %r", item)
            with self._lock:
                self._num_pending -= 1


def _close(item: int | socket.socket) -> None:
    if isinstance(item, socket.socket):
        item.close()
        return
    _unlinger(item)
    try:
        os.close(item)
    except OSError as exc:  # e.g. EIO from a file system: the fd is gone all the same
        log.debug("closing fd %d: %s", item, exc)


def _unlinger(fd: int) -> None:
    """Turn ``SO_LINGER`` off when ``fd`` is a socket, so its close does not wait."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:  # not a socket
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _NO_LINGER)
    except OSError:  # a socket without linger (e.g. AF_UNIX accepts it, others may not)
        pass
    finally:
        sock.detach()
