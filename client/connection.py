"""``KVClient``: the engine's control connection to a kvdaemon.

A DEALER socket speaks the msgpack protocol of ``kvdaemon.wire.protocol``; each call
sends one request and waits at most ``timeout_s`` for its reply, raising
``DaemonUnreachable`` when nothing answers (and then starting a fresh socket,
so a late reply can never be taken for the next one). Notices the daemon sends
on its own (``shutdown``) are recorded as they arrive. All calls are
serialised by one lock, so a background thread may share the client.

The socket is opened on the first request, not in the constructor.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from pathlib import Path
from typing import Any

import zmq

from kvdaemon.client.lease import Lease
from kvdaemon.client.pool import KVPool
from kvdaemon.client.spec import KVSpec
from kvdaemon.errors import BadRequest, DaemonUnreachable, KVDaemonError
from kvdaemon.wire.paths import DaemonPaths, default_dir
from kvdaemon.wire.protocol import MAX_MESSAGE_BYTES, PROTOCOL_VERSION, decode, request, result_of


class KVClient:
    """Control connection to the daemon at ``dir`` (default ``$KVDAEMON_DIR`` or /tmp/kvdaemon-$UID)."""

    def __init__(self, dir: str | Path | None = None, timeout_s: float = 5.0) -> None:  # noqa: A002
        self.dir = Path(dir) if dir is not None else default_dir()
        self.paths = DaemonPaths(self.dir)
        self.timeout_s = timeout_s
        self.daemon_info: dict[str, Any] | None = None
        self.notices: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sock: zmq.Socket | None = None
        self._backend: Any = None
        self._open_pools: dict[int, KVPool] = {}  # id() -> pools registered here, not yet closed
        self._closed = False

    # -- transport -------------------------------------------------------------

    def _unreachable(self) -> DaemonUnreachable:
        return DaemonUnreachable(
            f"no kvdaemon running at {self.dir} — start it with `kvdaemon start`"
        )

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            if not self.paths.control_socket.exists():
                raise self._unreachable()
            # The process-wide context: never terminated here, so closing or
            # collecting a client can never block on another client's sockets.
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            sock.connect(self.paths.control_endpoint)
            self._sock = sock
        return self._sock

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def call(self, op: str, args: dict[str, Any] | None = None, timeout_s: float | None = None) -> Any:
        """Send one request and return its result; raise the error the daemon replied with.

        ``timeout_s`` (default: the client's) bounds the wait for this reply.
        """
        with self._lock:
            if self.daemon_info is None and op != "hello":
                self._hello_locked()
            return self._call_locked(op, args or {}, timeout_s)

    def _call_locked(self, op: str, args: dict[str, Any], timeout_s: float | None = None) -> Any:
        sock = self._socket()
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        sock.setsockopt(zmq.RCVTIMEO, max(1, int(wait_s * 1000)))
        request_id = next(self._ids)
        sock.send(request(request_id, op, args))
        while True:
            try:
                raw = sock.recv()  # waits at most timeout_s (RCVTIMEO)
            except zmq.Again:
                self._reset()
                self.daemon_info = None
                raise self._unreachable() from None
            message = decode(raw)
            if "notice" in message:
                self.notices.append(message)
                continue
            if message.get("id") == request_id:
                return result_of(message)

    def _hello_locked(self) -> dict[str, Any]:
        info = self._call_locked("hello", {"version": PROTOCOL_VERSION})
        self.daemon_info = info
        return info

    # -- ops -------------------------------------------------------------------

    def hello(self) -> dict[str, Any]:
        """Check the protocol version; return the daemon's pid, backend, page size, capacity."""
        with self._lock:
            return self._hello_locked()

    def status(self) -> dict[str, Any]:
        """The object of ``kvdaemon status --json``."""
        return self.call("status")

    def set_limit(
        self,
        name: str,
        *,
        max_bytes: int | None = None,
        min_bytes: int | None = None,
        weight: float | None = None,
        revision: int | None = None,
    ) -> dict[str, Any]:
        """Change a tenant's limits. ``revision`` makes it idempotent (see the daemon)."""
        args: dict[str, Any] = {"name": name}
        for key, value in (
            ("max_bytes", max_bytes), ("min_bytes", min_bytes), ("weight", weight),
            ("revision", revision),
        ):
            if value is not None:
                args[key] = value
        return self.call("set_limit", args)

    def sleep(self, name: str, mode: str = "warm", timeout_s: float = 60.0) -> dict[str, Any]:
        """Put tenant ``name`` to sleep and return once it sleeps.

        ``warm`` keeps its KV in host memory (restored on wake at the same
        addresses); ``cold`` drops it. Raises ``Conflict`` if the engine does
        not quiesce in time (then nothing was freed).
        """
        return self.call("sleep", {"name": name, "mode": mode}, timeout_s=timeout_s)

    def wake(self, name: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """Wake tenant ``name``: fresh pages at the same addresses, bytes restored if warm.

        When the tenant is a pool of this client, returns once the pool has mapped them.
        """
        result = self.call("wake", {"name": name}, timeout_s=timeout_s)
        for pool in list(self._open_pools.values()):
            if pool.name == name:
                pool.awake.wait(timeout_s)
        return result

    def shutdown(self) -> None:
        """Ask the daemon to exit (it releases every page first)."""
        self.call("shutdown")

    def register(
        self,
        name: str,
        spec: KVSpec,
        max_bytes: int | None = None,
        min_bytes: int = 0,
        weight: float = 1.0,
        *,
        virtual_bytes: int | None = None,
        num_spare_pages: int = 2,
        num_prefetch_pages: int = 1,
        auto_wake: bool = False,
        grow_wait_s: float | None = None,
    ) -> KVPool:
        """Register a tenant and return its started ``KVPool``.

        ``virtual_bytes`` (default: the daemon's capacity) is the KV capacity
        the pool's views span, over all segments; nothing is mapped until
        ``alloc``. ``grow_wait_s`` bounds how long a grow waits for other
        tenants' pages (``None``: the daemon's 2 s; ``0``: ``PoolExhausted`` at
        once, while the others are still asked to give pages back).
        Raises ``Conflict`` if the name is taken.
        """
        info = self.daemon_info or self.hello()
        page = int(info["page_size"])
        total = int(info["capacity_bytes"]) if virtual_bytes is None else virtual_bytes
        if isinstance(total, bool) or not isinstance(total, int) or total <= 0:
            raise BadRequest(f"virtual_bytes must be a positive number of bytes, got {total!r}")
        num_virtual_pages = max(1, total // (spec.num_segments * page))
        lease = self.lease(
            name, spec, num_virtual_pages=num_virtual_pages, max_bytes=max_bytes,
            min_bytes=min_bytes, weight=weight,
        )
        pool = KVPool(
            lease, spec, num_virtual_pages, num_spare_pages, num_prefetch_pages, auto_wake,
            register_args={"max_bytes": max_bytes, "min_bytes": min_bytes, "weight": weight},
        )
        pool.grow_wait_s = grow_wait_s
        try:
            pool.start()
        except KVDaemonError:
            lease.close()
            raise
        self._open_pools[id(pool)] = pool
        return pool

    def pool_closed(self, pool: KVPool) -> None:
        """Called by ``KVPool.close``: the last pool of a closed client closes the backend."""
        self._open_pools.pop(id(pool), None)
        if self._closed and not self._open_pools:
            self._close_backend()

    def _close_backend(self) -> None:
        if self._backend is not None:
            self._backend.close()
            self._backend = None

    def lease(
        self,
        name: str,
        spec: KVSpec,
        *,
        num_virtual_pages: int,
        max_bytes: int | None = None,
        min_bytes: int = 0,
        weight: float = 1.0,
    ) -> Lease:
        """Register a tenant and attach its handle channel; return its ``Lease``.

        ``num_virtual_pages`` is how many logical pages the caller's reserved
        ranges hold. Raises ``Conflict`` if the name is taken.
        """
        args: dict[str, Any] = {
            "name": name, "spec": spec.to_wire(), "num_virtual_pages": num_virtual_pages,
            "min_bytes": min_bytes, "weight": weight, "pid": os.getpid(),
        }
        if max_bytes is not None:
            args["max_bytes"] = max_bytes
        reply = self.call("register", args)
        lease = Lease(self, name, reply)
        try:
            lease.attach()
        except KVDaemonError:
            with contextlib.suppress(KVDaemonError):  # free the name now, not at the attach timeout
                self.call("unregister", {"tenant": name, "token": lease.token})
            raise
        return lease

    def backend(self) -> Any:
        """This process's importer backend, matching the daemon's (opened once)."""
        if self._backend is None:
            from kvdaemon.cuda_vmm import open_backend

            info = self.daemon_info or self.hello()
            self._backend = open_backend(
                info["backend"], page_size_bytes=info["page_size"], device=info["device"]
            )
        return self._backend

    def close(self) -> None:
        """Close the socket. Pools registered here stay usable until closed; the
        backend (this process's imported pages and ranges) closes with the last of them."""
        with self._lock:
            self._reset()
            self._closed = True
        if not self._open_pools:
            self._close_backend()

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
