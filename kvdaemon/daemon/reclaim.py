"""Reclaim: serving a grow the free pages cannot cover, with other tenants' pages.

A warm wake whose pages are not free is served the same way (parked with its
``attempt``, the wake itself): memory an idle tenant holds in its cache goes
to the sleeper, as it would to a grow.

When a grow finds too few free pages for its ``min_pages``, and other tenants
hold enough above their ``min_bytes``, the grow is parked (its reply waits) and
the daemon:

1. at once asks victims, in order of pages above ``min_bytes`` per unit of
   weight (largest first), for just the pages it lacks (``reclaim`` notice; a
   pool answers from its agent thread with spare pages, then cache-only pages,
   even while its engine is idle);
2. after ``escalate_s``, asks every victim for what is still missing, and
   again every ``REASK_S`` while the grow stays parked (a pool's debt lapses
   a second after the last urgent ask, ``pool_agent.OWED_S``);
3. after twice that, if ``sleep_victims`` is on, warm-sleeps the longest-idle
   victim that has no ``min_bytes`` guarantee, can be quiesced, answers, and has
   been idle ``victim_idle_s`` (default ``VICTIM_IDLE_S``; ``Tenant.may_be_victim``:
   a busy one keeps its share, as in step 1);
4. retries parked grows, oldest first, after every request and every tick; a
   grow still short at its ``wait_s`` (the client's, at most ``wait_s`` here)
   is answered ``NO_MEMORY``.

Ahead of need (``ask_ahead``, each tick): while fewer than ``shares.LOW_WATER`` of
the pages are free and no grow is parked, the daemon asks the tenants holding
the most reclaimable pages past their fair share (``Shares.fair_pages``;
per unit of weight) for what is missing, at most once per ``ASK_AHEAD_S``; a
tenant within its fair share is not asked (were every tenant within it, the
low water would be free). A pool gives spare pages and cache-only pages,
never the reserve its engine's next step needs, so a burst starting later finds
free pages instead of waiting for other tenants' caches to shrink. Such an ask
is not ``urgent``: a pool gives what it can now and owes nothing, while an ask
for a grow's real need is, and what a victim cannot give at once it owes
(returned as its blocks free; its engine admits no new request into them)
until its pool's agent wakes more than a second (``OWED_S``, equal to
``STARVED_S``) after the last such ask: a grow that was not parked is forgotten
as short by then, and one refused again asks again.

A grow with ``wait_s == 0`` is never parked: the victims are asked (step 1) so
that pages come back for a later grow, and the grow fails at once with
``NO_MEMORY``. A grow that no reclaim could serve (the others hold nothing
above their guarantees) fails at once. A tenant whose own grow found
too few pages free in the last ``STARVED_S`` (``shares``), or whose grow is still parked
(each retry that finds too few counts as a refusal), is short itself: it is asked only
for what it holds past its weighted share of the device (asking more would
only move memory between busy tenants; under a steady overload every tenant
keeps its share, like a static split, and a tenant that grows all the time
cannot keep more than its share by it). Nothing here takes a page from a
tenant: tenants give pages back themselves, or sleep. Logical page 0 of a
tenant is never counted as reclaimable (pools keep it mapped).

Pages back (``tell_free``, after every request and tick): a tenant refused
pages for its real need in the last ``STARVED_S`` is sent one ``free`` notice
once the grow it was refused would fit in the pages free for it
(``Shares.free_for``), so it asks again at once instead of on its back-off;
another refusal arms it again. In one pass tenants are told longest refused
first, each only of what the ones before it were not promised (their refused
grows), so several tenants are not sent after the same pages, all but one to
be refused again; nothing holds a promise past its pass.

Cost: O(tenants) per parked grow per retry, and per refused grow; O(tenants log tenants)
per ``tell_free`` with pages free and a tenant waiting.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvdaemon.daemon.grants import Grants
from kvdaemon.daemon.device_pages import DevicePages
from kvdaemon.daemon.log_throttle import LogThrottle
from kvdaemon.daemon.ports import LeasePort, notify
from kvdaemon.daemon.reclaim_debt import LAPSE_S
from kvdaemon.daemon.reply import PendingReply
from kvdaemon.daemon.shares import Shares, held_pages
from kvdaemon.daemon.sleep import Sleeper
from kvdaemon.daemon.tenant import VICTIM_IDLE_S, Tenant, Tenants, TenantState
from kvdaemon.errors import KVDaemonError, NoMemory, UnknownTenant
from kvdaemon.wire.sizes import format_bytes
from kvdaemon.wire.messages import FreeNotice, ReclaimNotice

log = logging.getLogger("kvdaemon.reclaim")
Attempt = Callable[[Tenant, float], "dict[str, Any] | None"]  # None: it answers the waiter itself
ASK_AHEAD_S = 0.25  # at most one such ask per this interval
REASK_S = 0.5  # a parked grow's victims are asked again this often (under a pool's OWED_S)
MAX_PARKED_PER_TENANT = 8  # grows and wakes of one tenant waiting at once (a pool has one grow in flight)
MAX_PARKED = 32  # grows and wakes waiting at once in all: every request retries them, each re-asks O(tenants)


@dataclass
class ParkedGrow:
    """A grow (or a warm wake: ``attempt``) waiting for pages to come back."""

    tenant_id: int
    candidates: list[int]
    min_pages: int
    waiter: PendingReply
    parked_at: float
    wait_s: float
    stage: int = 0  # 0: the first victims asked; 1: all asked; 2: a victim slept
    asked_at: float = 0.0  # when its victims were last asked
    attempt: Attempt | None = None  # tried instead of a grow of ``candidates``: ``NoMemory`` while short


class Reclaimer:
    """Parked grows and the reclaim steps that serve them (see the module docstring)."""

    def __init__(
        self, tenants: Tenants, shares: Shares, pages: DevicePages, grants: Grants, leases: LeasePort,
        sleeper: Sleeper, *, wait_s: float, escalate_s: float, sleep_victims: bool = True,
        victim_idle_s: float = VICTIM_IDLE_S,
    ) -> None:
        self.tenants = tenants
        self.shares = shares
        self.pages = pages
        self.grants = grants
        self.leases = leases
        self.sleeper = sleeper
        self.wait_s = wait_s
        self.escalate_s = escalate_s
        self.sleep_victims = sleep_victims
        self.victim_idle_s = victim_idle_s
        self.parked: list[ParkedGrow] = []
        self.num_reclaim_requests = 0
        self.warnings = LogThrottle(log)  # unpaid reclaim debts: one line a while
        self.num_asks_ahead = 0
        self._next_ask_ahead = float("-inf")

    def park(
        self, tenant: Tenant, candidates: list[int], min_pages: int, waiter: PendingReply,
        wait_s: float, now: float, attempt: Attempt | None = None,
    ) -> bool:
        """Park a grow short of pages if reclaim can serve it; False when it cannot (or ``wait_s == 0``).

        With ``wait_s == 0`` the victims are still asked, but nothing is parked. ``attempt``
        (a warm wake of ``min_pages`` logical pages) is retried instead of a grow. A tenant
        has at most ``MAX_PARKED_PER_TENANT`` grows and wakes parked: past that, nothing more
        is parked (a flood of asks cannot make every retry cost more); with ``MAX_PARKED``
        parked in all, the victims are asked but nothing more is parked, as with ``wait_s ==
        0`` (many tenants' floods cannot either). Wakes parked together are answered together:
        the first that fits wakes the tenant, the rest find it awake.
        """
        if sum(p.tenant_id == tenant.tenant_id for p in self.parked) >= MAX_PARKED_PER_TENANT:
            return False
        if len(self.parked) >= MAX_PARKED:
            wait_s = 0.0
        self.shares.starve(tenant, now, min_pages * tenant.spec.num_segments)
        short = self._short(tenant, min_pages)
        victims = self._victims(tenant, now)
        if sum(pages for _, pages in victims) < short:
            return False
        self._ask(victims, short, now, stop_when_covered=True, requester=tenant)
        if wait_s <= 0:
            return False
        self.parked.append(
            ParkedGrow(tenant.tenant_id, candidates, min_pages, waiter, now, wait_s, asked_at=now, attempt=attempt)
        )
        return True

    def _short(self, tenant: Tenant, min_pages: int) -> int:
        return min_pages * tenant.spec.num_segments - self.pages.num_free

    def _ask(
        self, victims: list[tuple[Tenant, int]], short: int, now: float, stop_when_covered: bool,
        requester: Tenant | None = None,
    ) -> None:
        """Send reclaim notices for ``short`` pages, best victim first (with a ``requester``:
        urgent, for its real need, and what a victim cannot give now it owes; without: only
        what it can give now)."""
        urgent = requester is not None
        remaining = short
        for victim, pages_above_min in victims:
            if remaining <= 0 and stop_when_covered:
                return
            ask = min(pages_above_min, max(remaining, 1))
            num_logical = -(-ask // victim.spec.num_segments)
            notify(self.leases, victim.tenant_id, ReclaimNotice(num_logical, urgent, now + LAPSE_S))
            if requester is not None:
                victim.debt.ask(num_logical, now, requester.tenant_id)
            self.num_reclaim_requests += 1
            remaining -= num_logical * victim.spec.num_segments

    def ask_ahead(self, now: float) -> None:
        """Keep ``LOW_WATER`` of the pages free: ask the tenants most past their fair share
        (reclaimable pages past it, per unit of weight) for what is missing."""
        short = self.shares.low_water_pages - self.pages.num_free
        if short <= 0 or self.parked or now < self._next_ask_ahead:
            return
        self._next_ask_ahead = now + ASK_AHEAD_S
        fair = self.shares.fair_pages_all()  # victims are active: each has its share here
        capped = [(t, min(pages, max(0, held_pages(t) - fair[t.tenant_id])))
                  for t, pages in self._victims(None, now)]
        victims = sorted((v for v in capped if v[1] > 0), key=lambda v: v[1] / v[0].weight, reverse=True)
        if victims:
            self._ask(victims, short, now, stop_when_covered=True)
            self.num_asks_ahead += 1

    def tell_free(self, now: float) -> None:
        """Tell each short tenant, once per refusal, that pages are free for it again: in one
        pass, longest refused first, each only of what the ones told before it were not
        promised (their refused grows). A promise lasts that pass: pages a told tenant has
        not taken by the next pass may be told to the next one (nothing holds them for it).
        O(tenants log tenants) when pages are free and someone waits, O(tenants) otherwise."""
        num_free = self.pages.num_free
        if not num_free or not self.shares.anyone_short(now):
            return
        waiting = [t for t in self.tenants if t.told_free_at < t.starved_at and self.shares.is_short(t, now)
                   and t.state is TenantState.ACTIVE and t.leased]
        owed = self.shares.short_owed(now)  # once per pass: nothing is granted during it
        for t in sorted(waiting, key=lambda t: t.starved_at):  # the longest refused first
            free = self.shares.free_for(t, num_free, now, owed)
            if free >= t.starved_pages:
                t.told_free_at = now
                notify(self.leases, t.tenant_id, FreeNotice(free))
                num_free -= t.starved_pages  # promised: the next tenant is told only of the rest
                if num_free <= 0:
                    return

    def _victims(self, requester: Tenant | None, now: float) -> list[tuple[Tenant, int]]:
        """Other active tenants with pages above ``min_bytes`` (a tenant short itself,
        ``STARVED_S``: only those past its weighted share): (tenant, pages), best first."""
        found = []
        for t in self.tenants:
            if t is requester or t.state is not TenantState.ACTIVE or not t.leased:
                continue
            pages = t.reclaimable_pages
            past_share = self.shares.pages_past_share(t, now)  # a short tenant keeps its share
            if past_share is not None:
                pages = min(pages, past_share)
            if pages:
                found.append((t, pages))
        found.sort(key=lambda item: item[1] / item[0].weight, reverse=True)
        return found

    def retry(self, now: float) -> None:
        """Serve parked grows that now fit; sleep a victim or give up where it is time."""
        self.parked = [parked for parked in self.parked if not self._serve(parked, now)]

    def _serve(self, parked: ParkedGrow, now: float) -> bool:
        """True when the grow was answered (granted or failed) and leaves the queue."""
        tenant = self.tenants.get(parked.tenant_id)
        try:
            if tenant is None:
                raise UnknownTenant("the tenant went away while its grow waited")
            if parked.attempt is not None:
                result = parked.attempt(tenant, now)
            else:
                self.grants.check_may_fit(tenant, parked.min_pages)  # O(1): most retries end here
                result = self.grants.grow(tenant, parked.candidates, parked.min_pages, now)
        except NoMemory as exc:
            assert tenant is not None
            if now - parked.parked_at >= parked.wait_s:
                tenant.note_refused(exc.code, parked.min_pages, self.pages.free_bytes, now)
                parked.waiter.fail(exc)
                return True
            self.shares.starve(tenant, now)  # still short while it waits, however long past STARVED_S
            self._escalate(parked, tenant, now)
            return False
        except KVDaemonError as exc:
            parked.waiter.fail(exc)
            return True
        if result is not None:  # None: a wake whose copy back runs answers the waiter itself
            parked.waiter.ok(result)
        return True

    def _escalate(self, parked: ParkedGrow, tenant: Tenant, now: float) -> None:
        waited = now - parked.parked_at
        if parked.stage == 0 and waited >= self.escalate_s:
            self._ask_all(parked, tenant, now)
            parked.stage = 1
        elif parked.stage == 1 and waited >= 2 * self.escalate_s:
            self._sleep_a_victim(tenant, now)
            parked.stage = 2
        elif parked.stage and now - parked.asked_at >= REASK_S:
            self._ask_all(parked, tenant, now)  # so what victims owe does not lapse while it waits

    def _ask_all(self, parked: ParkedGrow, tenant: Tenant, now: float) -> None:
        self._ask(self._victims(tenant, now), self._short(tenant, parked.min_pages), now, stop_when_covered=False,
                  requester=tenant)
        parked.asked_at = now

    def _sleep_a_victim(self, requester: Tenant, now: float) -> bool:
        if not self.sleep_victims:
            return False
        candidates = [t for t, _ in self._victims(requester, now) if t.may_be_victim(now, self.victim_idle_s)]
        if not candidates:
            return False
        victim = min(candidates, key=lambda t: t.last_active)  # the longest idle
        why = f"reclaim: pages wanted by {requester.name}"
        self.sleeper.begin(victim, "warm", None, now, why=why, victim=True)
        mode = victim.pending_sleep.mode if victim.pending_sleep is not None else "warm"
        log.info("reclaim: asking %s to sleep (%s) for %s", victim.name, mode, requester.name)
        return True

    def cancel_all(self, error: KVDaemonError) -> None:
        """Answer every parked grow with ``error`` (the daemon is stopping)."""
        for parked in self.parked:
            parked.waiter.fail(error)
        self.parked = []

    def requester_left(self, tenant: Tenant) -> None:
        """``tenant`` is gone: the debts of the asks made only for it end, not unpaid (nobody
        waits for those pages any more). O(tenants)."""
        for t in self.tenants:
            if t.debt.owed_pages:
                t.debt.requester_left(tenant.tenant_id)

    def settle_debts(self, now: float) -> None:
        """End the reclaim debts whose asks lapsed (``reclaim_debt``); log the unpaid ones
        (one line a while, the rest counted). O(tenants)."""
        for t in self.tenants:
            if not t.debt.owed_pages:
                continue
            if t.state is not TenantState.ACTIVE:
                t.debt.forgive()  # asleep: every page went back
            elif t.debt.lapse(now):
                self.warnings.warning("unpaid", "tenant %s gave nothing back for %.0f s after urgent reclaim "
                                      "asks (holds %s, fair share %s): it ignores them, or every block of "
                                      "it was in use", t.name, LAPSE_S, format_bytes(t.mapped_bytes),
                                      format_bytes(self.shares.fair_pages(t) * t.page_size_bytes))  # fmt: skip
        self.warnings.flush()

    def stats(self) -> dict[str, Any]:
        return {
            "parked_grows": len(self.parked),
            "reclaim_requests": self.num_reclaim_requests,
        }
