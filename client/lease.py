"""``Lease``: one registered tenant's grants, through its handle channel.

The handle channel (AF_UNIX ``SOCK_SEQPACKET``) carries the page fds of each
grant and is the tenant's lease: while it is open the daemon keeps the
tenant's pages; when this process dies the kernel closes it and the daemon
takes the pages back.

``grow`` asks for logical pages over the control channel, then takes the fds of
that grant from the handle channel and imports them through the backend.
``shrink`` gives logical pages back; the caller unmaps them first.

One reader thread owns the handle channel once attached: grant frames go to
a queue that ``grow`` waits on, and notices the daemon sends on its own
(``reclaim``) go to ``on_notice``, which must not block. The reader never
takes a lock, so a ``grow`` waiting for its frames cannot deadlock with it.
Cost: one control round trip plus one ``recvmsg`` per 200 pages.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvdaemon.cuda_vmm.backend import PhysicalPage
from kvdaemon.errors import BadRequest, KVDaemonError, from_code
from kvdaemon.wire.handles import close_fds, recv_frame, send_frame

if TYPE_CHECKING:
    from kvdaemon.client.connection import KVClient



class Lease:
    """A tenant registered through ``KVClient.lease``."""

    def __init__(self, client: KVClient, name: str, reply: dict[str, Any]) -> None:
        self.client = client
        self.name = name
        self.token: str = reply["token"]
        self.tenant_id: int = reply["tenant_id"]
        self.page_size_bytes: int = reply["page_size"]
        self.num_segments: int = reply["num_segments"]
        self.backend = client.backend()
        # Our own control connection: a caller blocked on the user's client (a sleep
        # waiting for us to quiesce) must never block our answers.
        self.control = type(client)(client.dir, timeout_s=client.timeout_s)
        self.on_notice: Callable[[dict[str, Any]], None] | None = None
        self.lost = threading.Event()  # set when the handle channel closes under us
        self._sock: socket.socket | None = None
        self._frames: queue.Queue[tuple[dict[str, Any], list[int]] | None] = queue.Queue()
        self._reader: threading.Thread | None = None

    def attach(self) -> None:
        """Open the handle channel and bind it to this tenant."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(self.client.timeout_s)
        try:
            sock.connect(str(self.client.paths.handle_socket))
            send_frame(sock, {"tenant": self.name, "token": self.token})
            body, fds = recv_frame(sock)
        except (OSError, ConnectionError) as exc:
            sock.close()
            raise self.client._unreachable() from exc
        close_fds(fds)
        if not body.get("ok"):
            sock.close()
            error = body.get("error") or {}
            raise from_code(str(error.get("code")), str(error.get("message")))
        sock.settimeout(None)
        self._sock = sock
        self._reader = threading.Thread(
            target=self._read_loop, name=f"kvdaemon-lease-{self.name}", daemon=True
        )
        self._reader.start()

    def _read_loop(self) -> None:
        sock = self._sock
        assert sock is not None
        while True:
            try:
                body, fds = recv_frame(sock)
            except (OSError, ConnectionError, KVDaemonError):
                break
            if "notice" in body:
                close_fds(fds)
                if self.on_notice is not None:
                    self.on_notice(body)
            else:
                self._frames.put((body, fds))
        self.lost.set()
        self._frames.put(None)

    def _args(self, **extra: Any) -> dict[str, Any]:
        return {"tenant": self.name, "token": self.token, **extra}

    def grow(self, logical_pages: list[int], wait_s: float | None = None) -> dict[int, list[PhysicalPage]]:
        """Map nothing yet: obtain and import one page per segment for each logical page.

        Returns ``{logical_page: [page of segment 0, 1, ...]}``. Raises
        ``NoMemory``/``OverLimit``/``Asleep`` from the daemon, with nothing granted.
        ``wait_s`` bounds how long the daemon may wait for other tenants to give
        pages back (``None``: the daemon's default, 2 s; ``0``: fail at once).
        """
        args = self._args(logical_pages=list(logical_pages))
        if wait_s is not None:
            args["wait_s"] = wait_s
        reply = self.control.call("grow", args)
        return self.receive_grant(reply["grant_id"], reply["pages"])

    def receive_grant(self, grant_id: int, pages: list[list[Any]]) -> dict[int, list[PhysicalPage]]:
        """Import the fds of grant ``grant_id`` (``pages``: ``[[lp, [page ids]], ...]``)."""
        page_ids = [pid for _, ids in pages for pid in ids]
        imported = self._receive(grant_id, page_ids)
        nseg = self.num_segments
        return {lp: imported[i * nseg : (i + 1) * nseg] for i, (lp, _) in enumerate(pages)}

    def wake(self) -> dict[str, Any]:
        """Ask the daemon to wake this tenant (the pool maps the grant when told)."""
        return self.control.call("wake", {"name": self.name, "token": self.token})

    def sleep_ready(self, sleep_id: int) -> dict[str, Any]:
        """Tell the daemon our pages are unmapped for sleep ``sleep_id`` (it may refuse: too late)."""
        return self.control.call("sleep_ready", self._args(sleep_id=sleep_id))

    def _receive(self, grant_id: int, page_ids: list[int]) -> list[PhysicalPage]:
        if self._sock is None:
            raise KVDaemonError(f"tenant {self.name!r} is not attached")
        pages: list[PhysicalPage] = []
        while len(pages) < len(page_ids):
            try:
                frame = self._frames.get(timeout=self.client.timeout_s)
            except queue.Empty:
                frame = None
            if frame is None:
                self._frames.put(None)  # keep the end visible to later calls
                raise self.client._unreachable()
            body, fds = frame
            ids, fd_index = body.get("page_ids"), body.get("fd_index")
            stale = body.get("grant_id")
            if isinstance(stale, int) and stale < grant_id:
                close_fds(fds)  # a grant whose reply we gave up on: its pages are shrunk apart
                continue
            if (
                body.get("grant_id") != grant_id
                or not isinstance(ids, list)
                or not ids
                or ids != page_ids[len(pages) : len(pages) + len(ids)]
                or not isinstance(fd_index, list)
            ):
                close_fds(fds)
                raise BadRequest(f"handle channel out of step for grant {grant_id}")
            pages.extend(self.backend.import_pages(fds, ids, fd_index))
        return pages

    def shrink(self, logical_pages: list[int]) -> int:
        """Give logical pages back (already unmapped here); return how many went."""
        reply = self.control.call("shrink", self._args(logical_pages=list(logical_pages)))
        return int(reply["num_released"])

    def heartbeat(self, used_bytes: int | None = None) -> dict[str, Any]:
        """Tell the daemon we are alive and how many bytes of blocks we hold."""
        args = self._args() if used_bytes is None else self._args(used_bytes=used_bytes)
        return self.control.call("heartbeat", args)

    def abandon(self) -> None:
        """Close a lease whose daemon is gone, without telling anyone."""
        self.lost.set()
        self.close()

    def close(self) -> None:
        """Unregister (the daemon frees our pages) and close the handle channel."""
        if self._sock is None:
            return
        try:
            if not self.lost.is_set():
                self.control.call("unregister", self._args())
        finally:
            with contextlib.suppress(OSError):  # the peer may be gone already
                self._sock.shutdown(socket.SHUT_RDWR)
            if self._reader is not None:
                self._reader.join(5)
            self._sock.close()
            self._sock = None
            self.control.close()
