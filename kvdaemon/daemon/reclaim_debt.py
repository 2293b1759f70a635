"""What urgent reclaim asks wanted back from a tenant, and whether it gave anything.

A grow parked for pages asks its victims urgently (``Reclaimer``): an honest
pool gives what it can at once and the rest as its blocks free. The daemon
never takes a page a tenant maps, so one that ignores the asks keeps what it
holds; this record makes that visible. A debt opens at an urgent ask
(``owed_pages``: logical pages asked and not given back, the largest ask
while it is open) and shrinks with every page the tenant gives back; it ends
paid at zero, ends when every tenant it was asked for has left, or lapses
``LAPSE_S`` after the last ask. A debt that lapses
with nothing given back at all counts as *unpaid* (``num_unpaid``): status
shows it per tenant and ``kvdaemon status`` notes it, since either the
tenant ignores reclaim or every one of its blocks was in use that long.

Mutated only by the service loop. Cost: O(1) per ask, per give and per check.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LAPSE_S = 2.0  # past the reclaim's 2 s wait and the pools' OWED_S: nobody waits on it any more


@dataclass
class ReclaimDebt:
    """One tenant's open reclaim debt and its count of unpaid ones (module docstring)."""

    owed_pages: int = 0  # logical pages asked urgently and not yet given back
    asked_at: float = float("-inf")  # the last urgent ask
    num_given: int = 0  # logical pages given back since the debt opened
    num_unpaid: int = 0  # debts that lapsed with nothing given back
    requester_ids: set[int] = field(default_factory=set)  # the tenants whose need the open debt is for

    def ask(self, num_pages: int, now: float, requester_id: int) -> None:
        """An urgent ask for ``num_pages`` logical pages at ``now``, for tenant ``requester_id``."""
        if not self.owed_pages:
            self.num_given = 0
            self.requester_ids.clear()
        self.owed_pages = max(self.owed_pages, num_pages)
        self.asked_at = now
        self.requester_ids.add(requester_id)

    def requester_left(self, requester_id: int) -> None:
        """Tenant ``requester_id`` is gone: a debt only for its need is owed to nobody (ended,
        not unpaid)."""
        self.requester_ids.discard(requester_id)
        if not self.requester_ids:
            self.owed_pages = 0

    def give(self, num_pages: int) -> None:
        """The tenant gave back ``num_pages`` logical pages (a shrink)."""
        if self.owed_pages:
            self.num_given += num_pages
            self.owed_pages = max(0, self.owed_pages - num_pages)

    def forgive(self) -> None:
        """Its pages all went back (a sleep) or it left: nothing is owed."""
        self.owed_pages = 0

    def lapse(self, now: float) -> bool:
        """End a debt whose last ask is ``LAPSE_S`` old; True when it lapsed unpaid."""
        if not self.owed_pages or now - self.asked_at < LAPSE_S:
            return False
        self.owed_pages = 0
        unpaid = self.num_given == 0
        self.num_unpaid += unpaid
        return unpaid
