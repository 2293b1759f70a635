"""The handle channel's frames: a grant frame rides with the reply that follows it, fds and all."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from kvdaemon.wire.handles import Outbox, close_fds, recv_frame
from kvdaemon.wire.protocol import encode

GRANT = {"grant_id": 7, "page_ids": [3, 4], "fd_index": [0, 0]}


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ends = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for end in ends:
        end.setblocking(False)
    try:
        yield ends
    finally:
        for end in ends:
            end.close()


def received(sock: socket.socket) -> tuple[dict[str, object], list[int]]:
    sock.setblocking(True)
    try:
        return recv_frame(sock)
    finally:
        sock.setblocking(False)


def granted_fd() -> tuple[int, int]:
    """A fresh fd to send (the outbox closes it once sent) and its inode."""
    read_end, write_end = os.pipe()
    os.close(write_end)
    return read_end, os.fstat(read_end).st_ino


@pytest.mark.parametrize("num_keys", [2, 14, 15, 40], ids=["small", "largest-fixmap", "map16", "large"])
def test_a_reply_after_a_grant_frame_carries_it_and_its_fds(
    pair: tuple[socket.socket, socket.socket], num_keys: int
) -> None:
    daemon, tenant = pair
    reply = {"id": 9, **{f"k{i}": i for i in range(num_keys - 1)}}
    fd, inode = granted_fd()
    outbox = Outbox(daemon)
    outbox.push_grant(GRANT["grant_id"], GRANT["page_ids"], [fd], GRANT["fd_index"])
    outbox.push_reply(encode(reply))
    assert (outbox.num_queued_fds, len(outbox._frames)) == (1, 1), "one frame, one wake-up"
    assert outbox.flush()
    body, fds = received(tenant)
    try:
        assert body == {**reply, "frame": GRANT}
        assert [os.fstat(got).st_ino for got in fds] == [inode]
    finally:
        close_fds(fds)
    assert (outbox.num_queued_fds, outbox.num_queued_bytes, outbox.num_sent_fds) == (0, 0, 1)


def test_a_reply_after_a_sent_grant_frame_or_a_plain_one_goes_alone(pair: tuple[socket.socket, socket.socket]) -> None:
    daemon, tenant = pair
    outbox = Outbox(daemon)
    fd, _ = granted_fd()
    outbox.push_grant(1, [0], [fd], [0])
    assert outbox.flush()
    outbox.push_reply(encode({"id": 1}))  # the grant frame went already
    outbox.push({"notice": "free"})
    outbox.push_reply(encode({"id": 2}))  # after a frame without fds
    assert outbox.flush()
    bodies = []
    for _ in range(4):
        body, fds = received(tenant)
        close_fds(fds)
        bodies.append(body)
    assert bodies == [{"grant_id": 1, "page_ids": [0], "fd_index": [0]}, {"id": 1}, {"notice": "free"}, {"id": 2}]
