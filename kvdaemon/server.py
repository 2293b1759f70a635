"""The daemon process: sockets, the event loop, leases.

One thread runs everything that changes state: it polls the ZeroMQ ROUTER
(control), the AF_UNIX handle listener and every handle connection, and a
wake-up pipe that ``stop()`` writes to. Handle connections are non-blocking and
buffered (``Outbox``), so no client can stall the loop.

Leases: a tenant's handle connection is its lease. When it reaches EOF (the
engine exited or was killed), the tenant is removed and its pages freed in the
same loop iteration, so they are back within one poll wake-up. A tenant that
registers but never attaches its handle channel is dropped after
``ATTACH_TIMEOUT_S``.
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import time
from dataclasses import dataclass, field

import zmq

from kvdaemon.config import DaemonConfig
from kvdaemon.cuda_vmm import open_backend
from kvdaemon.errors import BadRequest, KVDaemonError
from kvdaemon.handles import Outbox, check_same_uid, close_fds, recv_frame
from kvdaemon.metrics import Metrics
from kvdaemon.paths import DaemonPaths
from kvdaemon.protocol import MAX_MESSAGE_BYTES, notice, reply_error
from kvdaemon.service import Service

log = logging.getLogger("kvdaemon.server")
ATTACH_TIMEOUT_S = 10.0
POLL_MS = 100
MAX_UNATTACHED = 256


@dataclass
class _Conn:
    """One accepted handle connection; ``tenant_id`` is set once attached."""

    sock: socket.socket
    outbox: Outbox
    pid: int
    accepted_at: float = field(default_factory=time.monotonic)
    tenant_id: int | None = None


class Daemon:
    """A kvdaemon instance for one directory. ``start`` binds, ``serve`` runs the loop."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.paths = DaemonPaths(config.dir)
        self.service: Service | None = None
        self.metrics: Metrics | None = None
        self._ctx: zmq.Context | None = None
        self._router: zmq.Socket | None = None
        self._listener: socket.socket | None = None
        self._conns: dict[int, _Conn] = {}
        self._leases: dict[int, _Conn] = {}
        self._dead: list[tuple[_Conn, str]] = []  # failed sends, closed after the current op
        self._wake_r, self._wake_w = -1, -1
        self._poller = zmq.Poller()
        self._stopping = False
        self.attach_timeout_s = ATTACH_TIMEOUT_S
        self._next_expiry_check = 0.0

    # -- setup -----------------------------------------------------------------

    def start(self) -> None:
        """Open the backend, bind both sockets (mode 0600), start metrics."""
        cfg = self.config
        _raise_fd_limit()
        probe = open_backend(cfg.backend, page_size_bytes=cfg.page_size_bytes, device=cfg.device)
        kind, total = probe.name, probe.mem_info().total_bytes
        probe.close()
        num_pages = cfg.capacity_bytes(total) // cfg.page_size_bytes
        backend = open_backend(
            kind, num_pages=num_pages, page_size_bytes=cfg.page_size_bytes, device=cfg.device
        )
        self.service = Service(backend, self, on_grant=self._on_grant, on_shrink=self._on_shrink)
        old_umask = os.umask(0o077)
        try:
            self._bind_control()
            self._bind_handles()
        finally:
            os.umask(old_umask)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._listener.fileno(), zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        if cfg.idle_sleep_s is not None:
            log.warning("--idle-sleep is not implemented yet (sleep and wake arrive later); ignored")
        if cfg.metrics_port:
            self.metrics = Metrics(cfg.metrics_port, self._snapshot)
            self.metrics.start()
        log.info(
            "kvdaemon serving at %s: backend %s, %d pages of %d bytes",
            self.paths.root, kind, num_pages, cfg.page_size_bytes,
        )

    def _bind_control(self) -> None:
        self._ctx = zmq.Context()
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.bind(self.paths.control_endpoint)
        os.chmod(self.paths.control_socket, 0o600)
        self._router = router

    def _bind_handles(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(str(self.paths.handle_socket))
        os.chmod(self.paths.handle_socket, 0o600)
        listener.listen(64)
        listener.setblocking(False)
        self._listener = listener

    def stop(self) -> None:
        """Ask the loop to stop. Safe from any thread and from a signal handler."""
        self._stopping = True
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                pass

    # -- loop ------------------------------------------------------------------

    def serve(self) -> None:
        """Run until ``stop()`` or a ``shutdown`` op, then release everything."""
        assert self.service is not None, "start() first"
        try:
            while not self._stopping and not self.service.shutdown_requested:
                events = dict(self._poller.poll(POLL_MS))
                if events.get(self._router):
                    self._drain_control()
                if events.get(self._listener.fileno()):
                    self._accept()
                for fd, conn in list(self._conns.items()):
                    flags = events.get(fd, 0)
                    if flags & zmq.POLLOUT:
                        self._flush(conn)
                    if flags & (zmq.POLLIN | zmq.POLLERR):
                        self._read_handle(conn)
                if events.get(self._wake_r):
                    os.read(self._wake_r, 64)
                self._close_dead()
                if time.monotonic() >= self._next_expiry_check:
                    self._next_expiry_check = time.monotonic() + POLL_MS / 1000
                    self._expire_unattached()
        finally:
            self._shutdown()

    def _drain_control(self) -> None:
        assert self._router is not None and self.service is not None
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue
            routing_id = frames[0]
            if len(frames) == 2:
                reply = self.service.dispatch(routing_id, frames[1])
            else:
                reply = reply_error(None, BadRequest("a request is exactly one frame"))
            self._send_control(routing_id, reply)

    def _send_control(self, routing_id: bytes, payload: bytes) -> None:
        assert self._router is not None
        try:
            self._router.send_multipart([routing_id, payload], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone or its queue full: drop the reply
            log.warning("could not reply to a client: %s", exc)

    # -- handle channel --------------------------------------------------------

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # out of fds: refuse new peers, keep serving the rest
                log.warning("cannot accept a handle connection: %s", exc)
                return
            if sum(1 for c in self._conns.values() if c.tenant_id is None) >= MAX_UNATTACHED:
                log.warning("too many unattached handle connections; refusing one")
                sock.close()
                continue
            try:
                pid = check_same_uid(sock)
            except KVDaemonError as exc:
                log.warning("refused handle connection: %s", exc)
                sock.close()
                continue
            sock.setblocking(False)
            conn = _Conn(sock, Outbox(sock), pid)
            self._conns[sock.fileno()] = conn
            self._poller.register(sock.fileno(), zmq.POLLIN)

    def _read_handle(self, conn: _Conn) -> None:
        try:
            body, fds = recv_frame(conn.sock)
        except BlockingIOError:
            return
        except (ConnectionError, OSError, KVDaemonError) as exc:
            self._close_conn(conn, f"handle channel closed: {exc}")
            return
        close_fds(fds)  # clients never send fds
        if conn.tenant_id is not None:
            conn.outbox.push({"notice": "revoked", "args": {"why": "unexpected frame"}})
            self._flush(conn)
            self._close_conn(conn, "unexpected frame on an attached handle channel")
            return
        self._attach(conn, body)

    def _attach(self, conn: _Conn, body: dict) -> None:
        assert self.service is not None
        name, token = body.get("tenant"), body.get("token")
        try:
            if not isinstance(name, str) or not isinstance(token, str):
                raise BadRequest("attach needs string fields 'tenant' and 'token'")
            with self.service.lock:
                tenant = self.service.attach(name, token, conn.pid)
        except KVDaemonError as exc:
            conn.outbox.push({"ok": False, "error": {"code": exc.code, "message": exc.message}})
            self._flush(conn)
            self._close_conn(conn, f"attach refused: {exc}")
            return
        conn.tenant_id = tenant.tenant_id
        self._leases[tenant.tenant_id] = conn
        conn.outbox.push({"ok": True, "tenant_id": tenant.tenant_id})
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        """Send what the socket takes. A failed send only marks the connection: it may
        run inside an op that holds the service lock, so the close waits for ``_close_dead``."""
        try:
            done = conn.outbox.flush()
        except OSError as exc:
            self._dead.append((conn, f"send failed: {exc}"))
            return
        flags = zmq.POLLIN if done else zmq.POLLIN | zmq.POLLOUT
        fd = conn.sock.fileno()
        if fd in self._conns:
            self._poller.register(fd, flags)

    def _close_dead(self) -> None:
        while self._dead:
            conn, why = self._dead.pop()
            self._close_conn(conn, why)

    def _close_conn(self, conn: _Conn, why: str, expired: bool = True) -> None:
        """Close a handle connection; an attached one ends its tenant's lease."""
        assert self.service is not None
        fd = conn.sock.fileno()
        if self._conns.pop(fd, None) is None:
            return
        self._poller.unregister(fd)
        conn.outbox.discard()
        conn.sock.close()
        if conn.tenant_id is None:
            return
        self._leases.pop(conn.tenant_id, None)
        with self.service.lock:
            tenant = self.service.by_id.get(conn.tenant_id)
            if tenant is not None:
                log.info("lease of %s ended (%s)", tenant.name, why)
                self.service.remove(tenant)
                if expired and self.metrics is not None:
                    self.metrics.count_lease_expiry()

    def _expire_unattached(self) -> None:
        assert self.service is not None
        now = time.monotonic()
        with self.service.lock:
            stale = [
                t for t in self.service.tenants.values()
                if not t.leased and now - t.registered_at > self.attach_timeout_s
            ]
            for tenant in stale:
                log.info("tenant %s never attached its handle channel; dropped", tenant.name)
                self.service.remove(tenant)
        for conn in list(self._conns.values()):
            if conn.tenant_id is None and now - conn.accepted_at > self.attach_timeout_s:
                self._close_conn(conn, "no attach frame in time")

    # -- LeasePort (called by the service) -------------------------------------

    def send_grant(
        self, tenant_id: int, grant_id: int, page_ids: list[int], fds: list[int],
        fd_index: list[int],
    ) -> None:
        conn = self._leases[tenant_id]
        conn.outbox.push_grant(grant_id, page_ids, fds, fd_index)
        self._flush(conn)

    def send_notice(self, tenant_id: int, body: dict) -> None:
        conn = self._leases.get(tenant_id)
        if conn is not None:
            conn.outbox.push(body)
            self._flush(conn)

    def drop_lease(self, tenant_id: int) -> None:
        conn = self._leases.pop(tenant_id, None)
        if conn is not None:
            conn.tenant_id = None
            self._close_conn(conn, "unregistered")

    # -- metrics ---------------------------------------------------------------

    def _on_grant(self, seconds: float, num_pages: int) -> None:
        if self.metrics is not None:
            self.metrics.observe_grant(seconds, num_pages)

    def _on_shrink(self, num_pages: int) -> None:
        if self.metrics is not None:
            self.metrics.count_shrink(num_pages)

    def _snapshot(self) -> dict:
        assert self.service is not None
        with self.service.lock:
            return self.service.status()

    # -- teardown --------------------------------------------------------------

    def _shutdown(self) -> None:
        assert self.service is not None
        log.info("kvdaemon shutting down")
        for tenant in list(self.service.tenants.values()):
            self._send_control(tenant.routing_id, notice("shutdown", {"tenant": tenant.name}))
        for conn in list(self._conns.values()):
            self._close_conn(conn, "daemon shutting down", expired=False)
        with self.service.lock:
            for tenant in list(self.service.tenants.values()):
                self.service.remove(tenant)
        self.service.backend.close()
        if self.metrics is not None:
            self.metrics.stop()
        if self._router is not None:
            self._router.close(linger=500)  # let the last replies and notices out
        if self._ctx is not None:
            self._ctx.term()
        if self._listener is not None:
            self._listener.close()
        for path in self.paths.sockets():
            path.unlink(missing_ok=True)
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1


def _raise_fd_limit() -> None:
    """Lift the soft fd limit to the hard one: every page in flight is an fd (CUDA)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
