"""``StallWatch``: says in the log when an engine with work has computed nothing for a while, and why.

An engine whose pool cannot hold its next request waits (nothing is lost): the
pool may be asleep, the daemon short of memory or gone, or the tenant's limit
below what the request needs. Waiting silently looks like a hang, so after
``WARN_S`` seconds of steps that computed nothing, with requests waiting, the
engine logs one warning with what it knows (requests waiting and running, the
first one's blocks, the pool's free blocks, mapped bytes and limit), and again
every ``WARN_S`` while the stall lasts; one line when it ends. A first request
that needs more blocks than the limit can hold is named as such, with the fix.

Cost: O(1) per step; the warning, O(1) more, at most once per ``WARN_S``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kvdaemon.wire.sizes import format_bytes

log = logging.getLogger("kvdaemon.engine")
WARN_S = 10.0


class StallWatch:
    """Watches one engine's steps (``note`` after each) and logs its stalls (module docstring)."""

    def __init__(self, describe: Callable[[], dict[str, Any]], clock: Callable[[], float] = time.monotonic) -> None:
        self.describe = describe  # what the engine knows now (``stall_text``'s fields)
        self.clock = clock
        self.stalled_since: float | None = None
        self._warned_at = 0.0

    def note(self, computed: bool, has_work: bool) -> None:
        """After a step: ``computed`` whether it computed anything, ``has_work`` whether
        requests remain."""
        if computed or not has_work:
            if self.stalled_since is not None and self._warned_at > self.stalled_since:
                log.warning("engine: steps compute again after %.0f s", self.clock() - self.stalled_since)
            self.stalled_since = None
            return
        now = self.clock()
        if self.stalled_since is None:
            self.stalled_since = self._warned_at = now
        elif now - self._warned_at >= WARN_S:
            self._warned_at = now
            log.warning("engine: %s", stall_text(now - self.stalled_since, **self.describe()))


def stall_text(
    stalled_s: float, *, num_waiting: int, num_running: int, first_blocks: int, num_free_blocks: int,
    mapped_bytes: int | None, max_bytes: int | None, limit_blocks: int | None, sleep_mode: str | None, name: str,
) -> str:
    """One line on a stall of ``stalled_s`` seconds (see the module docstring); ``limit_blocks``:
    the most blocks ``max_bytes`` maps (whole logical pages)."""
    text = (f"nothing computed for {stalled_s:.0f} s: {num_waiting} request(s) waiting, {num_running} running; "
            f"the first waiting needs {first_blocks} block(s), {num_free_blocks} free")
    if mapped_bytes is not None:
        text += f", {format_bytes(mapped_bytes)} mapped"
    if max_bytes is not None:
        text += f", limit {format_bytes(max_bytes)}"
    if sleep_mode is not None:
        return text + f"; the pool is asleep ({sleep_mode}) and could not be woken yet"
    if limit_blocks is not None and not num_running and first_blocks > limit_blocks:
        return (text + f"; the limit holds at most {limit_blocks} block(s), so it waits until "
                f"the limit is raised (kvdaemon limit {name} --max SIZE)")
    return text + "; it waits for memory (other tenants' pages, or the daemon)"
