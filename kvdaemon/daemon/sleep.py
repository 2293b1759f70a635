"""Sleep and wake of tenants: warm (bytes kept in host memory) or cold (dropped).

A sleep is a three-step exchange, so that nothing is freed under a busy engine:

1. ``begin``: the daemon sends the tenant a ``sleep`` notice and parks the
   caller's reply (the CLI or another client) until step 2 or a timeout;
2. the tenant finishes its step, unmaps its pages (keeping its virtual ranges
   and handles) and calls ``sleep_ready``: ``finish`` copies the pages to host
   memory (warm), frees them, and answers both the tenant and the caller;
3. if the tenant does not answer within ``SLEEP_TIMEOUT_S``, ``expire`` answers
   the caller with ``CONFLICT`` and tells the tenant ``sleep_cancelled``; a
   late ``sleep_ready`` is refused, so the tenant maps its pages back.

``wake`` grants fresh pages at the same logical pages, copies the saved bytes
in (warm), and sends the tenant a ``wake`` notice naming the grant; a cold
tenant wakes with no pages. Its virtual addresses never changed, so block
tables stay valid (warm).

Cost: one host copy of every page each way (warm); O(pages) otherwise.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvdaemon.daemon import swap
from kvdaemon.errors import Asleep, BadRequest, Conflict, KVDaemonError
from kvdaemon.wire.protocol import reply_error, reply_ok

if TYPE_CHECKING:
    from kvdaemon.daemon.service import Service
    from kvdaemon.daemon.tenant import Tenant

log = logging.getLogger("kvdaemon.daemon.sleep")
SLEEP_TIMEOUT_S = 10.0
MAX_CACHED_BUFFER_BYTES = 2 << 30  # host memory kept for the next warm sleep, at most
DEFERRED = object()  # an op's result meaning "the reply comes later"


@dataclass
class PendingSleep:
    """A sleep asked of a tenant that has not quiesced yet."""

    sleep_id: int
    mode: str
    waiter: tuple[bytes, int | None] | None  # routing id and request id of the caller
    deadline: float


class Sleeper:
    """Sleep and wake over one service's pool and leases (see the module docstring)."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.timeout_s = SLEEP_TIMEOUT_S
        self._ids = itertools.count(1)
        self.num_sleeps = 0
        self.num_wakes = 0
        self.buffers = swap.BufferCache(
            min(service.pool.capacity_bytes, MAX_CACHED_BUFFER_BYTES), service.backend
        )

    def begin(self, tenant: Tenant, mode: str, waiter: tuple[bytes, int | None] | None) -> None:
        """Ask ``tenant`` to quiesce; the caller's reply waits for ``finish`` or ``expire``.

        ``waiter`` is ``None`` for the daemon's own sleeps (the idle policy).
        """
        if tenant.state != "active":
            raise Asleep(f"tenant {tenant.name!r} is already {tenant.state}")
        if tenant.pending_sleep is not None:
            raise Conflict(f"tenant {tenant.name!r} is already being put to sleep")
        if not tenant.leased:
            raise Conflict(f"tenant {tenant.name!r} has no handle channel to be told on")
        sleep_id = next(self._ids)
        tenant.pending_sleep = PendingSleep(sleep_id, mode, waiter, time.monotonic() + self.timeout_s)
        self.service.leases.send_notice(
            tenant.tenant_id, {"notice": "sleep", "args": {"mode": mode, "sleep_id": sleep_id}}
        )

    def finish(self, tenant: Tenant, sleep_id: int) -> dict[str, Any]:
        """The tenant has quiesced and unmapped: save (warm), free its pages, answer the caller."""
        pending = tenant.pending_sleep
        if pending is None or pending.sleep_id != sleep_id:
            raise Conflict(f"sleep {sleep_id} of {tenant.name!r} was cancelled or never asked")
        if pending.mode == "warm":
            tenant.warm = swap.save(
                self.service.backend, tenant.logical, tenant.spec.num_segments, self.buffers
            )
        num_pages = self.service.grants.release_all(tenant)
        tenant.pending_sleep = None
        tenant.state = f"sleeping-{pending.mode}"
        self.num_sleeps += 1
        result = {"state": tenant.state, "num_released": num_pages,
                  "host_bytes": 0 if tenant.warm is None else tenant.warm.host_bytes}
        self._answer(pending.waiter, reply_ok(_request_id(pending.waiter), result))
        log.info("tenant %s is %s (%d pages freed)", tenant.name, tenant.state, num_pages)
        return result

    def wake(self, tenant: Tenant) -> dict[str, Any]:
        """Give a sleeping tenant pages again (bytes restored when warm) and tell it."""
        if tenant.state == "active":
            raise BadRequest(f"tenant {tenant.name!r} is not sleeping")
        mode = tenant.state.removeprefix("sleeping-")
        grant: dict[str, Any] = {"grant_id": 0, "pages": []}
        if tenant.warm is not None:
            grant = self.service.grants.grant(tenant, tenant.warm.logical_pages)
            swap.restore(self.service.backend, tenant.warm, tenant.logical)
            tenant.warm.discard()
            tenant.warm = None
        tenant.state = "active"
        tenant.touch()
        self.num_wakes += 1
        self.service.leases.send_notice(
            tenant.tenant_id, {"notice": "wake", "args": {"mode": mode, **grant}}
        )
        return {"state": "active", "mapped_bytes": tenant.mapped_bytes}

    def expire(self, now: float) -> None:
        """Cancel sleeps whose tenant did not quiesce in time; nothing was freed."""
        for tenant in self.service.tenants.values():
            pending = tenant.pending_sleep
            if pending is None or now < pending.deadline:
                continue
            tenant.pending_sleep = None
            error = Conflict(f"tenant {tenant.name!r} did not quiesce within {self.timeout_s:g} s")
            self._answer(pending.waiter, reply_error(_request_id(pending.waiter), error))
            self.service.leases.send_notice(
                tenant.tenant_id, {"notice": "sleep_cancelled", "args": {"sleep_id": pending.sleep_id}}
            )

    def sleep_idle(self, now: float, idle_s: float, mode: str) -> None:
        """The idle policy: sleep active tenants whose blocks have not changed for ``idle_s``."""
        for tenant in self.service.tenants.values():
            idle = now - tenant.last_active
            if (tenant.state == "active" and tenant.leased and tenant.pending_sleep is None
                    and idle >= idle_s):  # fmt: skip
                log.info("tenant %s idle for %.0f s: sleeping it (%s)", tenant.name, idle, mode)
                self.begin(tenant, mode, None)

    def stats(self) -> dict[str, int]:
        return {"sleeps": self.num_sleeps, "wakes": self.num_wakes}

    def forget(self, tenant: Tenant) -> None:
        """Drop what a removed tenant kept: its warm copy and any parked caller."""
        if tenant.warm is not None:
            tenant.warm.discard()
            tenant.warm = None
        if tenant.pending_sleep is not None:
            waiter = tenant.pending_sleep.waiter
            tenant.pending_sleep = None
            gone = KVDaemonError(f"tenant {tenant.name!r} went away while going to sleep")
            self._answer(waiter, reply_error(_request_id(waiter), gone))

    def _answer(self, waiter: tuple[bytes, int | None] | None, payload: bytes) -> None:
        if waiter is not None:
            self.service.replies.append((waiter[0], payload))


def _request_id(waiter: tuple[bytes, int | None] | None) -> int | None:
    return None if waiter is None else waiter[1]
