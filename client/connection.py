"""``KVClient``: the engine's and operator's control connection to a kvdaemon.

Requests go over a ``ControlChannel`` (ZeroMQ DEALER, msgpack): each call waits
at most ``timeout_s`` for its reply and raises ``NoReply`` when the daemon
holds its directory but does not answer, ``DaemonUnreachable`` when none runs.
Before the first request the client checks the directory (ours, 0700, not a
symlink) and speaks the protocol version (``hello``). Calls are serialised by
one lock, so threads may share a client.

``register`` returns a started ``KVPool``; a pool has its own lease channels,
so a caller blocked here (a sleep waiting for an engine to quiesce) never
blocks any pool's answers to the daemon. The socket opens on the first request.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvdaemon.client.control import ControlChannel
from kvdaemon.client.lease import Lease
from kvdaemon.client.spec import KVSpec
from kvdaemon.errors import BadRequest, DaemonUnreachable, KVDaemonError, PoolClosed
from kvdaemon.wire.messages import checked_limit, describe_clamp
from kvdaemon.wire.paths import DaemonPaths, default_dir, running_pid
from kvdaemon.wire.protocol import MAX_VIRTUAL_PAGES, PROTOCOL_VERSION

if TYPE_CHECKING:
    from kvdaemon.client.pool import KVPool

log = logging.getLogger("kvdaemon.client")


class KVClient:
    """Control connection to the daemon at ``dir`` (default ``$KVDAEMON_DIR``, else the
    per-user default)."""

    def __init__(self, dir: str | Path | None = None, timeout_s: float = 5.0) -> None:  # noqa: A002
        self.dir = Path(dir) if dir is not None else default_dir()
        self.paths = DaemonPaths(self.dir)
        self.timeout_s = check_timeout(timeout_s)
        self.daemon_info: dict[str, Any] | None = None
        self._channel = ControlChannel(self.paths, timeout_s, alive=self._same_daemon)
        self._lock = threading.Lock()
        self._backend: Any = None
        self._backend_lock = threading.Lock()  # threads registering at once open one backend
        self._open_pools: dict[int, KVPool] = {}  # id() -> pools registered here, not yet closed
        self._closed = False

    # -- transport -------------------------------------------------------------

    def call(self, op: str, args: dict[str, Any] | None = None, timeout_s: float | None = None) -> Any:
        """Send one request and return its result; raise the error the daemon replied with.

        ``timeout_s`` (default: the client's) bounds the wait for this reply: a positive
        number of seconds, checked before anything is sent (``BadRequest``).
        """
        if timeout_s is not None:
            check_timeout(timeout_s)
        with self._lock:
            if self._closed:
                raise PoolClosed("this KVClient is closed")
            if self.daemon_info is None and op != "hello":
                self._hello_locked()
            try:
                return self._channel.call(op, args or {}, timeout_s)
            except KVDaemonError as exc:
                if isinstance(exc, DaemonUnreachable):
                    self.daemon_info = None  # a restarted daemon may differ: ask again
                raise

    def _hello_locked(self) -> dict[str, Any]:
        if not self._same_daemon():  # a dead daemon's socket is left behind: no timeout for it
            raise self._channel.unreachable()
        info = self._channel.call("hello", {"version": PROTOCOL_VERSION})
        self.daemon_info = info
        return info

    def _same_daemon(self) -> bool:
        """False once the daemon this client spoke to no longer holds the directory (it died,
        or another took its place), or, before ``hello``, while no daemon holds it: a request
        it never answered will not be answered. One open and flock."""
        if not self.paths.lock_file.exists():  # a daemon run without the lock (in tests)
            return True
        pid = running_pid(self.paths)
        info = self.daemon_info
        if info is None:
            return pid is not None
        return pid in (info.get("pid"), 0)

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
        """Change a tenant's limits as the operator does (``kvdaemon limit``): the daemon keeps
        them as the name's policy, across the tenant's re-registration and daemon restarts,
        until changed or reset. ``revision`` makes it idempotent (see the daemon).

        When the tenant is a pool of this client, the pool knows the new limits on return
        (its next grow is checked against them, not the ones before the change).
        """
        args: dict[str, Any] = {"name": name}
        for key, value in (
            ("max_bytes", max_bytes), ("min_bytes", min_bytes), ("weight", weight),
            ("revision", revision),
        ):
            if value is not None:
                args[key] = value
        own = self._own_pool(name)
        lease = None if own is None else own.core.lease
        result = self.call("set_limit", args)
        limit = result.get("limit")
        told = checked_limit({**limit, "revision": result.get("revision")}) if isinstance(limit, dict) else None
        if own is not None and told is not None:
            own.core.set_limit(told, lease=lease)  # unless it moved daemons since
        return result

    def sleep(self, name: str, mode: str = "warm", timeout_s: float = 60.0) -> dict[str, Any]:
        """Put tenant ``name`` to sleep and return once it sleeps.

        ``warm`` keeps its KV in host memory (restored on wake at the same
        addresses); ``cold`` drops it. Raises ``Conflict`` if the engine does
        not quiesce in time or cannot be quiesced (then nothing was freed), and
        ``NoReply`` if no answer came within ``timeout_s`` (the sleep may still
        complete). A pool of this client sleeps on its owner's word, and has
        slept locally when this returns (an engine's next step may have woken it).
        """
        args: dict[str, Any] = {"name": name, "mode": mode}
        own = self._own_pool(name)
        if own is not None:
            args["token"] = own.lease.token
        num_sleeps = 0 if own is None else own.core.cell.num_sleeps
        result = self.call("sleep", args, timeout_s=timeout_s)
        if own is not None and str(result.get("state", "")).startswith("sleeping"):
            with own.core.lock:  # asleep here too on return (or woken again already)
                own.core.cell.wait_slept(num_sleeps, timeout_s)
        return result

    def wake(self, name: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """Wake tenant ``name``: fresh pages at the same addresses, bytes restored if warm.

        When the tenant is a pool of this client, returns once the pool has mapped them.
        """
        own = self._own_pool(name)
        args: dict[str, Any] = {"name": name}
        if own is not None:  # its owner's word, as for sleep (the daemon's log says who woke it)
            args["token"] = own.lease.token
        num_wakes = 0 if own is None else own.core.cell.num_wakes
        result = self.call("wake", args, timeout_s=timeout_s)
        if own is not None:
            own.wait_woken(num_wakes, timeout_s)
        return result

    def _own_pool(self, name: str) -> KVPool | None:
        return next((p for p in list(self._open_pools.values()) if p.name == name), None)

    def shutdown(self) -> list[dict[str, Any]]:
        """Ask the daemon to exit (tenants keep their pages and wait for the next one).
        Returns the warm sleepers whose KV dies with it (``name``, ``host_bytes``)."""
        return list(self.call("shutdown").get("dropped_warm", []))

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
        Raises ``Conflict`` if the name is taken, ``PoolClosed`` on a closed client.
        """
        if self._closed:
            raise PoolClosed("this KVClient is closed")
        if not isinstance(spec, KVSpec):
            raise BadRequest(f"spec must be a KVSpec, got {type(spec).__name__}")
        info = self.daemon_info or self.hello()
        told_s = info.get("reclaim_wait_s")
        most_s = float(told_s) if isinstance(told_s, (int, float)) and not isinstance(told_s, bool) else math.inf
        from kvdaemon.client.pool import KVPool, check_wait_s  # the pool's machinery: not for a CLI's status

        check_wait_s(grow_wait_s, most_s)
        _check_pages_kept(num_spare_pages=num_spare_pages, num_prefetch_pages=num_prefetch_pages)
        if not isinstance(auto_wake, bool):
            raise BadRequest(f"auto_wake must be True or False, got {auto_wake!r}")
        page = int(info["page_size"])
        total = int(info["capacity_bytes"]) if virtual_bytes is None else virtual_bytes
        if isinstance(total, bool) or not isinstance(total, int) or total <= 0:
            raise BadRequest(f"virtual_bytes must be a positive number of bytes, got {total!r}")
        num_virtual_pages = max(1, total // (spec.num_segments * page))
        if num_virtual_pages > MAX_VIRTUAL_PAGES:
            raise BadRequest(
                f"virtual_bytes {total} spans {num_virtual_pages} logical pages of "
                f"{spec.num_segments * page} bytes; at most {MAX_VIRTUAL_PAGES} are allowed"
            )
        limits = {"max_bytes": max_bytes, "min_bytes": min_bytes, "weight": weight}
        lease = self.lease(name, spec, num_virtual_pages=num_virtual_pages, **limits)

        def relink() -> Lease:
            return self._relink(name, spec, num_virtual_pages, limits, lease.page_size_bytes)

        try:  # whatever fails, the name goes back to the daemon with the lease
            pool = KVPool(
                lease, spec, num_virtual_pages, num_spare_pages, num_prefetch_pages, auto_wake,
                relink=relink, on_close=self._pool_closed,
            )
            pool.core.most_wait_s = most_s
            pool.grow_wait_s = grow_wait_s
            pool.start()
        except BaseException:
            with contextlib.suppress(KVDaemonError):  # the first error is the one to tell
                lease.close()
            raise
        self._open_pools[id(pool)] = pool
        return pool

    def _relink(
        self, name: str, spec: KVSpec, num_virtual_pages: int, limits: dict[str, Any], page_bytes: int,
    ) -> Lease:
        """Register ``name`` again with a daemon that answers now (after a restart). ``Conflict``
        (nothing registered; the daemon logs it too) when its pages are not ``page_bytes``: the
        pool's layout is built on them, so its KV cannot move there."""
        with self._lock:
            self.daemon_info = None
        return self.lease(name, spec, num_virtual_pages=num_virtual_pages, page_size=page_bytes, **limits)

    def _pool_closed(self, pool: KVPool) -> None:
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
        sleepable: bool = False,
        page_size: int | None = None,
    ) -> Lease:
        """Register a tenant and attach its handle channel; return its ``Lease``.

        ``num_virtual_pages`` is how many logical pages the caller's reserved
        ranges hold. Raises ``Conflict`` if the name is taken, or where
        ``page_size`` (the pages a layout is already built on) is not the daemon's.
        """
        args: dict[str, Any] = {
            "name": name, "spec": spec.to_wire(), "num_virtual_pages": num_virtual_pages,
            "min_bytes": min_bytes, "weight": weight, "pid": os.getpid(), "sleepable": sleepable,
        }
        if max_bytes is not None:
            args["max_bytes"] = max_bytes
        if page_size is not None:
            args["page_size"] = page_size
        reply = self.call("register", args)
        for clamp in reply.get("clamped") or []:  # the daemon applied less than asked: said, not silent
            log.warning("tenant %s: %s", name, describe_clamp(clamp))
        lease = Lease(self.paths, self.timeout_s, self.backend(), name, reply)
        try:
            lease.attach()
        except KVDaemonError:
            with contextlib.suppress(KVDaemonError):  # free the name now, not at the attach timeout
                self.call("unregister", {"tenant": name, "token": lease.token})
            raise
        return lease

    def backend(self) -> Any:
        """This process's importer backend, matching the daemon's (opened once, whichever
        threads ask at once)."""
        with self._backend_lock:
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
            self._channel.close()
            self._closed = True
        if not self._open_pools:
            self._close_backend()

    def close_all(self) -> None:
        """Close every pool registered here that is still open, then the client. Never raises
        for a pool whose daemon is gone (its pages go with this process)."""
        for pool in list(self._open_pools.values()):
            with contextlib.suppress(KVDaemonError):
                pool.close()
        self.close()

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def _check_pages_kept(**counts: object) -> None:
    """``num_spare_pages`` and ``num_prefetch_pages`` are counts of logical pages: ints >= 0."""
    for name, count in counts.items():
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise BadRequest(f"{name} must be a whole number of pages >= 0, got {count!r}")


def check_timeout(timeout_s: object) -> float:
    """``timeout_s`` if it is a positive, finite number of seconds; ``BadRequest`` otherwise."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        raise BadRequest(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    return float(timeout_s)
