"""The handle channel: page file descriptors over AF_UNIX with SCM_RIGHTS.

ZeroMQ cannot carry file descriptors, so pages travel on a separate
``SOCK_SEQPACKET`` connection (message boundaries kept, fds attached to the
message they belong to). Each frame is one msgpack map plus up to
``MAX_FDS_PER_FRAME`` fds. The connection is also the tenant's lease: the
daemon treats its closing as the engine's death.

Peers never send fds to the daemon. ``refuse_fds`` makes the kernel refuse
them where it can (``SO_PASSRIGHTS``, Linux 6.16+); elsewhere the daemon receives
whatever comes with room for ``SCM_MAX_FD`` fds (fds that do not fit are closed
by the kernel in the receiving thread, which may block) and disposes of them
off its loop.

An ``Outbox`` counts the fds it holds and the fds sent that its peer has not
read yet (``SIOCOUTQ``), so the daemon can bound what one peer keeps unread.

Cost: one ``sendmsg``/``recvmsg`` per frame; the kernel installs each fd in the
receiver (no copy of memory).
"""

from __future__ import annotations

import array
import fcntl
import os
import socket
import struct
import termios
from collections import deque
from collections.abc import Callable
from typing import Any

from kvdaemon.errors import BadRequest, Forbidden
from kvdaemon.wire.protocol import MESSAGE_LIMITS, DecodeLimits, decode, encode

MAX_FDS_PER_FRAME = 200
MAX_FRAME_BYTES = 64 * 1024
MAX_GROW_PAGES = 4096  # logical pages one grow or shrink may name: its request fits in a frame


def max_grant_pages(num_segments: int) -> int:
    """Logical pages one grant may hold so that its reply (every segment's page id of each,
    beside the last grant frame) fits in one frame; both sides bound grows by it."""
    per_page = 10 + 5 * max(1, num_segments)  # msgpack: [lp, [page id per segment]], 5 bytes an id
    return max(1, min(MAX_GROW_PAGES, (MAX_FRAME_BYTES - 4096) // per_page))
SCM_MAX_FD = 253  # the most fds the kernel attaches to one message
# Plain ints, computed once: ``socket``'s flags are enums whose ``|`` runs Python code per frame.
_ANCILLARY_BYTES = socket.CMSG_LEN(SCM_MAX_FD * array.array("i").itemsize)
_TRUNCATED = int(socket.MSG_TRUNC | socket.MSG_CTRUNC)
_SOL_SOCKET, _SCM_RIGHTS, _DONTWAIT = int(socket.SOL_SOCKET), int(socket.SCM_RIGHTS), int(socket.MSG_DONTWAIT)
_FRAME_KEY = b"\xa5frame"  # msgpack of the key "frame" (``Outbox.push_reply``)
# SO_PASSRIGHTS has the asm-generic number on these; alpha, mips, parisc, sparc differ.
_SO_PASSRIGHTS = getattr(socket, "SO_PASSRIGHTS", 83)
_GENERIC_SOCKOPT_MACHINES = {"x86_64", "i686", "i386", "aarch64", "armv7l", "riscv64", "ppc64le",
                             "s390x", "loongarch64"}


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


def refuse_fds(listener: socket.socket) -> bool:
    """Make the kernel refuse fds sent to connections of ``listener``; True if it can.

    With ``SO_PASSRIGHTS`` off, a peer's ``sendmsg`` with ``SCM_RIGHTS`` fails
    with ``EPERM``; accepted sockets inherit it from the listener at connect
    time, so even frames sent before ``accept`` are covered. Older kernels
    answer ``ENOPROTOOPT``: the caller must then dispose of what arrives.
    """
    if os.uname().machine not in _GENERIC_SOCKOPT_MACHINES:
        return False
    try:
        listener.setsockopt(socket.SOL_SOCKET, _SO_PASSRIGHTS, 0)
    except OSError:
        return False
    return True


def send_frame(sock: socket.socket, body: dict[str, Any], fds: list[int] | None = None) -> None:
    """Send one frame (blocking socket). The fds stay open: the caller closes them.

    ``BadRequest``, nothing sent, for a body over ``MAX_FRAME_BYTES`` (the peer could only
    read it truncated)."""
    data = encode(body)
    if len(data) > MAX_FRAME_BYTES:
        raise BadRequest(f"a handle frame holds at most {MAX_FRAME_BYTES} bytes, this one {len(data)}")
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.sendall(data)


def recv_frame(
    sock: socket.socket,
    limits: DecodeLimits = MESSAGE_LIMITS,
    dispose: Callable[[list[int]], None] | None = None,
) -> tuple[dict[str, Any], list[int]]:
    """Receive one frame: its body (decoded within ``limits``) and the fds it carried.

    The fds are now owned by the caller. Raises ``ConnectionError`` on EOF and
    ``BadRequest`` on a truncated or undecodable frame or one with more than
    ``MAX_FDS_PER_FRAME`` fds, after handing its fds to ``dispose`` (default:
    close them here).
    """
    data, ancillary, flags, _ = sock.recvmsg(MAX_FRAME_BYTES, _ANCILLARY_BYTES)
    fds = _fds_of(ancillary)
    if not data and not fds:
        raise ConnectionError("the peer closed it")
    try:
        if flags & _TRUNCATED:
            raise BadRequest("truncated handle frame")
        if len(fds) > MAX_FDS_PER_FRAME:
            raise BadRequest(f"a frame carries at most {MAX_FDS_PER_FRAME} fds, got {len(fds)}")
        return decode(data, limits), fds
    except BadRequest:
        (dispose or close_fds)(fds)
        raise


def _fds_of(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The fds of a ``recvmsg``'s ``SCM_RIGHTS`` messages (``socket.recv_fds`` without its
    per-call enum and buffer-size work); other ancillary messages are ignored."""
    if not ancillary:
        return []
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == _SOL_SOCKET and kind == _SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return fds.tolist()


def _send_with_fds(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    """One non-blocking ``sendmsg`` of ``data`` with ``fds`` attached (``socket.send_fds``
    drops its flags argument before Python 3.12; the socket is non-blocking anyway)."""
    sock.sendmsg([data], [(_SOL_SOCKET, _SCM_RIGHTS, array.array("i", fds))], _DONTWAIT)


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


class Outbox:
    """Frames queued for a non-blocking handle connection (daemon side).

    ``push`` queues a frame and owns its fds until they are sent; ``flush``
    sends what the socket takes without blocking and returns True when the
    queue is empty. A slow or stuck client therefore never blocks the daemon.

    ``num_unread_fds`` is the fds queued here plus those sent since the peer
    was last seen to have read every frame: an upper bound on the fds this
    peer holds up (queued fds are open in this process; sent, unread ones
    count against the sending user's in-flight limit, ``RLIMIT_NOFILE``).
    ``num_queued_bytes`` is the bytes of the frames queued here (the memory a
    peer that does not read holds up in this process).
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._frames: deque[tuple[bytes, list[int]]] = deque()
        self._last_grant = False  # the last queued frame is a grant frame (``push_grant``)
        self.num_queued_fds = 0
        self.num_sent_fds = 0
        self.num_queued_bytes = 0

    @property
    def num_unread_fds(self) -> int:
        return self.num_queued_fds + self.num_sent_fds

    def push(self, body: dict[str, Any]) -> None:
        """Queue one frame without fds."""
        self._queue(encode(body), [])

    def _queue(self, data: bytes, fds: list[int]) -> None:
        self._frames.append((data, fds))
        self.num_queued_bytes += len(data)
        self.num_queued_fds += len(fds)

    def push_reply(self, data: bytes) -> None:
        """Queue an encoded reply; if the last queued frame is a grant frame not sent yet,
        the reply travels with it (``"frame"``: the grant frame's body, with its fds), so
        the peer is woken once.

        Cost: O(bytes) copying (``_with_frame``), no decoding or encoding.
        """
        if self._frames and self._frames[-1][1] and self._last_grant:
            grant, fds = self._frames.pop()
            self.num_queued_bytes -= len(grant)
            self.num_queued_fds -= len(fds)
            self._queue(_with_frame(data, grant), fds)
        else:
            self._queue(data, [])
        self._last_grant = False

    def push_grant(
        self, grant_id: int, page_ids: list[int], fds: list[int], fd_index: list[int]
    ) -> None:
        """Queue one frame of a grant: pages, their fds, and which fd carries each page."""
        body = {"grant_id": grant_id, "page_ids": page_ids, "fd_index": fd_index}
        self._queue(encode(body), fds)
        self._last_grant = True  # merged into a reply that follows it (``push_reply``)

    def pending(self) -> bool:
        return bool(self._frames)

    def refresh(self) -> None:
        """Forget the sent fds once the peer has read every frame (one ``ioctl``)."""
        if self.num_sent_fds and _unread_bytes(self.sock) == 0:
            self.num_sent_fds = 0

    def flush(self) -> bool:
        self.refresh()
        while self._frames:
            data, fds = self._frames[0]
            try:
                if fds:
                    _send_with_fds(self.sock, data, fds)
                else:
                    self.sock.send(data, _DONTWAIT)
            except BlockingIOError:
                return False
            self._frames.popleft()
            close_fds(fds)
            self.num_queued_bytes -= len(data)
            self.num_queued_fds -= len(fds)
            self.num_sent_fds += len(fds)
        return True

    def discard(self) -> None:
        """Drop every queued frame and close its fds (the connection is closing)."""
        while self._frames:
            close_fds(self._frames.popleft()[1])
        self.num_queued_fds = self.num_sent_fds = self.num_queued_bytes = 0


def _with_frame(reply: bytes, grant: bytes) -> bytes:
    """The encoded map ``reply`` with one more entry, ``"frame"``: the encoded ``grant``.

    A reply is a map of fewer than 15 entries (a msgpack fixmap; none named ``frame``):
    its header byte plus one, then its entries, the key and the grant's bytes are the
    same bytes as encoding the merged map. Anything else is decoded and encoded again.
    """
    if reply and 0x80 <= reply[0] < 0x8F:
        return b"".join((bytes((reply[0] + 1,)), memoryview(reply)[1:], _FRAME_KEY, grant))
    return encode({**decode(reply), "frame": decode(grant)})


def _unread_bytes(sock: socket.socket) -> int:
    """Bytes sent on ``sock`` that its peer has not read (``SIOCOUTQ``); -1 if unknown."""
    buf = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, buf)
    except (OSError, ValueError):
        return -1
    return buf[0]
