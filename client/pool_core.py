"""``PoolCore``: what a pool's engine thread and its agent thread share, and its page moves.

The core holds the pool's lock (``PoolLock``: the lock and its block gate), its state (``PoolStateCell``), its mapped
pages (``SegmentMap``), its blocks (``BlockAllocator``; a warm sleeper's set
aside), its lease, what it knows of its limit, and the engine's hooks. Every
page move goes through here, under the lock:

- ``grow_for(n)``: map pages until n blocks are free, in one grow: the daemon
  is asked for at least the pages needed and at most that plus prefetch, never
  past the limit the pool knows (refused locally, no round trip). A grow whose
  reply came late is adopted here (mapped as spare pages) before asking again.
- ``grow_reserve`` / ``grow_floor``: the agent maps pages in the background until
  ``reserve_blocks`` blocks are free (the engine's ``keep_free``: what its
  next steps will take), so the engine's allocations find them mapped; then,
  *ahead of need*, until ``ahead_blocks`` are free (the engine's floor for
  requests that may arrive: the daemon grants those only from memory nobody
  needs, and a reclaim takes them like spare pages);
- ``return_excess``: spare pages past ``num_spare_pages`` (or ``spare_blocks``), and pages owed after
  a lowered limit or a reclaim, are unmapped and given back (the agent runs
  it, not the engine), never so many that fewer than ``reserve_blocks`` stay
  free (a reclaim never takes what the engine's next steps need; a limit
  binds whatever the reserve). Logical page 0 is the first page a pool maps
  and is never given back while any other page is mapped, so every tensor's
  base address is mapped whenever the pool holds a block (GPU kernel
  launchers check it); it goes last, when a limit under one logical page
  asks for it.
- ``drop_all_pages``: unmap everything without telling the daemon (revoked,
  closing).

Grow and return round trips run with the block gate open: the engine's
``alloc``/``free`` go on meanwhile (the pages returned are out of the
allocator and unmapped before it opens; granted pages join it after).

Cost: one daemon round trip per grow or return; O(pages) local work.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from kvdaemon.client.allocator import BlockAllocator
from kvdaemon.client.lease import Grant, Lease
from kvdaemon.client.pool_lock import PoolLock
from kvdaemon.client.pool_state import PoolState, PoolStateCell
from kvdaemon.client.segments import SegmentMap
from kvdaemon.client.spec import KVSpec
from kvdaemon.wire.handles import MAX_GROW_PAGES, max_grant_pages
from kvdaemon.wire.messages import limit_revision
from kvdaemon.errors import (
    Asleep, BackendError, BadRequest, DaemonUnreachable, NoMemory, OverLimit,
    PoolClosed, PoolExhausted,
)

log = logging.getLogger("kvdaemon.client.pool")
REFUSED_S = 1.0
"""After the daemon refused a grow for want of memory, a grow that may not wait of a pool
the agent maps ahead for (an engine's: its agent probes, backing off) is refused here,
without a round trip, until a grow succeeds again, the daemon says pages are free for it
(``free`` notice), or this long has passed (the daemon's ``STARVED_S``: as long as it
counts the pool short and so tells it)."""


class PoolCore:
    """Shared state and page moves of one ``KVPool`` (see the module docstring)."""

    def __init__(
        self, lease: Lease, spec: KVSpec, num_virtual_pages: int, num_spare_pages: int,
        num_prefetch_pages: int,
    ) -> None:
        self.lease = lease
        self.spec = spec
        self.name = lease.name
        self.backend = lease.backend
        self.page_bytes = lease.page_size_bytes
        self.num_virtual_pages = num_virtual_pages
        self.num_spare_pages = num_spare_pages
        self.num_prefetch_pages = min(num_prefetch_pages, num_spare_pages)
        self.max_grant_pages = max_grant_pages(spec.num_segments)  # logical pages one grow may get
        self.lock = PoolLock()
        self.cell = PoolStateCell(self.lock)
        self.segments = SegmentMap(self.backend, spec.num_segments, num_virtual_pages, self.page_bytes)
        self.allocator = self.new_allocator()
        self.sleeping_allocator: BlockAllocator | None = None  # a warm sleeper's blocks
        self.max_bytes: int | None = lease.limit.get("max_bytes")
        self.old_stuck: set[int] = set()  # stuck logical pages of a daemon gone (the daemon now never granted them)
        self.max_pages = self._max_pages(self.max_bytes)  # logical pages the known limit lets be mapped (``free``)
        self.limit_revision = limit_revision(lease.limit)  # of ``max_bytes``: an older report is ignored
        self.limit_lock = threading.Lock()  # a leaf, over the three fields above (``set_limit``)
        self.grow_wait_s: float | None = None  # None: the daemon's default; 0: refuse at once
        self.most_wait_s = float("inf")  # the daemon's bound on ``grow_wait_s`` (its ``reclaim_wait_s``), if told
        self.asked_pages = 0  # urgently asked back, still in use: returned as blocks are freed, or lapsed
        self.asked_at = float("-inf")  # when the last urgent ask left pages owed (time.monotonic)
        self.reserve_blocks = 0  # kept free and mapped for the engine's next steps (``keep_free``)
        self.spare_blocks = 0  # spare kept past ``num_spare_pages`` until asked for (``keep_free``)
        self.ahead_blocks = 0  # mapped ahead of need, kept until asked for (``keep_free``)
        self.refused_at = float("-inf")  # when the daemon last had no memory for a grow
        self.refused_pages = 0  # ... of how many logical pages (smaller grows still ask)
        self.num_limit_refusals = 0  # grows refused here, past the known limit (the agent tells the daemon)
        self.orphaned: list[tuple[int, list[int]]] = []  # (block losses then, ids): ``KVPool.free_later``
        self.ahead_refused_at = float("-inf")  # when the daemon last had nothing to spare ahead of need
        self.fair_bytes: int | None = None  # this tenant's fair share, as the daemon last told it
        self.ahead_room_bytes: int | None = None  # what a grow ahead of need could take, as last told
        self.pending_return: set[int] = set()  # unmapped here, shrink not yet confirmed
        self.num_block_losses = 0  # times every block was dropped (cold sleep, empty restart)
        self.active = False  # the engine stepped since the last heartbeat (``note_activity``)
        self.relink_error: str | None = None  # why re-registering with a new daemon failed
        self.num_refused_moves = 0  # moves to a new daemon refused in a row (``pool_reconnect``)
        self.quiesce_hook: Callable[[], None] | None = None  # returns once the engine is between steps
        self.resume_hook: Callable[[], None] | None = None  # the engine may step again
        self.reclaim_hook: Callable[[int], int] | None = None  # evicts up to N cache-only blocks
        # Held by the agent while it gives spare pages back, yielding whether it may: an engine that
        # counts the pool's free blocks and takes them later (vLLM) holds it across the two.
        self.return_gate: Callable[[], AbstractContextManager[bool]] | None = None

    # -- geometry and state ------------------------------------------------------

    @property
    def state(self) -> PoolState:
        return self.cell.state

    @property
    def logical_page_bytes(self) -> int:
        return self.page_bytes * self.spec.num_segments

    @property
    def mapped_bytes(self) -> int:
        """Bytes of the logical pages the daemon counts as this pool's: mapped or ``stuck``."""
        return (len(self.segments.pages) + self.num_stuck_counted()) * self.logical_page_bytes

    def num_stuck_counted(self) -> int:
        """Stuck logical pages (``SegmentMap.stuck``) the daemon counts as this pool's. O(1)."""
        return len(self.segments.stuck) - len(self.old_stuck)

    def stuck_changed(self) -> None:
        """Count the stuck pages against the limit: ``max_pages`` is what may be mapped. O(1)."""
        with self.limit_lock:
            self.max_pages = self._max_pages(self.max_bytes)

    def new_allocator(self) -> BlockAllocator:
        return BlockAllocator(self.num_virtual_pages, self.page_bytes, self.spec.block_bytes)

    def check_can_grow(self) -> None:
        """Raise the error that tells why this pool cannot map pages now, if it cannot."""
        state = self.cell.state
        if state.ended:
            raise PoolClosed(f"pool {self.name!r} is {state.value}")
        if state.asleep or state is PoolState.SLEEP_PENDING:
            raise Asleep(f"pool {self.name!r} is {state.value}; wake it first")
        if state is PoolState.DETACHED or self.lease.lost.is_set():
            if self.relink_error is not None:
                raise DaemonUnreachable(
                    f"pool {self.name!r} is not registered with the daemon running now "
                    f"(re-registering failed: {self.relink_error}); no new pages until it is"
                )
            raise DaemonUnreachable(
                f"pool {self.name!r}: the daemon is gone; no new pages until one runs again"
            )

    # -- growing (lock held) -----------------------------------------------------

    def grow_for(
        self, num_blocks: int, wait_s: float | None = None, probe: bool = False, ahead: bool = False
    ) -> None:
        """Map pages until ``num_blocks`` blocks are free; ``PoolExhausted`` when it cannot.

        ``wait_s``: how long the daemon may wait for other tenants' pages
        (default ``grow_wait_s``). A grow that may not wait, of a pool the
        agent maps ahead for (a reserve or a floor), is refused here after a
        refusal of the daemon of as many pages or fewer, until a grow succeeds
        again (the agent's ``probe``, which takes whatever the daemon has, at
        least one page, in one round trip), a ``free`` notice, or ``REFUSED_S``
        passed. ``ahead``: a probe for pages
        ahead of need (``Lease.grow``); its refusal says nothing of real need,
        so it refuses nothing here later. Raises ``DaemonUnreachable``
        (``NoReply`` when the daemon holds its directory but is slow: the grow
        stays outstanding), ``Asleep``, ``PoolClosed``. Nothing is allocated here.
        """
        self.adopt_late_grants()
        wait = self.grow_wait_s if wait_s is None else wait_s
        probe = probe or ahead
        mapped_ahead = self.reserve_blocks or self.ahead_blocks
        while num_blocks > self.allocator.num_free:
            if self.segments.stuck and not self.free_stuck():
                raise PoolExhausted(
                    f"pool {self.name!r}: {len(self.segments.stuck)} logical page(s) a failed map left mapped "
                    "cannot be unmapped; it maps no more pages until they are"
                )
            self.check_can_grow()
            needed = -(-(num_blocks - self.allocator.num_free) // self.allocator.blocks_per_page)
            needed = min(needed, self.max_grant_pages)  # one frame's worth a round trip; the loop asks again
            if (wait == 0 and not probe and mapped_ahead and needed >= self.refused_pages
                    and time.monotonic() - self.refused_at < REFUSED_S):  # fmt: skip
                raise PoolExhausted(f"pool {self.name!r}: the daemon had no memory free just now")
            skip = self.lease.in_flight | self.pending_return | self.segments.stuck.keys()
            num_wanted = min(needed + self.num_prefetch_pages, self.max_grant_pages)
            candidates = self.allocator.unmapped_pages(num_wanted, skip)
            mappable = self.segments.mappable_pages()
            if probe:  # ahead of need: what the limit, the virtual range and the OS allow, maybe nothing
                needed = min(needed, len(candidates), self.headroom_pages(), mappable)
                if needed <= 0:
                    return
            if needed > mappable:
                raise PoolExhausted(
                    f"pool {self.name!r} needs {needed} more page(s); this process may map {mappable} more "
                    f"(its memory mappings would pass vm.max_map_count): raise it (sysctl) or use a larger page size"
                )
            if len(candidates) < needed:
                raise PoolExhausted(
                    f"pool {self.name!r} has {self.allocator.num_blocks} blocks of virtual capacity; "
                    f"{num_blocks} free wanted"
                )
            headroom = self.headroom_pages()
            if needed > headroom:
                self.num_limit_refusals += 1
                raise PoolExhausted(
                    f"pool {self.name!r} needs {needed} more page(s); its limit of "
                    f"{self.max_bytes} bytes allows {headroom}"
                )
            del candidates[headroom:]
            try:
                with self.lock.open_gate():  # candidates stay unmapped: only lock holders map
                    granted = self.lease.grow(candidates, wait, min_pages=1 if probe else needed, ahead=ahead)
            except NoMemory as exc:
                if ahead:
                    self.ahead_refused_at = time.monotonic()
                else:
                    self.refused_at, self.refused_pages = time.monotonic(), needed
                raise PoolExhausted(f"daemon refused {needed} page(s): {exc.message}") from exc
            except OverLimit as exc:
                raise PoolExhausted(f"daemon refused {needed} page(s): {exc.message}") from exc
            try:
                self.map_grant(granted)
            except BackendError as exc:  # the map cap, met by pages that scattered: what the pool could not map
                if self.segments.mappable_pages() >= needed and not self.segments.stuck:
                    raise
                raise PoolExhausted(f"pool {self.name!r}: {exc.message}") from exc
            if ahead:
                self.ahead_refused_at = float("-inf")
            else:
                self.asked_pages = 0  # the daemon granted real need: it no longer wants pages back
            self.refused_at = float("-inf")
            if probe:
                return  # what the daemon had; the agent asks again when the engine needs more

    def grow_reserve(self) -> bool:
        """Map pages until ``reserve_blocks`` are free, as far as the daemon has them now (lock
        held). False when it had none: it has asked other tenants for pages, and tells this
        pool when they are free (``free`` notice)."""
        return self._grow_to(self.reserve_blocks, ahead=False)

    def grow_floor(self) -> bool:
        """Map pages until ``ahead_blocks`` are free, ahead of need (lock held): False when the
        daemon has no memory to spare (it asks nobody for these), or this pool owes pages."""
        if self.owed_pages:
            return self._has_free(self.ahead_blocks)
        return self._grow_to(self.ahead_blocks, ahead=True)

    def _grow_to(self, num_blocks: int, ahead: bool) -> bool:
        if self.cell.state is not PoolState.ACTIVE or self._has_free(num_blocks):
            return True
        try:  # one round trip: what the daemon has
            self.grow_for(min(num_blocks, self.allocator.num_blocks), wait_s=0, probe=True, ahead=ahead)
        except PoolExhausted:
            return False
        return True

    def scarce(self) -> bool:
        """The daemon refused a grow ahead of need within ``REFUSED_S`` and granted none since:
        what it has free is its low-water reserve, kept for real need. O(1), no lock."""
        return time.monotonic() - self.ahead_refused_at < REFUSED_S

    def recycles(self) -> bool:
        """New blocks come from the engine's own cache, not the daemon: this pool holds at
        least its fair share (``fair_bytes``) and the daemon has nothing to spare (the last
        heartbeat reply's ``ahead_room_bytes`` under one logical page, or it refused this pool's
        floor or reserve within ``REFUSED_S``). Unknown (a daemon that does not tell): False.
        Only an engine with a cache (``reclaim_hook``) recycles. O(1), no lock."""
        fair, room = self.fair_bytes, self.ahead_room_bytes
        if self.reclaim_hook is None or fair is None or self.mapped_bytes < fair:
            return False
        refused = time.monotonic() - max(self.ahead_refused_at, self.refused_at) < REFUSED_S
        told_none = room is not None and room < self.logical_page_bytes
        return self.cell.state is PoolState.ACTIVE and (refused or told_none)

    def reserve_mapped(self) -> bool:
        return self._has_free(self.reserve_blocks)

    def floor_mapped(self) -> bool:
        return self._has_free(self.ahead_blocks)

    def _has_free(self, num_blocks: int) -> bool:
        """At least ``num_blocks`` blocks free (or every block of the pool). O(1)."""
        return self.allocator.num_free >= min(num_blocks, self.allocator.num_blocks)

    def num_returnable(self, spare: list[int]) -> int:
        """How many of ``spare`` (spare pages) may go without leaving fewer than
        ``reserve_blocks`` free blocks; those past a known limit may go whatever the reserve
        (the daemon asks them back: the pool returns what it is asked, no more)."""
        extra = self.allocator.num_free - self.reserve_blocks
        allowed = max(extra // self.allocator.blocks_per_page, self.pages_over_limit())  # a limit binds
        return max(0, min(len(spare), allowed))

    @property
    def owed_pages(self) -> int:
        """Pages owed to the daemon: those an urgent reclaim asked for and did not get
        (``asked_pages``, until they lapse), or those mapped past the known limit, whichever is
        more. A limit's part follows the limit (a raised one owes nothing at once) and whatever
        maps the pages (a wake above a lowered limit owes the excess). O(1)."""
        return max(self.asked_pages, self.pages_over_limit())

    def _pages_within(self, max_bytes: int | None) -> int:
        """Whole logical pages ``max_bytes`` holds (more than any pool maps when unknown)."""
        return self.num_virtual_pages + 1 if max_bytes is None else max_bytes // self.logical_page_bytes

    def _max_pages(self, max_bytes: int | None) -> int:
        """Logical pages ``max_bytes`` lets be mapped: what it holds less the stuck pages this
        daemon counts. O(1)."""
        return self._pages_within(max_bytes) - self.num_stuck_counted()

    def pages_over_limit(self) -> int:
        """Logical pages mapped past the known limit (0 when within it or unknown)."""
        if self.max_bytes is None:
            return 0
        return max(0, -(-(self.mapped_bytes - self.max_bytes) // self.logical_page_bytes))

    def check_limit_debt(self, num_blocks: int) -> None:
        """``PoolExhausted`` when taking ``num_blocks`` of the free blocks would leave fewer than
        the pages mapped past the known limit hold: those stay free, to empty and go back
        (lock held). O(1)."""
        over = self.pages_over_limit()
        if not over:
            return
        allowed = self.allocator.num_free - over * self.allocator.blocks_per_page
        if num_blocks > allowed:
            raise PoolExhausted(
                f"pool {self.name!r} maps {over} logical page(s) past its limit of {self.max_bytes} bytes; "
                f"their blocks stay free until the pages go back, so {max(0, allowed)} of its "
                f"{self.allocator.num_free} free block(s) may be allocated now"
            )

    def headroom_pages(self) -> int:
        """Logical pages the known limit still allows (a large number when unknown)."""
        if self.max_bytes is None:
            return self.num_virtual_pages
        return max(0, self.max_bytes - self.mapped_bytes) // self.logical_page_bytes

    def map_grant(self, granted: Grant) -> None:
        """Map granted pages as spare ones (``map_or_give_back``; lock held): on a backend
        error those mapped stay spare, the rest go back, and the error is raised."""
        try:
            self.map_or_give_back(granted, "of a grant")
        finally:
            for lp in granted:
                if lp in self.segments.pages:
                    self.allocator.add_page(lp)

    def map_or_give_back(self, pages: Grant, why: str) -> None:
        """Map ``pages`` at their logical pages (lock held): runs at a time
        (``SegmentMap.map_many``), and after a refusal a page at a time in page order (logical
        page 0 first: mapped whenever another is), as far as it goes.

        From the first page the backend refuses (the OS's memory, its cap on mappings),
        that page's and the rest's handles are released and the daemon is told they are
        gone (``give_back``, retried until it confirms), then the error is raised. When a
        refused map's rollback was refused too, the pages some slot still maps are ``stuck``
        (neither released nor given back) and none of the others is mapped: a pool maps
        nothing more while any is stuck (``grow_for``). Either way the pool and the daemon
        count the same pages. O(pages)."""
        try:
            self.segments.map_many(pages)  # runs at a time; all or nothing
            return
        except BackendError as exc:
            if self.segments.stuck:
                self._give_back_unmapped(pages, list(pages), why, exc)
                raise
        lps = sorted(pages)
        for i, lp in enumerate(lps):
            try:
                self.segments.map(lp, pages[lp])
            except BackendError as exc:
                self._give_back_unmapped(pages, lps[i:], why, exc)
                raise

    def _give_back_unmapped(self, pages: Grant, lps: list[int], why: str, exc: BackendError) -> None:
        """Release and give back ``lps`` of ``pages`` (unmapped) but the stuck ones. O(lps)."""
        rest = [lp for lp in lps if lp not in self.segments.stuck]
        self.segments.release([page for lp in rest for page in pages[lp]])
        log.error("pool %s: %d of %d page(s) could not be mapped %s (%s); they go back to the daemon%s",
                  self.name, len(rest), len(pages), why, exc.message,
                  f", {len(lps) - len(rest)} stay mapped (stuck)" if len(rest) < len(lps) else "")
        self.stuck_changed()
        self.give_back(rest)

    def adopt_late_grants(self) -> None:
        """Map grants whose grow gave up waiting (they become spare pages), or give them back."""
        if not self.lease.outstanding_grows:
            return
        for grant in self.lease.late_grants():
            usable = self.cell.state is PoolState.ACTIVE and not (grant.keys() & self.segments.pages.keys())
            if usable:
                self.map_grant(grant)
                log.info("pool %s: adopted a late grant of %d page(s)", self.name, len(grant))
                continue
            for pages in grant.values():
                self.segments.release(pages)
            self.give_back(list(grant))

    # -- returning (lock held unless said) ---------------------------------------

    def has_excess(self) -> bool:
        """True when spare pages past the allowance (or owed ones) wait to be returned. O(1)."""
        spare = self.allocator.spare
        return bool(self.owed_pages and spare) or len(spare) > max(self.spare_allowance(), 0 in spare)

    def spare_allowance(self) -> int:
        """Spare pages the agent's tick leaves mapped: ``num_spare_pages``, or more to hold
        ``spare_blocks`` (or ``ahead_blocks``) blocks."""
        kept = max(self.spare_blocks, self.ahead_blocks)
        return max(self.num_spare_pages, -(-kept // self.allocator.blocks_per_page))

    def return_excess(self) -> int:
        """Give back spare pages past ``num_spare_pages`` (logical page 0, kept, counts
        among them) and owed ones; return how many went."""
        pinned = 0 in self.allocator.spare
        spare = self._spare_past_page_0()
        if pinned and list(self.segments.pages) == [0] and self.pages_over_limit():
            spare = [0]  # a limit under one logical page: even the pinned page goes, being the last
        owed = min(len(spare), self.owed_pages)
        num = min(max(len(spare) - max(0, self.spare_allowance() - pinned), owed), self.num_returnable(spare))
        if num <= 0:
            return 0
        self.asked_pages = max(0, self.asked_pages - num)
        self._return(spare[:num])
        return num

    def return_spare(self, num_pages: int) -> int:
        """Give back up to ``num_pages`` spare pages now (a reclaim, a limit's debt); they pay
        what the pool owes first. Takes the lock."""
        with self.lock:
            if self.cell.state is not PoolState.ACTIVE:
                return 0
            spare = self._spare_past_page_0()
            spare = spare[: min(num_pages, self.num_returnable(spare))]
            if spare:
                self._return(spare)
                self.asked_pages = max(0, self.asked_pages - len(spare))
            return len(spare)

    def _spare_past_page_0(self) -> list[int]:
        """Spare logical pages but page 0 (kept while any other page is mapped). O(pages)."""
        return [lp for lp in self.allocator.spare_pages() if lp != 0]

    def return_all_spare(self) -> int:
        """Give back every spare page but logical page 0 (lock held; before a warm sleep, so
        the daemon saves only pages with blocks). Returns how many went."""
        spare = self._spare_past_page_0()
        if spare:
            self._return(spare)
        return len(spare)

    def _return(self, lps: list[int]) -> None:
        for lp in lps:
            self.allocator.remove_page(lp)
        try:
            self.segments.drop_pages(lps)
        except BackendError:  # nothing was unmapped (``unmap_pages`` maps its runs back): spare again
            for lp in lps:
                self.allocator.add_page(lp)
            raise
        self.give_back(lps)

    def give_back(self, lps: list[int]) -> None:
        """Tell the daemon about pages no longer mapped here (retried until it confirms)."""
        self.pending_return.update(lps)
        with contextlib.suppress(DaemonUnreachable):
            self.retry_returns()

    def retry_returns(self) -> None:
        """Send the page returns the daemon has not confirmed yet."""
        if not self.pending_return or self.lease.lost.is_set():
            return
        pending = sorted(self.pending_return)
        for start in range(0, len(pending), MAX_GROW_PAGES):  # each request fits in one frame
            lps = pending[start:start + MAX_GROW_PAGES]
            try:
                with self.lock.open_gate():  # the pages are out of the allocator and unmapped
                    self.lease.shrink(lps)
            except BadRequest:
                log.info("pool %s: pages %s were already given back", self.name, lps[:8])
            self.pending_return.difference_update(lps)

    def free_stuck(self, give_back: bool = True) -> bool:
        """Unmap what failed maps left ``stuck``, release those pages and (``give_back``) give
        the daemon's back (lock held); True when none is left stuck. O(stuck pages); nothing to
        do, the common case, O(1)."""
        freed = self.segments.unmap_stuck() if self.segments.stuck else {}
        if freed:
            try:
                self.segments.release([page for pages in freed.values() for page in pages])
            except BackendError as exc:  # a handle kept here maps nowhere: the daemon may have them all back
                log.error("pool %s: releasing pages a failed map had left mapped: %s", self.name, exc.message)
            ours = [lp for lp in freed if lp not in self.old_stuck]
            self.old_stuck.difference_update(freed)
            self.stuck_changed()
            if give_back:
                self.give_back(ours)
        return not self.segments.stuck

    def drop_all_pages(self) -> None:
        """Unmap every page here (without telling the daemon) and empty the allocator. Pages left
        ``stuck`` that still cannot be unmapped stay so (logged): their slots keep them."""
        self.segments.drop_pages(self.segments.pages)
        if not self.free_stuck(give_back=False):
            log.error("pool %s: %d logical page(s) a failed map left mapped could not be unmapped",
                      self.name, len(self.segments.stuck))
        self.segments.release_hold()  # a warm sleeper's: nothing of it is mapped back now
        self.allocator = self.new_allocator()
        self.sleeping_allocator = None

    def set_limit(self, limit: dict[str, Any], fresh: bool = False, lease: Lease | None = None) -> bool:
        """Record the limits the daemon told us (register reply, ``set_limit`` reply, ``limit``
        notice) unless they are older than the ones known (a reply and its notice race: the
        first applies, the second changes nothing); ``fresh``: a new daemon's, whose revisions
        start again; ``lease``: told on that lease, ignored once the pool holds another (a
        dead daemon's word). Yields whether they applied. Takes only ``limit_lock`` (a leaf):
        never waits for a grow under way. O(1)."""
        revision = limit_revision(limit)
        with self.limit_lock:
            if (lease is not None and lease is not self.lease) or (not fresh and revision < self.limit_revision):
                return False
            max_bytes = limit.get("max_bytes")
            if isinstance(max_bytes, int):
                self.max_bytes, self.max_pages = max_bytes, self._max_pages(max_bytes)
            self.limit_revision = revision
            return True
