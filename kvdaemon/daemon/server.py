"""The daemon process: sockets, the event loop, leases.

One thread runs everything that changes state: it polls the ZeroMQ ROUTER
(control), the handle channel (``LeaseTable``: listener and connections) and a
wake-up pipe that ``stop()`` writes to. No client can stall the loop: replies
that cannot go out are dropped, handle frames are buffered.

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
import time
from collections.abc import Callable

import zmq

from kvdaemon.daemon.config import DaemonConfig
from kvdaemon.cuda_vmm import open_backend
from kvdaemon.errors import BadRequest
from kvdaemon.daemon.lease_table import LeaseTable
from kvdaemon.daemon.metrics import Metrics
from kvdaemon.wire.paths import DaemonPaths
from kvdaemon.wire.protocol import MAX_MESSAGE_BYTES, notice, reply_error
from kvdaemon.daemon.service import Service

log = logging.getLogger("kvdaemon.daemon.server")
ATTACH_TIMEOUT_S = 10.0
POLL_MS = 100


class Daemon:
    """A kvdaemon instance for one directory. ``start`` binds, ``serve`` runs the loop."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.paths = DaemonPaths(config.dir)
        self.service: Service | None = None
        self.metrics: Metrics | None = None
        self._ctx: zmq.Context | None = None
        self._router: zmq.Socket | None = None
        self._wake_r, self._wake_w = -1, -1
        self._poller = zmq.Poller()
        self.leases = LeaseTable(self._poller, self._attach, self._end_lease)
        self._listener_fd = -1
        self._stopping = False
        self.attach_timeout_s = ATTACH_TIMEOUT_S
        self._next_expiry_check = 0.0
        self.on_stopping: Callable[[], None] = lambda: None  # first thing the teardown calls

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
        self.service = Service(
            backend, self.leases, on_grant=self._on_grant, on_shrink=self._on_shrink
        )
        self.service.reclaimer.sleep_victims = cfg.reclaim_sleep
        old_umask = os.umask(0o077)
        try:
            self._bind_control()
            self._listener_fd = self.leases.bind(str(self.paths.handle_socket))
            os.chmod(self.paths.handle_socket, 0o600)
        finally:
            os.umask(old_umask)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        if cfg.metrics_port:
            self.metrics = Metrics(cfg.metrics_port, self._snapshot, host=cfg.metrics_host)
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
                if events.get(self._listener_fd):
                    self.leases.accept()
                self.leases.handle_events(events)
                if events.get(self._wake_r):
                    os.read(self._wake_r, 64)
                self.leases.close_dead()
                self._send_deferred()
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
            if reply is not None:
                self._send_control(routing_id, reply)
            if self.service.reclaimer.parked:  # pages may have come back: serve waiting grows
                with self.service.lock:
                    self.service.reclaimer.retry(time.monotonic())
            self._send_deferred()

    def _send_deferred(self) -> None:
        """Send the replies ops completed later (a sleep answered when the tenant quiesced)."""
        assert self.service is not None
        while self.service.replies:
            self._send_control(*self.service.replies.pop(0))

    def _send_control(self, routing_id: bytes, payload: bytes) -> None:
        assert self._router is not None
        try:
            self._router.send_multipart([routing_id, payload], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone or its queue full: drop the reply
            log.warning("could not reply to a client: %s", exc)

    # -- handle channel --------------------------------------------------------

    def _attach(self, name: str, token: str, pid: int) -> int:
        assert self.service is not None
        with self.service.lock:
            return self.service.attach(name, token, pid).tenant_id

    def _end_lease(self, tenant_id: int, why: str, expired: bool) -> None:
        assert self.service is not None
        with self.service.lock:
            tenant = self.service.by_id.get(tenant_id)
            if tenant is None:
                return
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
            self.service.tick(now, self.config.idle_sleep_s, self.config.idle_mode)
        self._send_deferred()
        self.leases.expire(now, self.attach_timeout_s)

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
        self.on_stopping()
        log.info("kvdaemon shutting down")
        for tenant in list(self.service.tenants.values()):
            self._send_control(tenant.routing_id, notice("shutdown", {"tenant": tenant.name}))
        self.leases.close_all()
        with self.service.lock:
            for tenant in list(self.service.tenants.values()):
                self.service.remove(tenant)
        self.service.sleeper.buffers.clear()  # unpinning needs the backend still open
        self.service.backend.close()
        if self.metrics is not None:
            self.metrics.stop()
        if self._router is not None:
            self._router.close(linger=500)  # let the last replies and notices out
        if self._ctx is not None:
            self._ctx.term()
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
