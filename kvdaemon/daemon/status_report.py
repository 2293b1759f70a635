"""The ``status`` object: the pool, its counters and settings, a row per tenant, the policies
and what they cannot give (``warnings``).

Built on the service loop under its lock (``Service.status``), from what the
service holds; nothing here changes state. The device's own free memory is
asked of the backend each time (one ``cuMemGetInfo``; host: one
``/proc/meminfo`` read), so an operator sees memory the pool counts free but
another process holds.

Cost: O(tenants + policies): the active tenants' fair shares come from one
filling (cached until a tenant changes), a sleeper's from its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol

from kvdaemon import __version__
from kvdaemon.cuda_vmm.backend import Backend
from kvdaemon.daemon.config import DaemonConfig
from kvdaemon.daemon.device_pages import DevicePages
from kvdaemon.daemon.limits import Limiter
from kvdaemon.daemon.log_throttle import LogThrottle
from kvdaemon.daemon.policy_book import PolicyBook
from kvdaemon.daemon.quarantine import Quarantine
from kvdaemon.daemon.reclaim import Reclaimer
from kvdaemon.daemon.shares import Shares
from kvdaemon.daemon.sleep import Sleeper
from kvdaemon.daemon.tenant import Tenant, Tenants
from kvdaemon.errors import BackendError


class StatusSource(Protocol):
    """What a status is built from: the parts of ``service.Service`` read here."""

    clock: Callable[[], float]
    backend: Backend
    config: DaemonConfig
    pages: DevicePages
    shares: Shares
    tenants: Tenants
    reclaimer: Reclaimer
    sleeper: Sleeper
    quarantine: Quarantine
    policies: PolicyBook
    limiter: Limiter
    warnings: LogThrottle
    started_at: float
    num_never_attached: int


def build(service: StatusSource) -> dict[str, Any]:
    """The object of ``status --json`` (DESIGN.md §13), plus daemon and detail fields."""
    now, pages = service.clock(), service.pages
    fair = service.shares.fair_pages_all()
    tenants = [_tenant_row(service, t, now, fair) for t in service.tenants]
    counters = {**service.reclaimer.stats(), **service.sleeper.stats(), **service.waker.stats(),
                "never_attached": service.num_never_attached}
    return {
        "backend": service.backend.name,
        "device": service.backend.device,
        "pid": os.getpid(),
        "version": __version__,
        "uptime_seconds": round(now - service.started_at, 3),
        "page_size": pages.page_size_bytes,
        "capacity_bytes": pages.capacity_bytes,
        "free_bytes": pages.free_bytes,
        "device_free_bytes": _device_free_bytes(service),
        "quarantined_bytes": service.quarantine.held_bytes,
        "retired_bytes": pages.num_retired * pages.page_size_bytes,
        "host_bytes": sum(int(t["host_bytes"]) for t in tenants),
        "counters": counters,
        "settings": settings(service),
        "tenants": tenants,
        "policies": service.policies.rows(t["name"] for t in tenants),
        "warnings": service.limiter.policy_warnings(),
    }


def settings(service: StatusSource) -> dict[str, Any]:
    """The sleep policies the daemon runs with."""
    cfg = service.config
    return {"idle_sleep_s": cfg.idle_sleep_s, "idle_mode": cfg.idle_mode, "reclaim_sleep": cfg.reclaim_sleep,
            "warm_memory_bytes": service.sleeper.max_host_bytes}  # fmt: skip


def _device_free_bytes(service: StatusSource) -> int | None:
    """What the device itself has free (host: RAM available), whoever holds it; ``None``
    when the backend cannot say (logged, a line a while)."""
    try:
        return service.backend.mem_info().free_bytes
    except BackendError as exc:
        service.warnings.warning("mem_info", "the backend could not say what the device has free: %s", exc)
        return None


def _tenant_row(service: StatusSource, tenant: Tenant, now: float, fair: dict[int, int]) -> dict[str, object]:
    """A tenant's row, with its fair share (``fair``: the active tenants', by id; a sleeper's
    as if it were active) and whether it is short (``shares``)."""
    row = tenant.status(now)
    pages = fair.get(tenant.tenant_id)
    if pages is None:
        pages = service.shares.fair_pages(tenant)
    row["fair_bytes"] = pages * service.pages.page_size_bytes
    row["short"] = service.shares.is_short(tenant, now)
    return row
