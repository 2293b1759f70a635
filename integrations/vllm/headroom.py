"""``Headroom``: how many more blocks the daemon could grant a pool now, refreshed cheaply.

The figure is an estimate from the daemon's status (``grantable_blocks``: the
tenant's limit less what it has mapped, bounded by the daemon's free bytes
and by the pool's unmapped virtual pages). It is refreshed at most every
``refresh_s`` and only when asked, so an idle engine costs the daemon nothing
and a busy one one status round trip per ``refresh_s``.

A refused grow zeroes the estimate and stops further grow attempts until the
next refresh: between two refreshes the engine asks the daemon at most once
in vain, while the daemon (asked) reclaims pages from other tenants for the
next try.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvdaemon.errors import KVDaemonError

if TYPE_CHECKING:
    from kvdaemon.client import KVClient, KVPool

log = logging.getLogger("kvdaemon.integrations.vllm")
REFRESH_S = 0.1


def grantable_blocks(pool: KVPool, status: dict[str, Any]) -> tuple[int, bool]:
    """(blocks the daemon could still grant ``pool``, whether its limit leaves room for a page).

    The one place this estimate is made: free bytes of the daemon and the
    tenant's ``max_bytes`` less its ``mapped_bytes``, in whole logical pages
    the pool has not mapped yet. Cached blocks of other tenants the daemon
    could reclaim are not counted (a grow attempt makes the daemon reclaim).
    """
    row = next((t for t in status.get("tenants", ()) if t.get("name") == pool.name), None)
    if row is None:
        return 0, False
    logical_page_bytes = pool.page_bytes * pool.spec.num_segments
    by_limit = (int(row["max_bytes"]) - int(row["mapped_bytes"])) // logical_page_bytes
    by_free = int(status["free_bytes"]) // logical_page_bytes
    unmapped = pool.num_virtual_pages - pool.mapped_bytes // logical_page_bytes
    pages = max(0, min(by_limit, by_free, unmapped))
    return pages * pool.blocks_per_page, by_limit > 0 and unmapped > 0


class Headroom:
    """The cached ``grantable_blocks`` of one pool (see the module docstring)."""

    def __init__(
        self,
        pool: KVPool,
        client: KVClient,
        refresh_s: float = REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.client = client
        self.refresh_s = refresh_s
        self.clock = clock
        self._blocks = 0
        self._room = True
        self._refused = False
        self._next_refresh = 0.0

    def blocks(self) -> int:
        """Blocks the daemon could grant now; 0 after a refusal until the next refresh."""
        self._refresh_if_due()
        return 0 if self._refused else self._blocks

    def may_grow(self) -> bool:
        """Whether a grow is worth asking for: no refusal since the last refresh, room under the limit."""
        self._refresh_if_due()
        return self._room and not self._refused

    def refused(self) -> None:
        """The daemon refused a grow: no more asks, and no headroom, until the next refresh."""
        self._refused = True

    def expire(self) -> None:
        """Refresh at the next question (the limit or the pool's pages changed)."""
        self._next_refresh = 0.0

    def _refresh_if_due(self) -> None:
        now = self.clock()
        if now < self._next_refresh:
            return
        self._next_refresh = now + self.refresh_s
        self._refused = False
        try:
            self._blocks, self._room = grantable_blocks(self.pool, self.client.status())
        except KVDaemonError as exc:  # the daemon is away: nothing can be granted until it is back
            log.debug("pool %s: no headroom estimate: %s", self.pool.name, exc)
            self._blocks, self._room = 0, False
