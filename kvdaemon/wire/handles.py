"""The handle channel: page file descriptors over AF_UNIX with SCM_RIGHTS.

ZeroMQ cannot carry file descriptors, so pages travel on a separate
``SOCK_SEQPACKET`` connection (message boundaries kept, fds attached to the
message they belong to). Each frame is one msgpack map plus up to
``MAX_FDS_PER_FRAME`` fds. The connection is also the tenant's lease: the
daemon treats its closing as the engine's death.

Cost: one ``sendmsg``/``recvmsg`` per frame; the kernel installs each fd in the
receiver (no copy of memory).
"""

from __future__ import annotations

import os
import socket
import struct
from collections import deque
from typing import Any

from kvdaemon.errors import BadRequest, Forbidden
from kvdaemon.wire.protocol import decode, encode

MAX_FDS_PER_FRAME = 200
MAX_FRAME_BYTES = 64 * 1024


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def check_same_uid(sock: socket.socket) -> int:
    """Return the peer's pid; raise ``Forbidden`` unless it runs as our uid."""
    pid, uid, _ = peer_credentials(sock)
    if uid != os.getuid():
        raise Forbidden(f"handle-socket peer pid {pid} runs as uid {uid}, not {os.getuid()}")
    return pid


def send_frame(sock: socket.socket, body: dict[str, Any], fds: list[int] | None = None) -> None:
    """Send one frame (blocking socket). The fds stay open: the caller closes them."""
    data = encode(body)
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.sendall(data)


def recv_frame(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """Receive one frame: its body and the fds it carried (now owned by the caller).

    Raises ``ConnectionError`` on EOF and ``BadRequest`` on a truncated or
    undecodable frame (closing any fds that came with it).
    """
    data, fds, flags, _ = socket.recv_fds(sock, MAX_FRAME_BYTES, MAX_FDS_PER_FRAME)
    if not data and not fds:
        raise ConnectionError("handle channel closed by peer")
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        close_fds(fds)
        raise BadRequest("truncated handle frame")
    try:
        return decode(data), fds
    except BadRequest:
        close_fds(fds)
        raise


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


class Outbox:
    """Frames queued for a non-blocking handle connection (daemon side).

    ``push`` queues a frame and owns its fds until they are sent; ``flush``
    sends what the socket takes without blocking and returns True when the
    queue is empty. A slow or stuck client therefore never blocks the daemon.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._frames: deque[tuple[bytes, list[int]]] = deque()

    def push(self, body: dict[str, Any]) -> None:
        """Queue one frame without fds."""
        self._frames.append((encode(body), []))

    def push_grant(
        self, grant_id: int, page_ids: list[int], fds: list[int], fd_index: list[int]
    ) -> None:
        """Queue one frame of a grant: pages, their fds, and which fd carries each page."""
        body = {"grant_id": grant_id, "page_ids": page_ids, "fd_index": fd_index}
        self._frames.append((encode(body), fds))

    def pending(self) -> bool:
        return bool(self._frames)

    def flush(self) -> bool:
        while self._frames:
            data, fds = self._frames[0]
            try:
                if fds:
                    socket.send_fds(self.sock, [data], fds, socket.MSG_DONTWAIT)
                else:
                    self.sock.send(data, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return False
            self._frames.popleft()
            close_fds(fds)
        return True

    def discard(self) -> None:
        while self._frames:
            close_fds(self._frames.popleft()[1])
