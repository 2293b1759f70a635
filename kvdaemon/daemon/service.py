"""The daemon's ops: tenants, grants and limits over one page pool, without sockets.

``Service.dispatch`` is the one place a request becomes a reply: it decodes,
finds the op, runs it, and maps every ``KVDaemonError`` to its wire code. Each
op validates all its fields before it changes anything, so a refused request
leaves the state as it was. The server drives the service from a single
thread; nothing here locks, except ``lock``, which the metrics thread takes to
read a consistent snapshot.

Cost: ``grow``/``shrink`` are O(pages) plus one backend call per page;
``status`` is O(tenants).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections.abc import Callable
from typing import Any, Protocol

from kvdaemon import __version__
from kvdaemon.cuda_vmm.backend import Backend
from kvdaemon.errors import (
    BadRequest, Conflict, Forbidden, KVDaemonError, NoMemory, UnknownOp, UnknownTenant,
    VersionMismatch,
)
from kvdaemon.daemon.grants import Grants
from kvdaemon.daemon.limits import MAX_WEIGHT, apply_limit
from kvdaemon.daemon.page_pool import Owner, PagePool
from kvdaemon.daemon.reclaim import Reclaimer
from kvdaemon.daemon.sleep import DEFERRED, Sleeper
from kvdaemon.wire.protocol import MAX_INT, PROTOCOL_VERSION, Args, decode, reply_error, reply_ok
from kvdaemon.daemon.tenant import Tenant, WireSpec, check_name

log = logging.getLogger("kvdaemon.daemon.service")


class LeasePort(Protocol):
    """What the service needs from the server's handle channel."""

    def send_grant(
        self, tenant_id: int, grant_id: int, page_ids: list[int], fds: list[int],
        fd_index: list[int],
    ) -> None:
        """Queue one frame of a grant to the tenant (takes ownership of the fds)."""

    def drop_lease(self, tenant_id: int) -> None:
        """Close the tenant's handle connection, if any."""

    def send_notice(self, tenant_id: int, body: dict[str, Any]) -> None:
        """Queue a notice (e.g. ``reclaim``) to the tenant over its handle connection."""


class Service:
    """Tenants, grants and limits of one daemon (see the module docstring)."""

    def __init__(
        self,
        backend: Backend,
        leases: LeasePort,
        on_grant: Callable[[float, int], None] | None = None,
        on_shrink: Callable[[int], None] | None = None,
    ) -> None:
        self.backend = backend
        self.pool = PagePool(backend)
        self.leases = leases
        self.lock = threading.Lock()
        self.tenants: dict[str, Tenant] = {}
        self.by_id: dict[int, Tenant] = {}
        self.shutdown_requested = False
        self._next_tenant_id = 1
        self.grants = Grants(self.pool, leases, on_grant, on_shrink)
        self.sleeper = Sleeper(self)
        self.reclaimer = Reclaimer(self)
        self.replies: list[tuple[bytes, bytes]] = []  # deferred replies: (routing id, payload)
        self.current: tuple[bytes, int | None] = (b"", None)  # the request being served
        self._ops: dict[str, Callable[[Args, bytes], Any]] = {
            "hello": self.op_hello, "register": self.op_register, "grow": self.op_grow,
            "shrink": self.op_shrink, "heartbeat": self.op_heartbeat,
            "unregister": self.op_unregister, "status": self.op_status,
            "set_limit": self.op_set_limit, "shutdown": self.op_shutdown,
            "sleep": self.op_sleep, "sleep_ready": self.op_sleep_ready, "wake": self.op_wake,
        }

    # -- dispatch --------------------------------------------------------------

    def dispatch(self, routing_id: bytes, raw: bytes) -> bytes | None:
        """Turn one raw request into one raw reply. Never raises for bad input.

        Returns ``None`` when the op answers later (``DEFERRED``): its reply then
        appears in ``replies`` for the server to send.
        """
        request_id: int | None = None
        try:
            message = decode(raw)
            rid = message.get("id")
            request_id = rid if isinstance(rid, int) and not isinstance(rid, bool) else None
            op = message.get("op")
            if not isinstance(op, str):
                raise BadRequest("field 'op' must be a string")
            handler = self._ops.get(op)
            if handler is None:
                raise UnknownOp(f"unknown op {op[:64]!r}")
            with self.lock:
                self.current = (routing_id, request_id)
                result = handler(Args(message.get("args")), routing_id)
            return None if result is DEFERRED else reply_ok(request_id, result)
        except KVDaemonError as exc:
            return reply_error(request_id, exc)
        except (KeyError, ValueError, TypeError, AttributeError, AssertionError, OSError) as exc:
            log.exception("internal error serving a request")
            return reply_error(request_id, KVDaemonError(f"internal error: {exc!r}"))

    # -- tenant lookup ---------------------------------------------------------

    def _tenant(self, args: Args) -> Tenant:
        name = args.str("tenant")
        tenant = self.tenants.get(name)
        if tenant is None:
            raise UnknownTenant(f"no tenant named {name!r}")
        token = args.str("token", 128)
        if not _same_token(token, tenant.token):
            raise Forbidden(f"wrong token for tenant {name!r}")
        return tenant

    def _named(self, args: Args) -> Tenant:
        name = args.str("name")
        tenant = self.tenants.get(name)
        if tenant is None:
            raise UnknownTenant(f"no tenant named {name!r}")
        return tenant

    # -- ops -------------------------------------------------------------------

    def op_hello(self, args: Args, _rid: bytes) -> dict[str, Any]:
        version = args.int("version", 0, 1 << 16)
        if version != PROTOCOL_VERSION:
            raise VersionMismatch(
                f"client speaks protocol {version}, this daemon speaks {PROTOCOL_VERSION}"
            )
        return {
            "version": PROTOCOL_VERSION, "daemon_version": __version__, "pid": os.getpid(),
            "backend": self.backend.name, "device": self.backend.device,
            "page_size": self.pool.page_size_bytes, "capacity_bytes": self.pool.capacity_bytes,
        }

    def op_register(self, args: Args, routing_id: bytes) -> dict[str, Any]:
        name = check_name(args.str("name"))
        spec = WireSpec.parse(args.map("spec"))
        capacity = self.pool.capacity_bytes
        num_virtual_pages = args.int("num_virtual_pages", 1, 1 << 24)
        max_bytes = args.opt_int("max_bytes", 0, MAX_INT)
        max_bytes = capacity if max_bytes is None else min(max_bytes, capacity)
        min_bytes = args.int("min_bytes", 0, MAX_INT, default=0)
        weight = args.float("weight", 1e-6, MAX_WEIGHT, default=1.0)
        pid = args.int("pid", 0, 1 << 31, default=0)
        if min_bytes > max_bytes:
            raise BadRequest(f"min_bytes {min_bytes} exceeds max_bytes {max_bytes}")
        if name in self.tenants:
            raise Conflict(f"a tenant named {name!r} is already registered")
        guaranteed = sum(t.min_bytes for t in self.tenants.values())
        if guaranteed + min_bytes > capacity:
            raise NoMemory(
                f"min_bytes {min_bytes} does not fit: {guaranteed} of {capacity} already guaranteed"
            )
        tenant = Tenant(
            tenant_id=self._next_tenant_id, name=name, token=secrets.token_hex(16), pid=pid,
            spec=spec, page_size_bytes=self.pool.page_size_bytes,
            num_virtual_pages=num_virtual_pages, max_bytes=max_bytes, min_bytes=min_bytes,
            weight=weight, routing_id=routing_id,
        )
        tenant.limit_values = (max_bytes, min_bytes, weight)
        self._next_tenant_id += 1
        self.tenants[name] = tenant
        self.by_id[tenant.tenant_id] = tenant
        log.info("registered tenant %s (id %d, pid %d)", name, tenant.tenant_id, pid)
        return {
            "tenant_id": tenant.tenant_id, "token": tenant.token,
            "page_size": self.pool.page_size_bytes, "num_segments": spec.num_segments,
            "backend": self.backend.name, "max_bytes": max_bytes,
        }

    def op_grow(self, args: Args, _rid: bytes) -> dict[str, Any]:
        tenant = self._tenant(args)
        wanted = args.int_list("logical_pages", 0, tenant.num_virtual_pages - 1)
        wait_s = args.float("wait_s", 0.0, self.reclaimer.wait_s, default=self.reclaimer.wait_s)
        try:
            return self.grants.grow(tenant, wanted)
        except NoMemory:
            if self.reclaimer.park(tenant, wanted, self.current, wait_s):
                return DEFERRED  # answered by ``tick`` once pages come back, or NO_MEMORY
            raise

    def op_shrink(self, args: Args, _rid: bytes) -> dict[str, Any]:
        tenant = self._tenant(args)
        wanted = args.int_list("logical_pages", 0, tenant.num_virtual_pages - 1)
        return self.grants.shrink(tenant, wanted)

    def op_heartbeat(self, args: Args, _rid: bytes) -> dict[str, Any]:
        tenant = self._tenant(args)
        used = args.opt_int("used_bytes", 0, MAX_INT)
        if used is not None and used != tenant.used_bytes:
            tenant.used_bytes = used
            tenant.touch()
        return {"state": tenant.state, "max_bytes": tenant.max_bytes}

    def op_unregister(self, args: Args, _rid: bytes) -> dict[str, Any]:
        tenant = self._tenant(args)
        num_pages = self.remove(tenant)
        self.leases.drop_lease(tenant.tenant_id)
        return {"num_released": num_pages}

    def op_status(self, _args: Args, _rid: bytes) -> dict[str, Any]:
        return self.status()

    def op_set_limit(self, args: Args, _rid: bytes) -> dict[str, Any]:
        tenant = self._named(args)
        others = sum(t.min_bytes for t in self.tenants.values() if t is not tenant)
        result = apply_limit(tenant, args, self.pool.capacity_bytes, others)
        if result["changed"]:
            self.grants.ask_back_excess(tenant)
        return result

    def _named_or_own(self, args: Args) -> Tenant:
        """The tenant named by ``name``; with a ``token`` it must be that tenant's own."""
        tenant = self._named(args)
        if args.has("token") and not _same_token(args.str("token", 128), tenant.token):
            raise Forbidden(f"wrong token for tenant {tenant.name!r}")
        return tenant

    def op_sleep(self, args: Args, _rid: bytes) -> Any:
        tenant = self._named_or_own(args)
        mode = args.str("mode", 8) if args.has("mode") else "warm"
        if mode not in ("warm", "cold"):
            raise BadRequest(f"sleep mode must be 'warm' or 'cold', got {mode!r}")
        self.sleeper.begin(tenant, mode, self.current)
        return DEFERRED

    def op_sleep_ready(self, args: Args, _rid: bytes) -> dict[str, Any]:
        tenant = self._tenant(args)
        return self.sleeper.finish(tenant, args.int("sleep_id", 1))

    def op_wake(self, args: Args, _rid: bytes) -> dict[str, Any]:
        return self.sleeper.wake(self._named_or_own(args))

    def op_shutdown(self, _args: Args, _rid: bytes) -> dict[str, Any]:
        self.shutdown_requested = True
        return {}

    # -- lease events (from the server) ----------------------------------------

    def attach(self, name: str, token: str, pid: int) -> Tenant:
        """Bind a handle connection from ``pid`` to a tenant as its lease."""
        tenant = self.tenants.get(name)
        if tenant is None:
            raise UnknownTenant(f"no tenant named {name!r}")
        if not _same_token(token, tenant.token):
            raise Forbidden(f"wrong token for tenant {name!r}")
        if tenant.leased:
            raise Conflict(f"tenant {name!r} already has a handle channel")
        tenant.leased = True
        tenant.pid = pid
        return tenant

    def remove(self, tenant: Tenant) -> int:
        """Forget ``tenant`` and free every page it holds; return the pages freed."""
        num_pages = self.grants.release_all(tenant)
        self.sleeper.forget(tenant)
        del self.tenants[tenant.name]
        del self.by_id[tenant.tenant_id]
        log.info("removed tenant %s, %d pages back", tenant.name, num_pages)
        return num_pages

    def tick(self, now: float, idle_sleep_s: float | None = None, idle_mode: str = "warm") -> None:
        """Time-driven work: cancel stale sleeps, serve parked grows, the idle policy."""
        self.sleeper.expire(now)
        self.reclaimer.retry(now)
        if idle_sleep_s is not None:
            self.sleeper.sleep_idle(now, idle_sleep_s, idle_mode)

    def status(self) -> dict[str, Any]:
        """The object of ``status --json`` (DESIGN.md §13), plus host bytes and counters."""
        tenants = [t.status() for t in self.tenants.values()]
        return {
            "backend": self.backend.name,
            "page_size": self.pool.page_size_bytes,
            "capacity_bytes": self.pool.capacity_bytes,
            "free_bytes": self.pool.free_bytes,
            "host_bytes": sum(int(t["host_bytes"]) for t in tenants),
            "counters": {**self.reclaimer.stats(), **self.sleeper.stats()},
            "tenants": tenants,
        }

    def check_invariants(self) -> None:
        """Assert DESIGN.md §4 invariants 1-3 over the pool and every tenant."""
        self.pool.check()
        mapped = 0
        for tenant in self.tenants.values():
            for lp, pages in tenant.logical.items():
                assert len(pages) == tenant.spec.num_segments
                for seg, page in enumerate(pages):
                    assert self.pool.owner(page.page_id) == Owner(tenant.tenant_id, seg, lp)
            mapped += tenant.mapped_bytes
        assert mapped + self.pool.free_bytes == self.pool.capacity_bytes, "bytes lost"


def _same_token(given: str, expected: str) -> bool:
    """Constant-time comparison that accepts any string (compare_digest refuses non-ASCII str)."""
    return secrets.compare_digest(given.encode(), expected.encode())
