"""Reclaim: serving a grow the free pages cannot cover, with other tenants' pages.

When a grow finds too few free pages, and other tenants hold enough above
their ``min_bytes``, the grow is parked (its reply waits) and the daemon:

1. at once asks victims, in order of bytes above ``min_bytes`` per unit of
   weight (largest first), for just the pages it lacks (``reclaim`` notice; a
   pool answers from its agent thread with spare pages, then cache-only pages,
   even while its engine is idle);
2. after ``sleep_after_s``, asks every victim for what is still missing;
3. after twice that, if ``sleep_victims`` is on, warm-sleeps the longest-idle
   victim that has no ``min_bytes`` guarantee;
4. retries parked grows, oldest first, after every request and every tick; a
   grow still short at its ``wait_s`` (the client's, at most ``WAIT_S``) is
   answered ``NO_MEMORY``.

A grow with ``wait_s == 0`` is never parked: the victims are asked (step 1) so
that pages come back for a later grow, and the grow fails at once with
``NO_MEMORY``. Engines that would rather queue or preempt than stall a step
ask for that.

A grow that no reclaim could serve (the others hold nothing above their
guarantees) fails at once with ``NO_MEMORY``. Nothing here takes a page from a
tenant: tenants give pages back themselves, or sleep.

Cost: O(tenants) per parked grow per retry.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvdaemon.errors import KVDaemonError, NoMemory, UnknownTenant
from kvdaemon.wire.protocol import reply_error, reply_ok

if TYPE_CHECKING:
    from kvdaemon.daemon.service import Service
    from kvdaemon.daemon.tenant import Tenant

log = logging.getLogger("kvdaemon.daemon.reclaim")
WAIT_S = 2.0
SLEEP_AFTER_S = 0.25


@dataclass
class ParkedGrow:
    """A grow waiting for pages to come back."""

    tenant_id: int
    wanted: list[int]
    waiter: tuple[bytes, int | None]
    parked_at: float
    wait_s: float = WAIT_S
    stage: int = 0  # 0: the first victims asked; 1: all asked; 2: a victim slept


class Reclaimer:
    """Parked grows and the reclaim steps that serve them (see the module docstring)."""

    def __init__(self, service: Service, sleep_victims: bool = True) -> None:
        self.service = service
        self.sleep_victims = sleep_victims
        self.wait_s = WAIT_S
        self.sleep_after_s = SLEEP_AFTER_S
        self.parked: list[ParkedGrow] = []
        self.num_reclaim_requests = 0
        self.num_victims_slept = 0

    def park(
        self, tenant: Tenant, wanted: list[int], waiter: tuple[bytes, int | None], wait_s: float = WAIT_S
    ) -> bool:
        """Park a grow short of pages if reclaim can serve it within ``wait_s``; False when it cannot.

        With ``wait_s == 0`` the victims are still asked, but nothing is parked.
        """
        short = len(wanted) * tenant.spec.num_segments - self.service.pool.num_free
        victims = self._victims(tenant)
        if sum(pages for _, pages in victims) < short:
            return False
        self._ask(victims, short, stop_when_covered=True)
        if wait_s <= 0:
            return False
        self.parked.append(ParkedGrow(tenant.tenant_id, wanted, waiter, time.monotonic(), wait_s))
        return True

    def _ask(self, victims: list[tuple[Tenant, int]], short: int, stop_when_covered: bool) -> None:
        """Send reclaim notices for ``short`` pages, best victim first."""
        remaining = short
        for victim, pages_above_min in victims:
            if remaining <= 0 and stop_when_covered:
                return
            ask = min(pages_above_min, max(remaining, 1))
            num_logical = -(-ask // victim.spec.num_segments)
            self.service.leases.send_notice(
                victim.tenant_id,
                {"notice": "reclaim", "args": {"tenant": victim.name, "num_pages": num_logical}},
            )
            self.num_reclaim_requests += 1
            remaining -= num_logical * victim.spec.num_segments

    def _victims(self, requester: Tenant) -> list[tuple[Tenant, int]]:
        """Other active tenants with pages above ``min_bytes``: (tenant, pages above), best first."""
        page_bytes = self.service.pool.page_size_bytes
        found = []
        for tenant in self.service.tenants.values():
            if tenant is requester or tenant.state != "active" or not tenant.leased:
                continue
            above = max(0, tenant.mapped_bytes - tenant.min_bytes) // page_bytes
            if above:
                found.append((tenant, above))
        found.sort(key=lambda item: item[1] / item[0].weight, reverse=True)
        return found

    def retry(self, now: float) -> None:
        """Serve parked grows that now fit; sleep a victim or give up where it is time."""
        still: list[ParkedGrow] = []
        for parked in self.parked:
            if not self._serve(parked, now):
                still.append(parked)
        self.parked = still

    def _serve(self, parked: ParkedGrow, now: float) -> bool:
        """True when the grow was answered (granted or failed) and leaves the queue."""
        tenant = self.service.by_id.get(parked.tenant_id)
        try:
            if tenant is None:
                raise UnknownTenant("the tenant went away while its grow waited")
            result = self.service.grants.grow(tenant, parked.wanted)
        except NoMemory as exc:
            if now - parked.parked_at >= parked.wait_s:
                self._answer(parked, reply_error(parked.waiter[1], exc))
                return True
            self._escalate(parked, tenant, now)
            return False
        except KVDaemonError as exc:
            self._answer(parked, reply_error(parked.waiter[1], exc))
            return True
        self._answer(parked, reply_ok(parked.waiter[1], result))
        return True

    def _escalate(self, parked: ParkedGrow, tenant: Tenant | None, now: float) -> None:
        waited = now - parked.parked_at
        if tenant is None:
            return
        if parked.stage == 0 and waited >= self.sleep_after_s:
            short = len(parked.wanted) * tenant.spec.num_segments - self.service.pool.num_free
            self._ask(self._victims(tenant), short, stop_when_covered=False)
            parked.stage = 1
        elif parked.stage == 1 and waited >= 2 * self.sleep_after_s:
            self._sleep_a_victim(tenant)
            parked.stage = 2

    def _sleep_a_victim(self, requester: Tenant | None) -> bool:
        if not self.sleep_victims or requester is None:
            return False
        candidates = [
            t for t, _ in self._victims(requester) if t.min_bytes == 0 and t.pending_sleep is None
        ]
        if not candidates:
            return False
        victim = min(candidates, key=lambda t: t.last_active)  # the longest idle
        log.info("reclaim: warm-sleeping %s for %s", victim.name, requester.name)
        self.service.sleeper.begin(victim, "warm", None)
        self.num_victims_slept += 1
        return True

    def _answer(self, parked: ParkedGrow, payload: bytes) -> None:
        self.service.replies.append((parked.waiter[0], payload))

    def stats(self) -> dict[str, Any]:
        return {
            "parked_grows": len(self.parked),
            "reclaim_requests": self.num_reclaim_requests,
            "victims_slept": self.num_victims_slept,
        }
