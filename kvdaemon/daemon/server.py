"""The daemon process: sockets, the event loop, leases.

One thread runs everything that changes state: it polls the ZeroMQ ROUTER
(control), the handle channel (``LeaseTable``: listener and connections) and a
wake-up pipe that ``stop()`` writes to, and between polls moves a slice of each
warm sleep's or wake's copy (``kvdaemon.daemon.copies``; the poll does not wait
while one runs). No client can stall the loop: replies
that cannot go out are dropped, handle frames are buffered. One round of the
loop serves at most ``CONTROL_BATCH`` requests (or ``CONTROL_BUDGET_S``) before
it turns to the handle channel, and a request is unpacked within
``REQUEST_LIMITS``, so a flooding client delays others by a bounded amount;
ZeroMQ's ROUTER already takes requests from its peers in turn.

Leases: a tenant's handle connection is its lease. When it reaches EOF (the
engine exited or was killed), the tenant is removed and its pages freed in the
same loop iteration, so they are back within one poll wake-up. A tenant that
registers but never attaches its handle channel is dropped after
``attach_timeout_s``.

Stopping (``stop()``, SIGTERM, a ``shutdown`` op, or any exception escaping
the loop) never releases a page a live tenant maps: tenants are told
(``shutdown`` notice), their handle channels closed, and they keep serving
from their mappings, exactly as after a SIGKILL of the daemon; a daemon started
later on the same directory takes them back (see ``kvdaemon.client``).
"""

from __future__ import annotations

import logging
import os
import resource
import time
from collections.abc import Callable
from typing import Any

import zmq

from kvdaemon.daemon.config import DaemonConfig
from kvdaemon.daemon.control_peers import MIN_PEERS, ControlPeers, peer_cap
from kvdaemon.cuda_vmm import open_backend
from kvdaemon.cuda_vmm.backend import Backend
from kvdaemon.daemon.lease_table import LeaseTable, fd_budget
from kvdaemon.daemon.log_throttle import LogThrottle
from kvdaemon.daemon.metrics import Metrics
from kvdaemon.daemon.policy_book import PolicyBook
from kvdaemon.daemon.policy_file import policy_path
from kvdaemon.daemon.ports import notify
from kvdaemon.errors import BadRequest, DaemonUnreachable
from kvdaemon.wire.messages import ShutdownNotice
from kvdaemon.wire.paths import DaemonPaths
from kvdaemon.wire.protocol import MAX_MESSAGE_BYTES, reply_error
from kvdaemon.wire.sizes import format_bytes
from kvdaemon.daemon.service import Service

log = logging.getLogger("kvdaemon.daemon.server")
POLL_MS = 100
CONTROL_BATCH = 64
CONTROL_BUDGET_S = 0.02
CONTROL_SNDHWM = 16  # replies queued per control peer (see ``_bind_control``)
CONTROL_RCVHWM = 8  # requests queued per control peer: 8 MiB at most at the 1 MiB frame limit (it was 64)


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
        self.leases = LeaseTable(
            self._poller, self._attach, self._end_lease, self._attach_grants, self._serve_grant_request
        )
        self._listener_fd = -1
        self._stopping = False
        self._shutting_down = False  # leases closing now are not tenant deaths
        self._next_tick = 0.0
        self.warnings = LogThrottle(log)
        self.control_peers = ControlPeers(self.warnings)
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
        policies = PolicyBook(cfg.tenant_policies, policy_path(self.paths.root))
        policies.load()  # the operator's `kvdaemon limit`s of the daemon before
        self.service = Service(
            backend, self.leases, cfg, sink=self._send_control, on_grant=self._on_grant,
            on_shrink=self._on_shrink, policies=policies,
        )
        old_umask = os.umask(0o077)
        try:
            self._bind_control()
            self._listener_fd = self.leases.bind(str(self.paths.handle_socket))
            os.chmod(self.paths.handle_socket, 0o600)
        finally:
            os.umask(old_umask)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self.control_peers.monitor, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        if cfg.metrics_port:
            self.metrics = Metrics(cfg.metrics_port, self._snapshot, host=cfg.metrics_host)
            self.metrics.start()
        idle = "off" if cfg.idle_sleep_s is None else f"{cfg.idle_mode} after {cfg.idle_sleep_s:g} s"
        log.info(
            "kvdaemon serving at %s: backend %s, %d pages of %s (%s); idle sleep %s; reclaim %s idle tenants",
            self.paths.root, kind, num_pages, format_bytes(cfg.page_size_bytes),
            format_bytes(num_pages * cfg.page_size_bytes), idle,
            "may sleep" if cfg.reclaim_sleep else "never sleeps",
        )
        _warn_map_cap(backend, num_pages)

    def _bind_control(self) -> None:
        self._ctx = zmq.Context()
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Requests queued here per peer: past CONTROL_RCVHWM the kernel holds a flooding peer back,
        # so one peer holds at most that many frames of MAX_MESSAGE_BYTES (the number of peers is
        # bounded only by the process's fd limit).
        router.setsockopt(zmq.RCVHWM, CONTROL_RCVHWM)
        # A client waits for each reply before its next request, so a peer with more than
        # SNDHWM replies unread is not reading: past it replies are dropped, not queued.
        router.setsockopt(zmq.SNDHWM, CONTROL_SNDHWM)
        self.control_peers.start(self._ctx, router, _control_peer_cap(), str(self.paths.control_socket))
        router.bind(self.paths.control_endpoint)
        os.chmod(self.paths.control_socket, 0o600)
        self._router = router

    def stop(self) -> None:
        """Ask the loop to stop. Safe from any thread and from a signal handler."""
        self._stopping = True
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")
            except OSError:  # full (a wake-up is pending anyway), or closed by a stop in progress
                pass

    # -- loop ------------------------------------------------------------------

    def serve(self) -> None:
        """Run until ``stop()`` or a ``shutdown`` op, then release everything."""
        assert self.service is not None, "start() first"
        try:
            copies = self.service.sleeper.copies
            while not self._stopping and not self.service.shutdown_requested:
                events = dict(self._poller.poll(0 if copies.busy else POLL_MS))
                if events.get(self._router):
                    self._drain_control()
                if events.get(self.control_peers.monitor):  # after the requests: who spoke is known
                    self.control_peers.drain()
                if events.get(self._listener_fd):
                    self.leases.accept()
                self.leases.handle_events(events)
                if events.get(self._wake_r):
                    os.read(self._wake_r, 64)
                self.leases.close_dead()
                if copies.busy:  # a slice of each warm copy under way, then back to the sockets
                    with self.service.lock:
                        self.service.step_copies()
                if time.monotonic() >= self._next_tick:
                    self._next_tick = time.monotonic() + POLL_MS / 1000
                    self._tick()
                    self.warnings.flush()
        finally:
            self._shutdown()

    def _drain_control(self) -> None:
        """Serve queued requests: at most ``CONTROL_BATCH`` of them or ``CONTROL_BUDGET_S``.

        What is left stays queued (the next poll returns at once), so the handle
        channel and the timers get their turn while a client floods.
        """
        assert self._router is not None and self.service is not None
        deadline = time.monotonic() + CONTROL_BUDGET_S
        for _ in range(CONTROL_BATCH):
            if time.monotonic() > deadline:
                return
            try:
                parts = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(parts) < 2:
                continue
            self.control_peers.spoke(parts[-1].get(zmq.SRCFD))  # a client: kept past the bound
            frames = [part.bytes for part in parts]
            routing_id = frames[0]
            if len(frames) != 2:
                reply = reply_error(None, BadRequest("a request is exactly one frame"))
            else:
                reply = self.service.dispatch(routing_id, frames[1])
            if reply is not None:
                self._send_control(routing_id, reply)
            if self.service.reclaimer.parked:  # pages may have come back: serve waiting grows
                with self.service.lock:
                    self.service.reclaimer.retry(self.service.clock())

    def _send_control(self, routing_id: bytes, payload: bytes) -> None:
        assert self._router is not None
        try:
            self._router.send_multipart([routing_id, payload], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone or its queue full: drop the reply
            self.warnings.warning("reply", "could not reply to a client: %s", exc)

    # -- handle channel --------------------------------------------------------

    def _attach(self, name: str, token: str, pid: int) -> tuple[int, dict[str, Any]]:
        """Bind a lease; its reply tells the limits as of now (a change since the
        registration's reply had no lease to reach)."""
        assert self.service is not None
        with self.service.lock:
            tenant = self.service.attach(name, token, pid)
            return tenant.tenant_id, {"limit": tenant.limits()}

    def _attach_grants(self, name: str, token: str, pid: int) -> int:
        assert self.service is not None
        with self.service.lock:
            return self.service.attach_grants(name, token, pid)

    def _serve_grant_request(self, message: dict, sink: Callable[[bytes, bytes], None]) -> bytes | None:
        """A grow or shrink from a tenant's grant channel, served as a control request is."""
        assert self.service is not None
        reply = self.service.serve(message, b"", sink)
        if self.service.reclaimer.parked:  # a shrink may serve waiting grows
            with self.service.lock:
                self.service.reclaimer.retry(self.service.clock())
        return reply

    def _end_lease(self, tenant_id: int, why: str, expired: bool) -> None:
        assert self.service is not None
        if self._shutting_down:
            return  # the tenant lives on and still maps its pages: keep them
        with self.service.lock:
            tenant = self.service.tenants.get(tenant_id)
            if tenant is None:
                return
            self.service.remove(tenant, f"its lease ended without an unregister ({why})", clean=False)
        if expired and self.metrics is not None:
            self.metrics.count_lease_expiry()

    def _tick(self) -> None:
        """Periodic work: the service's timers, then handle connections that never attached."""
        assert self.service is not None
        with self.service.lock:
            now = self.service.clock()
            self.service.tick(now)
        self.leases.expire(time.monotonic(), self.config.attach_timeout_s)

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
        """Tell tenants, close their leases, and let go of the backend without releasing
        a page any tenant maps (the memory lives on in the tenants' imported handles)."""
        assert self.service is not None
        self.on_stopping()
        log.info("kvdaemon shutting down; %d tenant(s) keep their pages", len(self.service.tenants))
        self._shutting_down = True
        with self.service.lock:
            self.service.reclaimer.cancel_all(DaemonUnreachable("the daemon is stopping"))
            for tenant in self.service.tenants:
                if tenant.warm is not None:
                    log.warning("tenant %s sleeps warm: its %d bytes of KV kept in host memory die with "
                                "this daemon (it wakes empty under the next one)", tenant.name,
                                tenant.warm.host_bytes)  # fmt: skip
                # a warm copy dies with the daemon; a caller waiting for a sleep is told why
                self.service.forget_sleep(tenant, stopping=True)
                notify(self.leases, tenant.tenant_id, ShutdownNotice())
        self.leases.close_all()
        self.service.sleeper.buffers.clear()  # unpinning needs the backend still open
        self.service.backend.close()
        if self.metrics is not None:
            self.metrics.stop()
        self.control_peers.close()
        if self._router is not None:
            self._router.close(linger=500)  # let the last replies and notices out
        if self._ctx is not None:
            self._ctx.term()
        for path in self.paths.sockets():
            path.unlink(missing_ok=True)
        fds, (self._wake_r, self._wake_w) = (self._wake_r, self._wake_w), (-1, -1)
        for fd in fds:
            if fd >= 0:
                os.close(fd)


def _warn_map_cap(backend: Backend, num_pages: int) -> None:
    """Log where one tenant could not map the whole capacity before its process's mappings reach
    the OS's cap (host backend, small pages: ``HostBackend.mappable_pages``)."""
    mappable = backend.mappable_pages()
    if mappable < num_pages:
        log.warning(
            "a tenant process may map about %d of the %d pages before its memory mappings reach "
            "vm.max_map_count (%s); past that its grows are refused: raise vm.max_map_count or the page size",
            mappable, num_pages, format_bytes(mappable * backend.page_size_bytes),
        )


def _control_peer_cap() -> int:
    """Control connections kept: what the handle channel's fd budget leaves, less the monitor's
    queue, halved (``control_peers.peer_cap``); a warning where the fd limit leaves too few."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    cap = peer_cap(soft - fd_budget(soft))
    if cap == MIN_PEERS:
        log.warning(
            "the fd limit (%d) leaves few fds beside the handle channel's: a flood of control connections "
            "could still exhaust them before they are shut down; raise the hard RLIMIT_NOFILE "
            "(systemd: LimitNOFILE) to 8192 or more", soft,
        )
    return cap


def _raise_fd_limit() -> None:
    """Lift the soft fd limit to the hard one: every page in flight is an fd (CUDA).

    The handle channel's fd budget (``lease_table.fd_budget``) keeps headroom under the result.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:  # e.g. a hard limit above the kernel's nr_open
            log.warning("cannot raise the fd limit from %d to %d: %s", soft, hard, exc)
