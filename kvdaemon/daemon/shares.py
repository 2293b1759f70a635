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
  busy tenant that grows ahead.

Grows *ahead of need* (``free_for_ahead``: a pool mapping its engine's
speculative floor) take only what is free above ``LOW_WATER`` of the pages
after both rules: speculation never eats the free pages a burst of real need
finds first, and never takes what ``ask_ahead`` asked other tenants to give.

Invariants: a tenant within its share is never refused for another's
shortage; nothing here maps or unmaps. Cost: O(tenants) per call.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvdaemon.daemon.tenant import Tenant, TenantState

STARVED_S = 1.0  # a tenant refused pages this recently is short
LOW_WATER = 0.1  # the fraction of the pages kept free: asked back from idle holders, never speculated on


def held_pages(tenant: Tenant) -> int:
    """Physical pages ``tenant`` maps."""
    return len(tenant.logical) * tenant.spec.num_segments


class Shares:
    """Weighted shares over the tenants of one daemon (see the module docstring)."""

    def __init__(self, tenants: Iterable[Tenant], num_pages: int) -> None:
        self.tenants = tenants
        self.num_pages = num_pages

    def share_of(self, tenant: Tenant, total_weight: float | None = None) -> int:
        """Physical pages that are ``tenant``'s weighted share of the device now
        (``total_weight``: of the active tenants, when the caller has it)."""
        total = total_weight if total_weight is not None else self._total_weight()
        return int(self.num_pages * tenant.weight / (total or tenant.weight))

    def is_short(self, tenant: Tenant, now: float) -> bool:
        return now - tenant.starved_at < STARVED_S

    def pages_past_share(self, tenant: Tenant, now: float) -> int | None:
        """For a short tenant, the physical pages it holds past its share; ``None`` when not short."""
        if not self.is_short(tenant, now):
            return None
        return max(0, held_pages(tenant) - self.share_of(tenant))

    def free_for(self, tenant: Tenant, num_free: int, now: float) -> int:
        """Free physical pages a grow of ``tenant`` may take: all of them up to its share,
        past it only those no short tenant below its share is owed."""
        active = self._active()
        total = sum(t.weight for t in active)
        owed = sum(
            min(t.starved_pages, max(0, self.share_of(t, total) - held_pages(t)))
            for t in active if t is not tenant and self.is_short(t, now)
        )  # fmt: skip
        if not owed:
            return num_free
        room = max(0, self.share_of(tenant, total) - held_pages(tenant))
        return min(num_free, max(room, num_free - owed))

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
        return sum(t.weight for t in self._active())
