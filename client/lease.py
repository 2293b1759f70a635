"""``Lease``: one registered tenant's channels to the daemon.

- The *handle channel* (AF_UNIX ``SOCK_SEQPACKET``) carries the page fds of
  each grant and the daemon's notices; it is the tenant's lease: while it is
  open the daemon keeps the tenant's pages; when this process dies the kernel
  closes it and the daemon takes them back. Before anything is sent on it, the
  peer must run as our uid (``SO_PEERCRED``).
- A *control channel* of its own (``ControlChannel``), so a caller blocked on
  the user's client (a sleep waiting for us to quiesce) never blocks our answers.

One reader thread owns the handle channel once attached: grant frames go to a
mailbox by grant id that ``receive_pages`` waits on; notices are parsed
(``kvdaemon.wire.messages``) and handed to ``on_notice``, which must not block;
a wake's notices are joined first and handed over once whole (parts out of
step close the channel: the lease is lost, never half-mapped). Notices read
before ``on_notice`` is set (one right after attach, before the pool has
started) are kept, up to ``MAX_EARLY_NOTICES``, and handed over in order, on a
thread of their own, when it is. The reader takes only the mailbox's lock and
the notices' (a leaf: no handler runs under it), so nothing can deadlock with it.

A grow whose reply does not come in time is not a decision: it stays
outstanding, its candidate pages are ``in_flight``, and ``late_grants`` returns
the pages once the reply arrives, for the pool to map (adopt) or give back.

Cost: one control round trip plus one ``recvmsg`` per 200 pages per grow.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from kvdaemon.client.control import ControlChannel
from kvdaemon.client.grant_channel import GrantChannel
from kvdaemon.cuda_vmm.backend import Backend, PhysicalPage
from kvdaemon.errors import BadRequest, DaemonUnreachable, Forbidden, KVDaemonError, NoReply, from_code
from kvdaemon.wire.handles import close_fds, peer_credentials, recv_frame, send_frame
from kvdaemon.wire.messages import (
    MAX_WHY_CHARS, Notice, WakeJoin, WakeNotice, checked_limit, limit_revision, parse_grant_pages, parse_notice,
)
from kvdaemon.wire.paths import DaemonPaths
from kvdaemon.wire.protocol import result_of

log = logging.getLogger("kvdaemon.client")
DAEMON_WAIT_S = 2.0  # how long a daemon may park a grow by default (its reclaim_wait_s)
MAX_EARLY_NOTICES = 64  # kept while nobody listens (a bare lease never does): the newest
Grant = dict[int, list[PhysicalPage]]
"""Granted pages: ``{logical page: [physical page of segment 0, 1, ...]}``."""


class Lease:
    """A tenant registered through ``KVClient.lease`` (see the module docstring)."""

    def __init__(
        self, paths: DaemonPaths, timeout_s: float, backend: Backend, name: str,
        reply: dict[str, Any],
    ) -> None:
        self.paths = paths
        self.timeout_s = timeout_s
        self.backend = backend
        self.name = name
        self.token: str = reply["token"]
        self.tenant_id: int = reply["tenant_id"]
        self.page_size_bytes: int = reply["page_size"]
        self.num_segments: int = reply["num_segments"]
        self.limit: dict[str, Any] = (checked_limit(reply.get("limit"))
                                      or checked_limit({"max_bytes": reply.get("max_bytes")}) or {})  # fmt: skip
        self.lost = threading.Event()  # set when the handle channel closes under us
        self.control = ControlChannel(paths, timeout_s, alive=lambda: not self.lost.is_set(), keep=True)
        self._on_notice: Callable[[Notice], None] | None = None
        self._early: list[Notice] = []  # read before anyone listened (``on_notice``)
        self._notice_lock = threading.Lock()  # a leaf (no handler runs under it): ``_early``, ``_replaying``
        self._replaying = False  # the setter hands the early notices over: later ones queue behind them
        self.outstanding_grows: dict[int, list[int]] = {}  # request id -> candidate pages
        self._sock: socket.socket | None = None
        self._frames: dict[int, list[tuple[dict[str, Any], list[int]]]] = {}
        self._frames_changed = threading.Condition()
        self._reader: threading.Thread | None = None
        self._wake: WakeJoin | None = None  # a wake whose later notices are on their way
        self._broken = False  # the daemon broke the protocol: nothing more is read as sent
        self.grants: GrantChannel | None = None  # grows and shrinks: one plain round trip

    # -- the handle channel ----------------------------------------------------

    def attach(self) -> None:
        """Open the handle channel, check the daemon's uid, and bind it to this tenant."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(str(self.paths.handle_socket))
            _, uid, _ = peer_credentials(sock)
            if uid != os.getuid():
                raise Forbidden(f"the handle socket at {self.paths.root} is served by uid {uid}, not by you")
            send_frame(sock, {"tenant": self.name, "token": self.token})
            body, fds = recv_frame(sock)
        except (OSError, ConnectionError) as exc:
            sock.close()
            raise self.control.unreachable() from exc
        except KVDaemonError:
            sock.close()
            raise
        close_fds(fds)
        if not body.get("ok"):
            sock.close()
            error = body.get("error") or {}
            raise from_code(str(error.get("code")), str(error.get("message")))
        told = checked_limit(body.get("limit"))  # as of now: a change since the register reply had no lease
        if told is not None and limit_revision(told) >= limit_revision(self.limit):
            self.limit = told
        sock.settimeout(None)
        self._sock = sock
        self._reader = threading.Thread(target=self._read_loop, name=f"kvdaemon-lease-{self.name}", daemon=True)
        self._reader.start()
        self.grants = GrantChannel.open(
            str(self.paths.handle_socket), {"tenant": self.name, "token": self.token}, self.timeout_s,
            alive=lambda: not self.lost.is_set(),
        )

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
                self._deliver(body)
                continue
            grant_id = body.get("grant_id")
            if not isinstance(grant_id, int):
                close_fds(fds)
                continue
            with self._frames_changed:
                self._frames.setdefault(grant_id, []).append((body, fds))
                self._frames_changed.notify_all()
        self.lost.set()
        with self._frames_changed:
            self._frames_changed.notify_all()

    def _deliver(self, body: dict[str, Any]) -> None:
        if self._broken:
            return
        try:
            notice = parse_notice(body)
        except BadRequest as exc:
            if body.get("notice") == "wake":  # the daemon has us awake: dropping it would disagree
                self._break(f"a malformed wake notice: {exc}")
            else:
                log.warning("lease %s: ignored a malformed notice: %s", self.name, exc)
            return
        if isinstance(notice, WakeNotice):
            notice = self._join_wake(notice)
        elif self._wake is not None:
            self._break(f"a {notice.kind} notice inside the parts of wake grant {self._wake.first.grant_id}")
            return
        if notice is None:
            return
        with self._notice_lock:
            handler = self._on_notice
            if handler is None or self._replaying:  # kept: handed over in order after the earlier ones
                self._early.append(notice)
                del self._early[:-MAX_EARLY_NOTICES]
                return
        _hand(handler, notice, self.name)

    @property
    def on_notice(self) -> Callable[[Notice], None] | None:
        """Where parsed notices go (on the reader thread; it must not block)."""
        return self._on_notice

    @on_notice.setter
    def on_notice(self, handler: Callable[[Notice], None] | None) -> None:
        """Set the handler. The notices read before any was set go to it first, in order, on a
        thread of their own (a handler never runs on the caller's thread, nor under a lock of
        the lease); those read meanwhile follow them."""
        with self._notice_lock:
            self._on_notice = handler
            if handler is None or self._replaying or not self._early:
                return
            self._replaying = True
        threading.Thread(target=self._hand_early, name=f"kvdaemon-lease-{self.name}-early", daemon=True).start()

    def _hand_early(self) -> None:
        """Hand the notices read before a handler was set to the current one, until none is left."""
        while True:
            with self._notice_lock:
                current = self._on_notice  # replaced meanwhile: the rest is the new one's
                if current is None or not self._early:
                    self._replaying = False
                    return
                early, self._early = self._early, []
            for notice in early:
                _hand(current, notice, self.name)

    def _join_wake(self, part: WakeNotice) -> WakeNotice | None:
        """The whole wake once its notices (``WakeNotice.parts``, back to back) add up; None
        before. Parts out of step break the lease (``_break``): the wake is never mapped."""
        try:
            if self._wake is None:
                join = WakeJoin(part)
            else:
                join = self._wake
                join.add(part)
        except BadRequest as exc:
            self._break(str(exc))
            return None
        if join.complete:
            self._wake = None
            return join.whole()
        self._wake = join
        return None

    def _break(self, why: str) -> None:
        """The daemon broke the protocol: close the handle channel (reader thread only), so
        the lease is lost on both sides and the pool re-registers, as after a daemon's death."""
        log.error("lease %s: %s; the handle channel is closed", self.name, why)
        self._wake, self._broken = None, True
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def receive_pages(
        self, grant_id: int, logical_pages: list[int], page_ids: list[int] | None = None,
        frames: list[tuple[dict[str, Any], list[int]]] | None = None,
    ) -> Grant:
        """Import grant ``grant_id``: one page per segment for each of ``logical_pages``, in order.

        ``frames`` are those already read (on the grant channel); the rest come
        from the handle channel. Without ``page_ids`` (a wake notice) the frames
        say which pages they carry. On a bad frame nothing stays imported or open.
        """
        if self._sock is None:
            raise KVDaemonError(f"tenant {self.name!r} is not attached")
        nseg = self.num_segments
        num_pages = len(logical_pages) * nseg
        frames = list(frames or [])
        if not _enough(frames, num_pages):
            frames += self._take_frames(grant_id, num_pages - sum(len(b["page_ids"]) for b, _ in frames))
        imported: list[PhysicalPage] = []
        try:
            for i, (body, fds) in enumerate(frames):
                ids, fd_index = body.get("page_ids"), body.get("fd_index")
                if not isinstance(ids, list) or not ids or not isinstance(fd_index, list) or (
                    page_ids is not None and ids != page_ids[len(imported) : len(imported) + len(ids)]
                ):  # fmt: skip
                    raise BadRequest(f"handle channel out of step for grant {grant_id}")
                frames[i] = (body, [])  # the backend owns the fds from here, even if it fails
                imported.extend(self.backend.import_pages(fds, ids, fd_index))
        except KVDaemonError:
            for _, fds in frames:
                close_fds(fds)
            for page in imported:
                self.backend.release_page(page)
            raise
        return {lp: imported[i * nseg : (i + 1) * nseg] for i, lp in enumerate(logical_pages)}

    def _take_frames(self, grant_id: int, num_pages: int) -> list[tuple[dict[str, Any], list[int]]]:
        """Wait (bounded by the timeout) until grant ``grant_id``'s frames cover ``num_pages``."""
        def covered() -> bool:
            return _enough(self._frames.get(grant_id, []), num_pages) or self.lost.is_set()

        with self._frames_changed:
            if not self._frames_changed.wait_for(covered, self.timeout_s) or not _enough(
                self._frames.get(grant_id, []), num_pages
            ):
                for _, fds in self._frames.pop(grant_id, []):
                    close_fds(fds)
                raise self.control.unreachable()
            return self._frames.pop(grant_id)

    # -- ops -------------------------------------------------------------------

    def _args(self, **extra: Any) -> dict[str, Any]:
        return {"tenant": self.name, "token": self.token, **extra}

    def grow(
        self, logical_pages: list[int], wait_s: float | None = None, min_pages: int | None = None,
        ahead: bool = False,
    ) -> Grant:
        """Obtain and import pages for the first n of ``logical_pages``, ``min_pages <= n``.

        Maps nothing. Raises ``NoMemory``/``OverLimit``/``Asleep`` from the daemon
        with nothing granted. ``wait_s`` bounds how long the daemon may wait for
        other tenants to give pages back (``None``: its default; ``0``: fail at
        once). ``ahead``: pages wanted ahead of need, which the daemon grants
        only from memory free above its low-water mark, asking nobody for any.
        No reply in time raises ``NoReply`` and leaves the grow outstanding (see
        ``late_grants``).
        """
        args = self._args(logical_pages=list(logical_pages))
        if min_pages is not None:
            args["min_pages"] = min_pages
        if wait_s is not None:
            args["wait_s"] = wait_s
        if ahead:
            args["ahead"] = True
        timeout_s = self.timeout_s + (DAEMON_WAIT_S if wait_s is None else wait_s)
        try:
            reply, frames = self._grant_call("grow", args, timeout_s, keep=True)
        except NoReply as exc:
            self.outstanding_grows[exc.request_id] = list(logical_pages)  # type: ignore[attr-defined]
            raise
        return self._granted(reply, frames)

    def _grant_call(
        self, op: str, args: dict[str, Any], timeout_s: float, keep: bool = False
    ) -> tuple[dict[str, Any], list[tuple[dict[str, Any], list[int]]]]:
        """One grow or shrink: on the grant channel, or the control channel without one."""
        if self.grants is not None:
            return self.grants.call(op, args, timeout_s, keep)
        call = self.control.call_keep if keep else self.control.call
        return {"ok": True, "result": call(op, args, timeout_s)}, []

    def _granted(self, reply: dict[str, Any], frames: list[tuple[dict[str, Any], list[int]]]) -> Grant:
        """The pages of a grow's reply; its error raised (and any frames closed) when refused."""
        try:
            result = result_of(reply)
        except KVDaemonError:
            for _, fds in frames:
                close_fds(fds)
            raise
        pages = parse_grant_pages(result["pages"])
        ids = [pid for _, page_ids in pages for pid in page_ids]
        return self.receive_pages(result["grant_id"], [lp for lp, _ in pages], ids, frames)

    @property
    def in_flight(self) -> set[int]:
        """Logical pages asked for by grows still waiting for their reply."""
        return {lp for lps in self.outstanding_grows.values() for lp in lps}

    def late_grants(self) -> list[Grant]:
        """Grants of outstanding grows answered since (imported, not mapped); refusals dropped."""
        grants: list[Grant] = []
        for request_id in list(self.outstanding_grows):
            found = self.grants.collect(request_id) if self.grants is not None else None
            if self.grants is None:
                reply = self.control.collect(request_id)
                found = None if reply is None else (reply, [])
            if found is None:
                continue
            del self.outstanding_grows[request_id]
            try:
                grants.append(self._granted(*found))
            except KVDaemonError as exc:
                log.info("lease %s: a late grow came back refused or unusable: %s", self.name, exc)
        return grants

    def abandon_outstanding_grows(self) -> int:
        """Drop every outstanding grow: what its late reply grants is never mapped nor given
        back (the daemon took all of this tenant's pages back: a sleep). Returns how many."""
        for request_id in self.outstanding_grows:
            (self.grants or self.control).abandon(request_id)
        num = len(self.outstanding_grows)
        self.outstanding_grows.clear()
        return num

    def shrink(self, logical_pages: list[int]) -> int:
        """Give logical pages back (already unmapped here); return how many went."""
        reply, _ = self._grant_call("shrink", self._args(logical_pages=list(logical_pages)), self.timeout_s)
        return int(result_of(reply)["num_released"])

    def heartbeat(
        self, used_bytes: int | None = None, sleepable: bool | None = None, active: bool = False,
        num_refused: int = 0,
    ) -> dict[str, Any]:
        """Tell the daemon we are alive, how many bytes of blocks we hold, whether we can
        quiesce, whether the engine stepped since the last heartbeat, and how many grows the
        pool refused itself since then (``num_refused``: past the limit it knows)."""
        args = self._args(active=active)
        if num_refused:
            args["refused_grows"] = num_refused
        if used_bytes is not None:
            args["used_bytes"] = used_bytes
        if sleepable is not None:
            args["sleepable"] = sleepable
        return self.control.call("heartbeat", args)

    def wake(self) -> dict[str, Any]:
        """Ask the daemon to wake this tenant (the pool maps the grant when told)."""
        return self.control.call("wake", {"name": self.name, "token": self.token})

    def sleep_ready(self, sleep_id: int, refused: bool = False, why: str | None = None) -> dict[str, Any]:
        """Our answer to sleep ``sleep_id`` (pages unmapped, or ``refused``, ``why`` when it is
        not for want of a quiesce hook); waits for the daemon's decision while it lives:
        ``Conflict`` when it cancelled the sleep."""
        args = self._args(sleep_id=sleep_id, refused=refused)
        if why is not None:
            args["why"] = why[:MAX_WHY_CHARS]
        return self.control.call_until_answered("sleep_ready", args)

    # -- ending ----------------------------------------------------------------

    def abandon(self) -> None:
        """Close a lease whose daemon is gone, without telling anyone."""
        self.lost.set()
        self.close()

    def close(self) -> None:
        """Unregister (the daemon frees our pages) and close the handle channel."""
        if self._sock is None:
            self.control.close()
            return
        try:
            if not self.lost.is_set():
                self._unregister()
        finally:
            with contextlib.suppress(OSError):  # the peer may be gone already
                self._sock.shutdown(socket.SHUT_RDWR)
            if self._reader is not None:
                self._reader.join(5)
            self._sock.close()
            self._sock = None
            if self.grants is not None:
                self.grants.close()
                self.grants = None
            with self._frames_changed:
                for frames in self._frames.values():
                    for _, fds in frames:
                        close_fds(fds)
                self._frames.clear()
            self.control.close()

    def _unregister(self) -> None:
        """Tell the daemon we are done. Unregistering ends the lease: the daemon closes the
        handle channel, then replies, so a wait that sees the channel close first is over too
        (the daemon freed our pages, or died and holds none): only an error before that raises."""
        try:
            self.control.call("unregister", self._args())
        except DaemonUnreachable:
            if not self.lost.is_set():
                raise
            log.info("lease %s: the handle channel closed before the unregister's reply; done", self.name)


def _enough(frames: list[tuple[dict[str, Any], list[int]]], num_pages: int) -> bool:
    return sum(len(b.get("page_ids") or []) for b, _ in frames) >= num_pages


def _hand(handler: Callable[[Notice], None], notice: Notice, name: str) -> None:
    """Give ``notice`` to ``handler``; a handler that raises is logged (the reader goes on)."""
    try:
        handler(notice)
    except Exception:  # a user's handler: it must not end the reader, nor the notices after it
        log.exception("lease %s: the notice handler failed on a %s notice", name, notice.kind)
