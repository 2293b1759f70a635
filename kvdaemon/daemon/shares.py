"""Shares: each active tenant's weighted share of the device, and the free pages held for short ones.

A tenant's **share** is ``num_pages * weight / total weight`` of the active,
attached tenants (physical pages). Elastic tenants may hold more than their
share while nobody else needs it; shares matter only once a tenant is
**short**: a grow of it found too few pages free within the last
``STARVED_S`` seconds (``Tenant.starved_at``, ``Tenant.starved_pages``: what
that grow needed at least).

Two rules follow, both about pages a short tenant below its share is owed:

- ``pages_past_share``: a short tenant is asked by reclaim only for what it
  holds past its share (``Reclaimer``), so two busy tenants do not take pages
  from each other back and forth, and a tenant that grows all the time cannot
  keep more than its share by it;
- ``free_for``: free pages are held back from a grow that would take its
  tenant past its share while another tenant below its share is short, up to
  what that one needs (its own need and its room below its share). Pages
  reclaim brought back for a short tenant therefore reach it, not the next
  busy tenant that grows ahead. A short tenant whose need passes its room is
  owed that room only while it is the longest refused of such tenants
  (``short_owed``): each of two such tenants would otherwise hold back pages
  the other's grow needs, and with three, grows that each fit the free pages
  alone were all refused for as long as they kept asking.

Grows *ahead of need* (``free_for_ahead``: a pool mapping its engine's
speculative floor) take only what is free above ``LOW_WATER`` of the pages
after both rules: speculation never eats the free pages a burst of real need
finds first, and never takes what ``ask_ahead`` asked other tenants to give.

A tenant's **fair share** (``fair_pages``) is its part of the pages tenants
may fill while ``LOW_WATER`` of them stay free, filled like water: a tenant
whose ``min_bytes`` is more than its weighted part gets its minimum, and the
rest is split among the others by weight (again, until no minimum is above
its part); each share is then rounded down to whole logical pages of its
tenant, so what a tenant holds past it is whole logical pages (what a reclaim
asks for). The fair shares of the active tenants add up to at most the
capacity less the low water (more only where the minimums alone exceed it).
``ask_ahead`` asks a tenant only for what it holds past its fair share
(``fair_pages``): while every tenant is within its fair share the low
water is free, so an ask ahead of need would only move cache pages between
tenants that all keep what they have. A pool is told its fair share and what
a grow ahead of need could take now (``free_for_ahead``) in every heartbeat
reply; one holding at least its fair share while the daemon has nothing to
spare takes new blocks from its own cache (``PoolAgent``) instead of growing.

Invariants: a tenant within its share is never refused for another's
shortage; nothing here maps or unmaps. Cost: O(tenants) per call at most; O(1) for an
active tenant's share and fair share while no tenant changed (the total weight and the fair
shares are kept per ``Tenants.version``), and for ``free_for`` while none is short.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdaemon.daemon.tenant import Tenant, Tenants, TenantState

STARVED_S = 1.0  # a tenant refused pages this recently is short
LOW_WATER = 0.1  # the fraction of the pages kept free: asked back from idle holders, never speculated on


def _min_pages(tenant: Tenant) -> int:
    """Physical pages of ``tenant``'s ``min_bytes``, rounded up."""
    return -(-tenant.min_bytes // tenant.page_size_bytes)


def _whole(tenant: Tenant, part: float) -> int:
    """``part`` physical pages rounded down to whole logical pages of ``tenant``."""
    segments = tenant.spec.num_segments
    return int(part) // segments * segments


@dataclass(frozen=True)
class ShortOwed:
    """The pages short tenants below their share are owed, by tenant id, and in all (``Shares.short_owed``)."""

    by_tenant: dict[int, int]
    num_pages: int


def held_pages(tenant: Tenant) -> int:
    """Physical pages ``tenant`` maps."""
    return len(tenant.logical) * tenant.spec.num_segments


class Shares:
    """Weighted shares over the tenants of one daemon (see the module docstring)."""

    def __init__(self, tenants: Tenants, num_pages: int) -> None:
        self.tenants = tenants
        self.num_pages = num_pages
        self._fair: tuple[int, dict[int, int]] | None = None  # (tenants.version, fair_pages_all)
        self._weight: tuple[int, float] | None = None  # (tenants.version, total weight of the active)
        self._last_starved_at = float("-inf")  # the latest ``starve`` of any tenant

    def starve(self, tenant: Tenant, now: float, num_pages: int | None = None) -> None:
        """A grow of ``tenant`` found too few pages free at ``now`` (``num_pages``: the
        physical pages it needed at least; None keeps the last need). O(1)."""
        tenant.starved_at = now
        if num_pages is not None:
            tenant.starved_pages = num_pages
        self._last_starved_at = max(self._last_starved_at, now)

    def share_of(self, tenant: Tenant) -> int:
        """Physical pages that are ``tenant``'s weighted share of the device now. O(1) while
        no tenant changed (``_total_weight``)."""
        total = self._total_weight()
        return int(self.num_pages * tenant.weight / (total or tenant.weight))

    def fair_pages(self, tenant: Tenant) -> int:
        """Physical pages that are ``tenant``'s fair share (see the module docstring), in whole
        logical pages; a tenant not active is counted as if it were. O(tenants) per pass of
        the water filling (one pass, or one more per tenant held at its minimum); O(1) for
        an active tenant while no tenant changed (``fair_pages_all``, cached)."""
        if tenant.state is TenantState.ACTIVE and tenant.leased:
            cached = self.fair_pages_all().get(tenant.tenant_id)
            if cached is not None:
                return cached
        active = self._active()  # not active, or changed without ``Tenants.changed``: alone
        if not any(t is tenant for t in active):
            active.append(tenant)
        parts, left, total = self._fill(active)
        return _whole(tenant, parts.get(tenant.tenant_id, left * tenant.weight / total if total else 0.0))

    def fair_pages_all(self) -> dict[int, int]:
        """``fair_pages`` of every active tenant by id, in one filling: O(tenants) per pass,
        computed again only once the tenants changed (``Tenants.changed``)."""
        if self._fair is not None and self._fair[0] == self.tenants.version:
            return self._fair[1]
        active = self._active()
        parts, left, total = self._fill(active)
        fair = {t.tenant_id: _whole(t, parts.get(t.tenant_id, left * t.weight / total if total else 0.0))
                for t in active}
        self._fair = (self.tenants.version, fair)
        return fair

    def _fill(self, active: list[Tenant]) -> tuple[dict[int, float], float, float]:
        """The water filling over ``active``: (the parts of tenants held at their minimum,
        the pages left for the rest, the rest's total weight)."""
        usable = float(self.num_pages - self.low_water_pages)
        parts: dict[int, float] = {}
        while True:  # each pass fixes at least one more tenant at its minimum, or ends
            rest = [t for t in active if t.tenant_id not in parts]
            left = max(0.0, usable - sum(parts.values()))
            total = sum(t.weight for t in rest)
            fixed = {t.tenant_id: float(_min_pages(t)) for t in rest if _min_pages(t) > left * t.weight / total}
            if not fixed:
                return parts, left, total
            parts.update(fixed)

    def anyone_short(self, now: float) -> bool:
        """Whether any tenant may be short at ``now`` (a ``starve`` within ``STARVED_S``). O(1)."""
        return now - self._last_starved_at < STARVED_S

    def is_short(self, tenant: Tenant, now: float) -> bool:
        return now - tenant.starved_at < STARVED_S

    def pages_past_share(self, tenant: Tenant, now: float) -> int | None:
        """For a short tenant, the physical pages it holds past its share; ``None`` when not short."""
        if not self.is_short(tenant, now):
            return None
        return max(0, held_pages(tenant) - self.share_of(tenant))

    def free_for(self, tenant: Tenant, num_free: int, now: float, owed: ShortOwed | None = None) -> int:
        """Free physical pages a grow of ``tenant`` may take: all of them up to its share,
        past it only those no short tenant below its share is owed. ``owed``: ``short_owed(now)``
        when the caller asks for several tenants with no grant between (one pass). O(1) while
        no tenant has been short for ``STARVED_S``, or with ``owed``; else O(tenants)."""
        if not self.anyone_short(now):
            return num_free
        if owed is None:
            owed = self.short_owed(now)
        others = owed.num_pages - owed.by_tenant.get(tenant.tenant_id, 0)
        if not others:
            return num_free
        room = max(0, self.share_of(tenant) - held_pages(tenant))
        return min(num_free, max(room, num_free - others))

    def short_owed(self, now: float) -> ShortOwed:
        """What each short tenant below its share is owed now, and their sum: what ``free_for``
        holds back from the others. A need within its room below its share is owed whole; of
        the short tenants whose need passes their room, only the longest refused is owed that
        room (two of them would each hold back what the other's grow needs, and neither could
        ever fit). O(tenants)."""
        by_tenant: dict[int, int] = {}
        beyond: tuple[float, int, int] | None = None  # (refused at, tenant id, room): the longest refused
        for t in self._active():
            if not self.is_short(t, now):
                continue
            room = max(0, self.share_of(t) - held_pages(t))
            if t.starved_pages <= room:
                by_tenant[t.tenant_id] = t.starved_pages
            elif room and (beyond is None or (t.starved_at, t.tenant_id) < beyond[:2]):
                beyond = (t.starved_at, t.tenant_id, room)
        if beyond is not None:
            by_tenant[beyond[1]] = beyond[2]
        return ShortOwed(by_tenant, sum(by_tenant.values()))

    def free_for_ahead(self, tenant: Tenant, num_free: int, now: float) -> int:
        """Free physical pages a grow *ahead of need* may take: ``free_for`` less the
        ``LOW_WATER`` pages kept free for real need."""
        return max(0, self.free_for(tenant, num_free, now) - self.low_water_pages)

    @property
    def low_water_pages(self) -> int:
        return int(self.num_pages * LOW_WATER)

    def _active(self) -> list[Tenant]:
        return [t for t in self.tenants if t.state is TenantState.ACTIVE and t.leased]

    def _total_weight(self) -> float:
        """The active tenants' total weight: O(tenants) once after they changed
        (``Tenants.changed``), then O(1)."""
        if self._weight is None or self._weight[0] != self.tenants.version:
            self._weight = (self.tenants.version, sum(t.weight for t in self._active()))
        return self._weight[1]
