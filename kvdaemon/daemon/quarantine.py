"""Quarantine: the pages of a tenant whose lease ended while its process may still map them.

A lease ends when its connection closes. When the process died, its address
space went before its sockets (the kernel tears the mappings down first), and
its pages are freed at once. But a live process can lose its lease too: it
closed the connection without unregistering, the daemon closed it on a
protocol error, or revoked it. Its mappings may still reach the pages, and
freeing them would let it read and write whatever is granted there next,
another tenant's KV. So such a tenant leaves the tenant table (its name is
free again) but its pages stay owned, counted as *quarantined*, until its
process no longer maps anything: ``sweep`` (each tick) frees them then. A pid
taken by a new process counts as gone (its start time differs).

What a process maps is judged from ``/proc``: gone, a zombie, or an empty
``maps`` (its address space torn down) free the pages; anything the daemon
cannot read keeps them. A child forked after mapping may inherit the mappings
unseen: that case is not covered.

Invariants: a quarantined page is owned by exactly one removed tenant;
mapped + quarantined + free == capacity. Cost: a few ``/proc`` reads per lease
that ends, and per held tenant per sweep.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from kvdaemon.daemon.grants import Grants
from kvdaemon.daemon.tenant import Tenant
from kvdaemon.wire.sizes import format_bytes

log = logging.getLogger("kvdaemon.quarantine")


def process_start(pid: int) -> float | None:
    """When ``pid`` started, while it still maps memory; ``None`` when it is gone, a zombie
    or has no address space left (``/proc/PID/maps`` empty). Unreadable: kept alive (0.0)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        started = proc.create_time()
        with open(f"/proc/{pid}/maps", "rb") as maps:
            return started if maps.read(1) else None
    except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
        return None
    except (psutil.AccessDenied, PermissionError):
        return 0.0


@dataclass
class Held:
    """A removed tenant whose process may still map its pages."""

    tenant: Tenant
    started: float  # its process's start time when the lease ended (0.0: unknown)
    why: str


class Quarantine:
    """Removed tenants' pages, held until their processes are gone (see the module docstring)."""

    def __init__(self, grants: Grants, started: Callable[[int], float | None] = process_start) -> None:
        self.grants = grants
        self.started = started
        self.held: list[Held] = []

    @property
    def num_pages(self) -> int:
        return sum(len(h.tenant.logical) * h.tenant.spec.num_segments for h in self.held)

    @property
    def held_bytes(self) -> int:
        return sum(h.tenant.mapped_bytes for h in self.held)

    def hold(self, tenant: Tenant, why: str) -> bool:
        """Keep the pages of a tenant whose lease ended, if its process may still map them.

        False (nothing held) when it holds no pages or its process maps nothing.
        """
        started = self.started(tenant.pid) if tenant.logical else None
        if started is None:
            return False
        self.held.append(Held(tenant, started, why))
        log.warning("tenant %s: its lease ended (%s) while pid %d still maps memory: its %s stay "
                    "quarantined until that process exits", tenant.name, why, tenant.pid,
                    format_bytes(tenant.mapped_bytes))  # fmt: skip
        return True

    def sweep(self) -> int:
        """Free the pages of held tenants whose processes are gone; return how many pages."""
        freed, kept = 0, []
        for held in self.held:
            started = self.started(held.tenant.pid)
            if started is not None and (started == held.started or not held.started):
                kept.append(held)
                continue
            num_bytes = held.tenant.mapped_bytes
            freed += self.grants.release_all(held.tenant)
            log.info("tenant %s: pid %d maps no more memory: its %s left quarantine and are free",
                     held.tenant.name, held.tenant.pid, format_bytes(num_bytes))  # fmt: skip
        self.held = kept
        return freed
