"""The daemon's ops: tenants, grants and limits over the device's pages, without sockets.

``Service.dispatch`` is the one place a request becomes a reply: it decodes,
finds the op, runs it, and maps every ``KVDaemonError`` to its wire code; any
other exception is a bug of one request: it is logged with its traceback and
answered ``INTERNAL``, and the daemon goes on. Each op validates all its
fields before it changes anything, so a refused request leaves the state as it
was. An op that answers later returns a ``PendingReply`` (``call.defer()``),
completed through the reply sink the server gave.

Authentication: tenant ops carry the token the tenant got at registration;
admin ops (limits, sleeping or waking another tenant, shutdown) are open to
whoever can reach the control socket, which only the daemon's uid can (the
directory is 0700, the socket 0600).

The server drives the service from a single thread; nothing here locks, except
``lock``, which the metrics thread takes to read a consistent snapshot. The
clock is injected (``clock``), so tests drive time.

Cost: ``grow``/``shrink`` are O(pages) plus one backend call per page;
``status`` is O(tenants).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvdaemon import __version__
from kvdaemon.cuda_vmm.backend import Backend
from kvdaemon.daemon.config import DaemonConfig
from kvdaemon.daemon.grants import Grants
from kvdaemon.daemon.limits import Limiter, check_own
from kvdaemon.daemon.device_pages import Owner, DevicePages
from kvdaemon.daemon.policies import MAX_WEIGHT, MIN_WEIGHT, OwnLimits
from kvdaemon.daemon.policy_book import PolicyBook
from kvdaemon.daemon.ports import LeasePort
from kvdaemon.daemon.quarantine import Quarantine
from kvdaemon.daemon.reclaim import Reclaimer
from kvdaemon.daemon.reply import Call, PendingReply, ReplySink
from kvdaemon.daemon.shares import Shares
from kvdaemon.daemon.sleep import MAX_CACHED_BUFFER_BYTES, Sleeper
from kvdaemon.daemon.wake import Waker
from kvdaemon.daemon.log_throttle import LogThrottle
from kvdaemon.daemon.tenant import (
    MAX_TENANTS, MAX_UNATTACHED, MAX_UNATTACHED_PER_CONN, Tenant, Tenants, TenantState, WireSpec, check_name,
)
from kvdaemon.daemon import status_report, swap
from kvdaemon.daemon.tenant_log import ActivityLog, log_registered, log_removed
from kvdaemon.errors import (
    BadRequest, Conflict, DaemonUnreachable, Forbidden, KVDaemonError, NoMemory, OverLimit, UnknownOp,
    VersionMismatch,
)
from kvdaemon.wire.handles import MAX_GROW_PAGES, max_grant_pages
from kvdaemon.wire.messages import MAX_WHY_CHARS, SLEEP_MODES
from kvdaemon.wire.protocol import (
    MAX_INT, MAX_VIRTUAL_PAGES, PROTOCOL_VERSION, REQUEST_LIMITS, Args, decode, peek_request_id, reply_error,
    reply_ok,
)

log = logging.getLogger("kvdaemon.service")
MAX_CONNS_REMEMBERED = 4096  # control connections whose dropped registrations are counted (``_make_room``)
LOGGED_REFUSALS = frozenset({"BAD_REQUEST", "UNKNOWN_OP", "FORBIDDEN", "VERSION_MISMATCH", "BACKEND_ERROR"})
Clock = Callable[[], float]


def _op_name(op: object) -> str:
    """``op`` as a log names it: a short string, quoted where a peer's text could forge a line."""
    if not isinstance(op, str):
        return "malformed"
    return op if op.isidentifier() else repr(op[:40])


class Service:
    """Tenants, grants and limits of one daemon (see the module docstring)."""

    def __init__(
        self,
        backend: Backend,
        leases: LeasePort,
        config: DaemonConfig | None = None,
        *,
        sink: ReplySink = lambda _rid, _payload: None,
        clock: Clock = time.monotonic,
        on_grant: Callable[[float, int], None] | None = None,
        on_shrink: Callable[[int], None] | None = None,
        policies: PolicyBook | None = None,
    ) -> None:
        self.config = config if config is not None else DaemonConfig()
        self.backend = backend
        self.pages = DevicePages(backend, max_idle=MAX_CACHED_BUFFER_BYTES // backend.page_size_bytes)
        self.leases = leases
        self.sink = sink
        self.clock = clock
        self.lock = threading.Lock()
        self.tenants = Tenants()
        self.shutdown_requested = False
        self.started_at = clock()
        self.shares = Shares(self.tenants, self.pages.num_pages)
        self.grants = Grants(self.pages, leases, on_grant, on_shrink, shares=self.shares)
        self.quarantine = Quarantine(self.grants)
        self.sleeper = Sleeper(
            self.tenants, self.grants, backend, leases, self.config.sleep_timeout_s, self.clock,
            max_host_bytes=self.config.warm_memory.resolve(swap.host_memory_bytes()),
        )
        self.waker = Waker(self.sleeper)
        self.reclaimer = Reclaimer(
            self.tenants, self.shares, self.pages, self.grants, leases, self.sleeper,
            wait_s=self.config.reclaim_wait_s, escalate_s=self.config.reclaim_escalate_s,
            sleep_victims=self.config.reclaim_sleep, victim_idle_s=self.config.victim_idle_s,
        )
        # Operator policies: the config file's [tenants], plus those kept on disk when given.
        self.policies = policies if policies is not None else PolicyBook(self.config.tenant_policies)
        self.limiter = Limiter(
            self.tenants, self.policies, self.grants, leases, self.pages.capacity_bytes
        )
        self.activity = ActivityLog()
        self.warnings = LogThrottle(log)  # removals of tenants that never attached: a flood is one line
        self.num_never_attached = 0  # tenants dropped without ever attaching (timed out or evicted)
        self._num_dropped_unattached: dict[bytes, int] = {}  # ... by the connection that registered them
        for name in self.policies.names():
            sources = ", ".join(f"{f} from {src}" for f, src in self.policies.sources(name).items())
            log.info("operator policy of %s: %s (%s)", name,
                     self.policies.effective(name).describe(), sources)  # fmt: skip
        for warning in self.limiter.policy_warnings():
            log.warning("%s", warning)
        self._ops: dict[str, Callable[[Args, Call], Any]] = {
            "hello": self.op_hello, "register": self.op_register, "grow": self.op_grow,
            "shrink": self.op_shrink, "heartbeat": self.op_heartbeat,
            "unregister": self.op_unregister, "status": self.op_status,
            "set_limit": self.op_set_limit, "shutdown": self.op_shutdown,
            "sleep": self.op_sleep, "sleep_ready": self.op_sleep_ready, "wake": self.op_wake,
        }

    # -- dispatch --------------------------------------------------------------

    def dispatch(self, routing_id: bytes, raw: bytes) -> bytes | None:
        """Turn one raw request into one raw reply. Never raises.

        Returns ``None`` when the op answers later: its ``PendingReply`` goes
        through the sink.
        """
        try:
            message = decode(raw, REQUEST_LIMITS)  # the cost of one request is bounded
        except KVDaemonError as exc:
            self._note_refused("undecodable", exc)
            return reply_error(peek_request_id(raw), exc)
        return self.serve(message, routing_id, self.sink)

    def serve(self, message: dict[str, Any], routing_id: bytes, sink: ReplySink) -> bytes | None:
        """Serve one decoded request; a deferred reply goes to ``sink``. Never raises."""
        rid = message.get("id")
        request_id = rid if isinstance(rid, int) and not isinstance(rid, bool) else None
        try:
            if request_id is None:  # its reply could not be matched: never carried out
                raise BadRequest(f"field 'id' must be an integer, got {type(rid).__name__}")
            op = message.get("op")
            if not isinstance(op, str):
                raise BadRequest("field 'op' must be a string")
            handler = self._ops.get(op)
            if handler is None:
                raise UnknownOp(f"unknown op {op[:64]!r}")
            with self.lock:
                result = handler(Args(message.get("args")), Call(routing_id, request_id, sink))
                self.reclaimer.tell_free(self.clock())  # a shrink or a leaver may have freed pages
            return None if isinstance(result, PendingReply) else reply_ok(request_id, result)
        except KVDaemonError as exc:
            self._note_refused(message.get("op"), exc)
            return reply_error(request_id, exc)
        except Exception as exc:  # one failing request must not end the daemon
            op = message.get("op")
            self.warnings.warning(f"internal:{self._op_kind(op)}:{type(exc).__name__}",
                                  "internal error serving a %s request: %r", _op_name(op), exc, traceback=True)
            return reply_error(request_id, KVDaemonError(f"internal error: {exc!r}"))

    def _note_refused(self, op: object, exc: KVDaemonError) -> None:
        """One log line (throttled per op and code) for a request refused as malformed, not
        allowed or failing in the daemon: an operator sees a broken or probing client. The
        refusals of normal operation (no memory, over a limit, asleep, a conflict) are not logged."""
        if exc.code in LOGGED_REFUSALS:
            self.warnings.warning(f"refused:{self._op_kind(op)}:{exc.code}", "refused a %s request: %s %s",
                                  _op_name(op), exc.code, exc.message[:200])

    def _op_kind(self, op: object) -> str:
        """``op`` as a log throttle's key names it: one of the daemon's ops, or ``other`` (a
        peer's names make no new keys)."""
        return op if isinstance(op, str) and op in self._ops else "other"

    # -- authentication --------------------------------------------------------

    def _authenticated(self, args: Args) -> Tenant:
        """The tenant named ``tenant``, whose ``token`` the request must carry (tenant ops)."""
        tenant = self.tenants.named(args.str("tenant"))
        if not _same_token(args.str("token", 128), tenant.token):
            raise Forbidden(f"wrong token for tenant {tenant.name!r}")
        tenant.heard_at = self.clock()
        return tenant

    def _by_name(self, args: Args) -> Tenant:
        """The tenant named ``name`` (admin ops); with a ``token``, it must be that tenant's own."""
        tenant = self.tenants.named(args.str("name"))
        if args.has("token") and not _same_token(args.str("token", 128), tenant.token):
            raise Forbidden(f"wrong token for tenant {tenant.name!r}")
        return tenant

    # -- ops -------------------------------------------------------------------

    def op_hello(self, args: Args, _call: Call) -> dict[str, Any]:
        version = args.int("version", 0, 1 << 16)
        if version != PROTOCOL_VERSION:
            raise VersionMismatch(
                f"client speaks protocol {version}, this daemon speaks {PROTOCOL_VERSION}"
            )
        return {
            "version": PROTOCOL_VERSION, "daemon_version": __version__, "pid": os.getpid(),
            "backend": self.backend.name, "device": self.backend.device,
            "page_size": self.pages.page_size_bytes, "capacity_bytes": self.pages.capacity_bytes,
            "reclaim_wait_s": self.reclaimer.wait_s,  # the longest a grow may wait (its ``wait_s``)
        }

    def op_register(self, args: Args, call: Call) -> dict[str, Any]:
        """Register a tenant; a refusal is logged too (an operator asking why an engine did
        not start finds it in the daemon's log), one line per error code a while."""
        try:
            return self._register(args, call)
        except KVDaemonError as exc:
            name = args.raw("name")
            shown = repr(name)[:80] if isinstance(name, str) else "(no name)"
            self.warnings.warning(f"register:{exc.code}", "registration of tenant %s refused (%s): %s",
                                  shown, exc.code, exc.message)  # fmt: skip
            raise

    def _register(self, args: Args, call: Call) -> dict[str, Any]:
        name = check_name(args.str("name"))
        spec = WireSpec.parse(args.map("spec"))
        num_virtual_pages = args.int("num_virtual_pages", 1, MAX_VIRTUAL_PAGES)
        own = OwnLimits(
            max_bytes=args.opt_int("max_bytes", 0, MAX_INT),
            min_bytes=args.int("min_bytes", 0, MAX_INT, default=0),
            weight=args.float("weight", MIN_WEIGHT, MAX_WEIGHT, default=1.0),
        )
        pid = args.int("pid", 0, 1 << 31, default=0)
        sleepable = args.bool("sleepable")
        built_on = args.opt_int("page_size", 1, MAX_INT)  # a pool rejoining: its layout's pages
        if built_on is not None and built_on != self.pages.page_size_bytes:
            raise Conflict(
                f"tenant {name!r} has its KV laid out on pages of {built_on} bytes, this daemon's are "
                f"{self.pages.page_size_bytes}: it cannot move here; restart the daemon with --page-size {built_on}"
            )
        check_own(own, self.pages.capacity_bytes)
        self._check_fits(spec, own.max_bytes)
        if name in self.tenants:
            raise Conflict(f"a tenant named {name!r} is already registered")
        num_waiting = self._make_room(call.routing_id)
        bounded = self.limiter.for_registration(name, own)  # its own limits under the policy
        limits = bounded.limits
        tenant = Tenant(
            tenant_id=self.tenants.next_id(), name=name, token=secrets.token_hex(16), pid=pid,
            spec=spec, page_size_bytes=self.pages.page_size_bytes,
            num_virtual_pages=num_virtual_pages, max_bytes=limits.max_bytes,
            min_bytes=limits.min_bytes, weight=limits.weight, registered_at=self.clock(),
            sleepable=sleepable, own=own, registered_by=call.routing_id,
        )
        self.tenants.add(tenant)
        if not num_waiting:
            log_registered(tenant, bounded, self.policies.effective(name).settled().describe())
        else:  # more registrations on a connection before it attached one: a flood, one line a while
            self.warnings.warning("registered", "tenant %s registered while %d more of its connection wait "
                                  "to attach", name, num_waiting)  # fmt: skip
        return {
            "tenant_id": tenant.tenant_id, "token": tenant.token,
            "page_size": self.pages.page_size_bytes, "num_segments": spec.num_segments,
            "backend": self.backend.name, "max_bytes": limits.max_bytes, "limit": tenant.limits(),
            "clamped": [clamp.to_json() for clamp in bounded.clamped],
        }

    def _make_room(self, routing_id: bytes) -> int:
        """Room for one more tenant registered by connection ``routing_id``; returns how many
        of that connection's wait to attach their handle channel. Registrations never attached cannot keep a new
        tenant out: past ``MAX_UNATTACHED_PER_CONN`` of this connection its own oldest is
        dropped, past ``MAX_UNATTACHED`` in all the oldest of the connection that has had the
        most registrations dropped unattached before, then holds the most waiting (an honest
        client registers one tenant at a time and attaches within milliseconds: it has none
        dropped, so a flood from many connections drops its own, not the honest one's in the
        milliseconds before it attaches). ``Conflict`` at ``MAX_TENANTS``. O(tenants)."""
        waiting = self.tenants.unattached()
        by_conn = Counter(t.registered_by for t in waiting)
        if by_conn[routing_id] >= MAX_UNATTACHED_PER_CONN:
            hog = routing_id
        elif len(waiting) >= MAX_UNATTACHED:
            drops = self._num_dropped_unattached
            hog = max(by_conn, key=lambda conn: (drops.get(conn, 0), by_conn[conn]))  # ties: the oldest
        else:
            hog = None
        if hog is not None:
            oldest = next(t for t in waiting if t.registered_by == hog)
            self._drop_unattached(oldest, "evicted", f"evicted: {by_conn[hog]} tenants it registered on one "
                                                     f"connection were waiting to attach ({len(waiting)} in all)")
            by_conn[hog] -= 1
        if len(self.tenants) >= MAX_TENANTS:
            raise Conflict(f"the daemon holds its most tenants, {MAX_TENANTS}; unregister one first")
        return by_conn[routing_id]

    def _drop_unattached(self, tenant: Tenant, kind: str, why: str) -> None:
        """Forget a tenant that never attached (it holds no page); the log says so at most once
        per ``kind`` every ``LogThrottle`` interval, with the count of the others."""
        self.remove(tenant, why, clean=False, logged=False)
        self.num_never_attached += 1
        drops = self._num_dropped_unattached
        drops[tenant.registered_by] = drops.pop(tenant.registered_by, 0) + 1  # now the newest entry
        if len(drops) > MAX_CONNS_REMEMBERED:
            del drops[next(iter(drops))]  # the connection whose last drop is oldest
        self.warnings.warning(kind, "tenant %s (pid %d) removed: %s", tenant.name, tenant.pid, why)

    def _check_fits(self, spec: WireSpec, max_bytes: int | None) -> None:
        """``BadRequest`` for a spec that could never hold one logical page here."""
        logical_page_bytes = spec.num_segments * self.pages.page_size_bytes
        capacity = self.pages.capacity_bytes
        if max_bytes is not None and max_bytes < min(logical_page_bytes, capacity):
            raise BadRequest(
                f"one logical page of this spec takes {logical_page_bytes} bytes ({spec.num_segments} "
                f"segments of a {self.pages.page_size_bytes}-byte page), more than its max_bytes of "
                f"{max_bytes}: it could never map a block; raise its limit"
            )
        if logical_page_bytes > capacity:
            raise BadRequest(
                f"one logical page of this spec takes {logical_page_bytes} bytes ({spec.num_segments} "
                f"segments of a {self.pages.page_size_bytes}-byte page), more than the {capacity} bytes "
                "it could ever hold here: use fewer layers per tenant, a smaller --page-size, or more capacity"
            )

    def op_grow(self, args: Args, call: Call) -> dict[str, Any] | PendingReply:
        tenant = self._authenticated(args)
        candidates = args.int_list("logical_pages", 0, tenant.num_virtual_pages - 1, MAX_GROW_PAGES)
        if not candidates:
            raise BadRequest("field 'logical_pages' is empty")
        min_pages = args.int("min_pages", 1, len(candidates), default=len(candidates))
        # no more are ever granted (``Grants.num_grantable``): a parked grow's retries stay O(that)
        candidates = candidates[:max_grant_pages(tenant.spec.num_segments)]
        wait_s = args.float("wait_s", 0.0, self.reclaimer.wait_s, default=self.reclaimer.wait_s)
        ahead = args.bool("ahead")  # speculative: no reclaim, no waiting, not short for it
        now = self.clock()
        if ahead and self.reclaimer.parked:
            raise NoMemory("pages coming back are awaited by a parked grow: none to spare ahead of need")
        try:
            return self.grants.grow(tenant, candidates, min_pages, now, ahead)
        except OverLimit as exc:
            if not ahead:
                tenant.note_refused(exc.code, min_pages, self.pages.free_bytes, now)
            raise
        except NoMemory as exc:
            if ahead:
                raise
            waiter = call.defer()
            if self.reclaimer.park(tenant, candidates, min_pages, waiter, wait_s, now):
                return waiter  # answered by ``tick`` once pages come back, or NO_MEMORY
            tenant.note_refused(exc.code, min_pages, self.pages.free_bytes, now)
            raise

    def op_shrink(self, args: Args, _call: Call) -> dict[str, Any]:
        tenant = self._authenticated(args)
        wanted = args.int_list("logical_pages", 0, tenant.num_virtual_pages - 1, MAX_GROW_PAGES)
        return self.grants.shrink(tenant, wanted, self.clock())

    def op_heartbeat(self, args: Args, _call: Call) -> dict[str, Any]:
        tenant = self._authenticated(args)
        used = args.opt_int("used_bytes", 0, MAX_INT)
        if used is not None and used != tenant.used_bytes:
            tenant.used_bytes = used
            tenant.note_engine_active(self.clock())
        if args.bool("active"):  # its engine stepped: busy, whatever its blocks did
            tenant.note_engine_active(self.clock())
        if args.has("sleepable"):
            tenant.sleepable = args.bool("sleepable")
        num_refused = args.int("refused_grows", 0, MAX_INT, default=0)
        page_bytes, now = self.pages.page_size_bytes, self.clock()
        if num_refused:  # its pool refused these itself, knowing its limit: no round trip came
            tenant.note_refused_by_pool(num_refused, now)
        return {"state": tenant.state.value, "max_bytes": tenant.max_bytes, "free_bytes": self.pages.free_bytes,
                "fair_bytes": self.shares.fair_pages(tenant) * page_bytes,
                "ahead_bytes": self.shares.free_for_ahead(tenant, self.pages.num_free, now) * page_bytes,
                "now": now}  # the clock of a reclaim notice's ``expires_at``

    def op_unregister(self, args: Args, _call: Call) -> dict[str, Any]:
        tenant = self._authenticated(args)
        num_pages = self.remove(tenant, "unregistered")
        self.leases.drop_lease(tenant.tenant_id)
        return {"num_released": num_pages}

    def op_status(self, _args: Args, _call: Call) -> dict[str, Any]:
        return self.status()

    def op_set_limit(self, args: Args, _call: Call) -> dict[str, Any]:
        """The operator's policy of a name (registered or not), or with a token the
        tenant's own request (``kvdaemon.daemon.limits``)."""
        return self.limiter.set_limit(args, self._by_name(args) if args.has("token") else None)

    def op_sleep(self, args: Args, call: Call) -> dict[str, Any] | PendingReply:
        tenant = self._by_name(args)
        mode = args.str("mode", 8) if args.has("mode") else "warm"
        if mode not in SLEEP_MODES:
            raise BadRequest(f"sleep mode must be 'warm' or 'cold', got {mode!r}")
        by_owner = args.has("token")
        why = "asked by the tenant itself" if by_owner else "asked by an admin"
        waiter = call.defer()
        done = self.sleeper.begin(tenant, mode, waiter, self.clock(), by_owner=by_owner, why=why)
        return waiter if done is None else done

    def op_sleep_ready(self, args: Args, call: Call) -> dict[str, Any] | PendingReply:
        tenant = self._authenticated(args)
        answer = call.defer()  # answered when a sliced warm copy ends
        why = args.str("why", MAX_WHY_CHARS) if args.has("why") else None
        done = self.sleeper.finish(tenant, args.int("sleep_id", 1), args.bool("refused"), self.clock(), answer, why)
        return answer if done is None else done

    def op_wake(self, args: Args, call: Call) -> dict[str, Any] | PendingReply:
        """Wake a tenant; a warm one whose pages are not free waits for other tenants to give
        pages back, as a grow does (``reclaim``), up to the reclaim's wait: else ``NO_MEMORY``."""
        by_owner = args.has("token")
        why = "woken by the tenant itself (auto-wake or its own call)" if by_owner else "woken by an admin"
        tenant, now = self._by_name(args), self.clock()
        waiter = call.defer()  # answered when a sliced copy back ends, or when pages come back
        try:
            done = self.waker.wake(tenant, now, why, waiter)
        except NoMemory:
            need = self.waker.wake_pages(tenant)
            if self.reclaimer.park(tenant, [], need, waiter, self.reclaimer.wait_s, now,
                                   attempt=lambda woken, at: self.waker.wake(woken, at, why, waiter)):  # fmt: skip
                return waiter
            raise
        return waiter if done is None else done

    def step_copies(self) -> None:
        """Advance the warm copies under way (``kvdaemon.daemon.copies``); pages a sleep freed
        serve parked grows at once."""
        if self.sleeper.copies.step() and self.reclaimer.parked:
            self.reclaimer.retry(self.clock())

    def op_shutdown(self, _args: Args, _call: Call) -> dict[str, Any]:
        """Exit after this reply; it names the warm sleepers whose KV (host memory) dies
        with this daemon: they wake empty under the next one."""
        self.shutdown_requested = True
        warm = [t for t in self.tenants if t.state is TenantState.SLEEPING_WARM]
        return {"dropped_warm": [{"name": t.name, "host_bytes": t.warm.host_bytes if t.warm else 0}
                                 for t in warm]}

    # -- lease events (from the server) ----------------------------------------

    def attach(self, name: str, token: str, pid: int) -> Tenant:
        """Bind a handle connection from ``pid`` to a tenant as its lease."""
        tenant = self.tenants.named(name)
        if not _same_token(token, tenant.token):
            raise Forbidden(f"wrong token for tenant {name!r}")
        if tenant.leased:
            raise Conflict(f"tenant {name!r} already has a handle channel")
        tenant.leased = True
        self.tenants.changed()
        tenant.pid = pid
        return tenant

    def attach_grants(self, name: str, token: str, pid: int) -> int:
        """Check a grant channel of ``pid`` for a tenant: its token, its lease attached by ``pid``."""
        tenant = self.tenants.named(name)
        if not _same_token(token, tenant.token):
            raise Forbidden(f"wrong token for tenant {name!r}")
        if not tenant.leased or tenant.pid != pid:
            raise Forbidden(f"a grant channel of {name!r} must come from the process holding its lease")
        return tenant.tenant_id

    def remove(self, tenant: Tenant, why: str, clean: bool = True, logged: bool = True) -> int:
        """Forget ``tenant`` and free every page it holds; return the pages freed.

        Frees them only when the tenant no longer maps them: it unregistered
        (``clean``), or its lease ended and its process maps nothing; else they
        stay quarantined until it does (``Quarantine``). ``why`` says which, for the log.
        """
        self.activity.flush(tenant, self.clock())
        host_bytes = 0 if tenant.warm is None else tenant.warm.host_bytes
        num_pages = self.forget_sleep(tenant)  # a copy under way stops first (a wake's pages, never sent, go)
        held = not clean and self.quarantine.hold(tenant, why)
        num_pages += 0 if held else self.grants.release_all(tenant)
        self.tenants.remove(tenant)
        self.reclaimer.requester_left(tenant)
        if logged:
            log_removed(tenant, num_pages, why, clean, host_bytes)
        return num_pages

    def forget_sleep(self, tenant: Tenant, stopping: bool = False) -> int:
        """Drop a removed tenant's sleep or wake under way and its warm copy; their callers
        are told the tenant went away (``stopping``: the daemon is stopping). Returns the
        physical pages a wake under way held, now freed."""
        woke = DaemonUnreachable("the daemon stopped before the tenant woke") if stopping else None
        slept = DaemonUnreachable("the daemon stopped before the tenant slept") if stopping else None
        num_freed = self.waker.forget(tenant, woke)
        self.sleeper.forget(tenant, slept)
        return num_freed

    def tick(self, now: float) -> None:
        """Time-driven work: drop tenants that never attached, cancel stale sleeps,
        serve parked grows, the idle policy."""
        for tenant in self.tenants:
            if not tenant.leased and now - tenant.registered_at > self.config.attach_timeout_s:
                self._drop_unattached(tenant, "unattached", f"it never attached its handle channel within "
                                                            f"{self.config.attach_timeout_s:g} s")
        self.warnings.flush()
        self.sleeper.expire(now)
        self.quarantine.sweep()
        self.pages.trim(now)
        self.sleeper.buffers.trim(now)
        self.reclaimer.retry(now)
        self.reclaimer.tell_free(now)
        self.reclaimer.ask_ahead(now)
        self.reclaimer.settle_debts(now)
        if self.config.idle_sleep_s is not None:
            self.sleeper.sleep_idle(now, self.config.idle_sleep_s, self.config.idle_mode)
        self.activity.tick(self.tenants, now)

    def status(self) -> dict[str, Any]:
        """The object of ``status --json`` (DESIGN.md §13; ``status_report``)."""
        return status_report.build(self)

    def check_invariants(self) -> None:
        """Assert DESIGN.md §4 invariants 1-3 over the device pages and every tenant (the
        quarantined ones too: their pages are owned until their processes are gone)."""
        self.pages.check()
        mapped = 0
        for tenant in [*self.tenants, *(held.tenant for held in self.quarantine.held)]:
            for lp, pages in tenant.logical.items():
                assert len(pages) == tenant.spec.num_segments
                for seg, page in enumerate(pages):
                    assert self.pages.owner(page.page_id) == Owner(tenant.tenant_id, seg, lp)
            mapped += tenant.mapped_bytes
        retired = self.pages.num_retired * self.pages.page_size_bytes
        assert mapped + self.pages.free_bytes + retired == self.pages.capacity_bytes, "bytes lost"


def _same_token(given: str, expected: str) -> bool:
    """Constant-time comparison that accepts any string (compare_digest refuses non-ASCII str)."""
    return secrets.compare_digest(given.encode(), expected.encode())
