"""What the log says about tenants: one line per state change, and rate-limited summaries.

State changes (registered, limits changed, slept, woke, left) are rare, caused
by a person, a policy or a process ending, and get one line each where they
happen, with sizes in binary units. What can happen many times a second is
only counted on the tenant (``note_grown``, ``note_shrunk``, ``note_refused``)
and summarised here by ``ActivityLog.tick``: per tenant, at most one INFO line
per ``interval_s`` for its grows and shrinks (``grew 12 logical page(s) (+24.0 MiB),
shrank 3 logical page(s) (-6.00 MiB) in the last 10 s; now 1.20 GiB mapped``) and one
WARNING line for its refused grows, with the last reason. The first news after
a quiet interval goes out at the next tick; what a tenant did since its last
summary is flushed when it leaves. One tick writes at most ``MAX_LINES_PER_TICK``
lines, taking the tenants in turn from where the last capped tick stopped: a
thousand tenants refused at once do not hold the daemon's lock for a thousand
lines; the rest go out at the next ticks, their counts whole.

Cost: O(tenants) per tick and at most ``MAX_LINES_PER_TICK`` lines; nothing on the
grow path but counter increments.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from kvdaemon.daemon.policies import Bounded
from kvdaemon.daemon.tenant import Tenant
from kvdaemon.wire.sizes import format_bytes

log = logging.getLogger("kvdaemon.tenants")
INTERVAL_S = 10.0
MAX_LINES_PER_TICK = 16


@dataclass
class _Logged:
    """A tenant's counters as of its last summaries, and when those went out."""

    num_grown: int = 0
    num_shrunk: int = 0
    num_refused: int = 0
    growth_at: float | None = None
    refusals_at: float | None = None


class ActivityLog:
    """Summaries of grows, shrinks and refused grows per tenant (see the module docstring)."""

    def __init__(self, interval_s: float = INTERVAL_S, max_lines_per_tick: int = MAX_LINES_PER_TICK) -> None:
        self.interval_s = interval_s
        self.max_lines_per_tick = max_lines_per_tick
        self._logged: dict[int, _Logged] = {}
        self._cursor = 0  # where the next tick starts in the tenants' order, after a capped one

    def tick(self, tenants: Iterable[Tenant], now: float) -> None:
        """Log the summaries that are due, at most ``max_lines_per_tick`` lines."""
        order = list(tenants)
        start, num_lines = (self._cursor % len(order) if order else 0), 0
        for i in range(len(order)):
            num_lines += self._summarise(order[(start + i) % len(order)], now, force=False)
            if num_lines >= self.max_lines_per_tick:
                self._cursor = start + i + 1
                return

    def flush(self, tenant: Tenant, now: float) -> None:
        """Log what ``tenant`` did since its last summaries, and forget it (it is leaving)."""
        self._summarise(tenant, now, force=True)
        self._logged.pop(tenant.tenant_id, None)

    def _summarise(self, tenant: Tenant, now: float, force: bool) -> int:
        """Log ``tenant``'s due summaries (all it has, with ``force``); return how many lines."""
        num_lines = 0
        logged = self._logged.setdefault(tenant.tenant_id, _Logged())
        num_grown = tenant.num_grown_pages - logged.num_grown
        num_shrunk = tenant.num_shrunk_pages - logged.num_shrunk
        if (num_grown or num_shrunk) and (force or self._due(logged.growth_at, now)):
            page = tenant.logical_page_bytes
            moves = [f"{verb} {count} logical page(s) ({sign}{format_bytes(count * page)})"
                     for verb, sign, count in (("grew", "+", num_grown), ("shrank", "-", num_shrunk))
                     if count]  # fmt: skip
            period = _period(tenant, logged.growth_at, now)
            log.info("tenant %s: %s %s; now %s mapped", tenant.name, ", ".join(moves), period,
                     format_bytes(tenant.mapped_bytes))  # fmt: skip
            logged.num_grown, logged.num_shrunk = tenant.num_grown_pages, tenant.num_shrunk_pages
            logged.growth_at = now
            num_lines += 1
        num_refused = tenant.num_refused_grows - logged.num_refused
        if num_refused and (force or self._due(logged.refusals_at, now)):
            if num_refused == 1:
                log.warning("tenant %s: %s", tenant.name, tenant.last_refusal)
            else:
                log.warning("tenant %s: %d grows refused %s; the last: %s", tenant.name,
                            num_refused, _period(tenant, logged.refusals_at, now),
                            tenant.last_refusal)  # fmt: skip
            logged.num_refused, logged.refusals_at = tenant.num_refused_grows, now
            num_lines += 1
        return num_lines

    def _due(self, last: float | None, now: float) -> bool:
        return last is None or now - last >= self.interval_s


def _period(tenant: Tenant, last: float | None, now: float) -> str:
    if last is None:
        return f"since it registered {now - tenant.registered_at:.0f} s ago"
    return f"in the last {now - last:.0f} s"


def log_registered(tenant: Tenant, bounded: Bounded, policy: str) -> None:
    """``tenant a registered (id 1, pid 42): <spec>; max 8.00 GiB, ...; policy ...``."""
    limits = bounded.limits
    clamped = "".join(f"; {clamp.describe()}" for clamp in bounded.clamped)
    log.info(
        "tenant %s registered (id %d, pid %d): %s, %s per logical page; max %s, min %s, "
        "weight %g; operator policy: %s%s",
        tenant.name, tenant.tenant_id, tenant.pid, tenant.spec.describe(),
        format_bytes(tenant.logical_page_bytes), format_bytes(limits.max_bytes),
        format_bytes(limits.min_bytes), limits.weight, policy, clamped,
    )  # fmt: skip
    if limits.max_bytes < tenant.logical_page_bytes:
        log.warning("tenant %s: its limit of %s is under its logical page of %s: it can map nothing "
                    "until the limit is raised (kvdaemon limit %s --max SIZE)", tenant.name,
                    format_bytes(limits.max_bytes), format_bytes(tenant.logical_page_bytes), tenant.name)


def log_removed(tenant: Tenant, num_pages: int, why: str, clean: bool, host_bytes: int = 0) -> None:
    """The tenant left: ``why`` (an unregister, or how its lease ended) and what came back
    (``host_bytes``: the warm copy of its KV dropped with it)."""
    freed = format_bytes(num_pages * tenant.page_size_bytes)
    warm = f"; its warm KV ({format_bytes(host_bytes)} of host memory) dropped" if host_bytes else ""
    if clean:
        log.info("tenant %s %s: %d physical page(s) (%s) back to the pool%s", tenant.name, why, num_pages,
                 freed, warm)  # fmt: skip
    else:
        log.warning("tenant %s (pid %d) removed: %s; %d physical page(s) (%s) back to the pool%s",
                    tenant.name, tenant.pid, why, num_pages, freed, warm)  # fmt: skip
