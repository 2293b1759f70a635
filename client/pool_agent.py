"""``PoolAgent``: the thread that answers the daemon for a pool, whether its engine is busy or idle.

The lease's reader thread hands it parsed notices (``listen``: the handler
only queues and wakes it, it never blocks). The agent handles them in order,
each only while its lease is still the pool's (one read on a dead daemon's
lease before the pool moved to the next daemon is dropped), holding the
pool's lock only as long as each answer takes:

- ``reclaim`` N: returns up to N spare pages, then asks the engine's
  ``reclaim_hook`` to evict cache-only blocks and returns the pages that
  emptied; what is still short of an urgent ask is *owed* and goes back as
  blocks are freed (the engine admits no new request into owed pages). What is
  still unpaid lapses at the agent's first wake-up more than ``OWED_S`` (1 s,
  the daemon's ``STARVED_S``) after the last urgent ask, down to the pages
  mapped past a known limit: the daemon asks a parked grow's victims again
  more often than that, and a requester refused again asks again, so only a
  debt nobody waits for lapses. An ask read after its ``expires_at`` (the
  daemon's clock, placed beside ours by each quick heartbeat) is let go: the
  process was stopped or starved meanwhile, and the daemon no longer waits on it;
- ``free``: pages a refused grow wanted are free again: the back-off ends, the
  engine's own grows may ask at once, and the reserve is probed now (a pool that
  recycles its cache leaves that to its engine's next allocation);
- ``sleep`` / ``wake``: see ``pool_sleep``; ``limit``: the pool's known limit
  (pages mapped past a lowered one are owed, as an urgent reclaim's, and go back,
  cache-only ones too: ``pool_returns``, on every wake-up while over it; the
  notice is the daemon's only ask for them, so they are paid once);
- ``revoked``: every page is unmapped here and the pool ends (``REVOKED``);
- ``shutdown``: logged; the lease's end follows.

Then, on every wake-up (a notice, ``nudge()`` from ``free`` or ``keep_free``,
or each ``HEARTBEAT_S``): adopts late grants, grows ahead to the engine's
reserve, then its floor (``PoolCore.grow_reserve``, ``grow_floor``; each
refused while the daemon has nothing free for it, then tried again after
``GROW_RETRY_S``, by when other tenants were asked for pages, and each time
twice as late up to ``GROW_RETRY_MAX_S``; the reserve at once on a ``free``
notice, and a refused floor never holds the reserve back; while the daemon
has no memory to spare for the floor, the engine's own cache-only blocks are
evicted for it while the engine works (unless the pool recycles, below), so
its allocations still find blocks without a round trip; a pool holding its fair share, told in every heartbeat
reply, evicts them for its reserve before it asks at all while the daemon has
nothing to spare, asks for no reserve the cache cannot cover (its engine's allocation does,
when it needs the blocks), and keeps no floor beside its cache (its engine's allocations
take their own cached blocks first, ``KVPool.scarce_free_blocks``), so tenants
whose caches fill the device keep what they hold instead of passing pages back
and forth), returns
excess spare pages, retries unconfirmed returns, and tells the daemon
``used_bytes``, whether the pool can be quiesced, whether the engine
stepped and how many grows the pool refused itself past its limit (the daemon
counts them with its own refusals), when they changed (used bytes and activity at most every ``REPORT_MIN_S``:
a busy engine changes them every step), and at least every ``IDLE_HEARTBEAT_S`` (5 s)
when nothing did, so the daemon can tell a silent (stopped, hung) process from an idle
one. When the daemon is gone it keeps the pool serving from its mappings
(``DETACHED``) and re-registers with the next daemon (``pool_reconnect``).

An exception in a user hook or a failed request is logged and the agent goes
on: it never dies silently. Cost: nothing on the engine's hot path.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from kvdaemon.client.lease import Lease
from kvdaemon.client.pool_core import PoolCore
from kvdaemon.client.pool_reconnect import Unjoinable, try_reconnect
from kvdaemon.client.pool_returns import free_orphans, pay_limit_debt, return_spare, returning
from kvdaemon.client.pool_sleep import sleep_pool, wake_pool
from kvdaemon.client.pool_state import PoolState
from kvdaemon.errors import KVDaemonError
from kvdaemon.wire.messages import (
    FreeNotice, LimitNotice, Notice, ReclaimNotice, RevokedNotice, ShutdownNotice, SleepCancelledNotice,
    SleepNotice, WakeNotice,
)

log = logging.getLogger("kvdaemon.client.pool")
HEARTBEAT_S = 1.0
OWED_S = 1.0  # an urgent ask's debt lapses this long after the last one (the daemon's STARVED_S)
REPORT_MIN_S = HEARTBEAT_S  # changed figures (used bytes, activity) are told at most this often
CLOCK_TRIP_S = 0.05  # a heartbeat slower than this does not place the daemon's clock (``_note_daemon_clock``)
IDLE_HEARTBEAT_S = 5.0  # told at least this often, changed or not: the daemon's sign of life (``silent_seconds``)
GROW_RETRY_S = 0.02  # a refused grow-ahead is tried again this soon, then twice as late each time
GROW_RETRY_MAX_S = 1.0  # ... up to this (a ``free`` notice ends the wait sooner)


class Backoff:
    """When a refused grow-ahead may be tried again: ``GROW_RETRY_S`` after the first
    refusal, twice as late after each next one up to ``GROW_RETRY_MAX_S``. O(1)."""

    def __init__(self) -> None:
        self.retry_s = GROW_RETRY_S  # the wait after the next refusal
        self.at = 0.0  # no try before this (time.monotonic)

    def due(self, now: float) -> bool:
        return now >= self.at

    def note(self, granted: bool, now: float) -> None:
        if granted:
            self.reset()
        else:
            self.at = now + self.retry_s
            self.retry_s = min(GROW_RETRY_MAX_S, 2 * self.retry_s)

    def reset(self) -> None:
        self.retry_s, self.at = GROW_RETRY_S, 0.0


class PoolAgent:
    """Background answers to the daemon for one pool (see the module docstring)."""

    def __init__(self, core: PoolCore, relink: Callable[[], Lease] | None) -> None:
        self.core = core
        self.relink = relink
        self.unjoinable = Unjoinable()  # the daemon that refused the pool for good (``pool_reconnect``)
        self._inbox: list[tuple[Lease, Notice]] = []  # each with the lease it came on
        self._inbox_lock = threading.Lock()  # a leaf: held only to append or swap the list
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._reported: tuple[int, bool] | None = None  # (used bytes, sleepable) last told
        self._refusals_told = 0  # of the pool's own refusals past its limit (``num_limit_refusals``)
        self.reserve_backoff = Backoff()  # after refused grows toward the reserve, however often woken
        self.floor_backoff = Backoff()  # after refused grows toward the floor ahead of need
        self._floor_refused = False  # the daemon just refused the floor: evict the cache for it, once
        self._report_at = 0.0  # no heartbeat before this, unless a whole HEARTBEAT_S passed
        self._active = False  # the engine stepped since the last heartbeat
        self._active_at = float("-inf")  # when the agent last saw the engine step
        self.daemon_clock_offset_s: float | None = None  # the daemon's clock minus ours (``_note_daemon_clock``)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"kvpool-{self.core.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10)

    def listen(self, lease: Lease) -> None:
        """Have ``lease``'s notices queued here (on its reader thread: never blocks)."""
        def queue(notice: Notice) -> None:
            with self._inbox_lock:
                self._inbox.append((lease, notice))
            self._wake.set()

        lease.on_notice = queue

    def nudge(self) -> None:
        """Wake the agent now (spare pages to return, a hook changed)."""
        self._wake.set()

    def grow_due(self, floor: bool = False) -> bool:
        """Whether a grow toward the reserve (``floor``: toward the floor) may be tried now: not
        while backing off after a refusal (the agent wakes by itself when the wait ends; a nudge
        before would only steal the engine's cores). O(1), no lock."""
        return (self.floor_backoff if floor else self.reserve_backoff).due(time.monotonic())

    def _loop(self) -> None:
        while not self._stopping:
            self._wake.wait(self._wait_s())
            self._wake.clear()
            with self._inbox_lock:
                notices, self._inbox = self._inbox, []
            for lease, notice in notices:
                if self._stopping:
                    return
                if lease is not self.core.lease:  # a dead daemon's, or a move's that failed
                    log.info("pool %s: dropped a %s notice of a lease it no longer holds", self.core.name, notice.kind)
                    continue
                self._guarded(self._handle, notice)
            if not self._stopping and self.core.orphaned:
                self._guarded(free_orphans, self.core)
            if not self._stopping:
                self._guarded(pay_limit_debt, self.core)
            if not self._stopping and self.core.recycles():  # before any grow: no round trip for these
                self._guarded(self._blocks_from_cache, self.core.reserve_blocks)
            if not self._stopping:
                self._guarded(self._housekeep)
            if not self._stopping and self._floor_refused:
                self._guarded(self._blocks_from_cache, max(self.core.reserve_blocks, self.core.ahead_blocks))

    def _wait_s(self) -> float:
        """Until the next heartbeat, or the next grow-ahead try or held-back report when one is
        due sooner (one overdue was not made: the pool is not active, and the agent waits a
        heartbeat)."""
        now = time.monotonic()
        wait_s = HEARTBEAT_S
        dues = (self.reserve_backoff.at - now, self.floor_backoff.at - now,
                self._report_at - now if self._report_pending() else 0.0)
        for due_s in dues:
            if 0.0 < due_s < wait_s:
                wait_s = due_s
        return wait_s

    def _report(self) -> tuple[int, bool]:
        core = self.core
        return core.allocator.num_live * core.spec.block_bytes * core.spec.num_segments, core.quiesce_hook is not None

    def _report_pending(self) -> bool:
        return (self._active or self.core.active or self._report() != self._reported
                or self.core.num_limit_refusals != self._refusals_told)

    def _guarded(self, step: Callable[..., None], *args: object) -> None:
        try:
            step(*args)
        except KVDaemonError as exc:
            log.warning("pool %s: daemon request failed: %s", self.core.name, exc)
        except Exception:  # a user hook or a bug: log it and keep answering the daemon
            log.exception("pool %s: the agent's step failed; it carries on", self.core.name)

    def _handle(self, notice: Notice) -> None:
        core = self.core
        if core.state.ended:
            return
        if isinstance(notice, ReclaimNotice):
            if not self._expired(notice):
                self._reclaim(notice.num_pages, notice.urgent)
        elif isinstance(notice, FreeNotice):
            with core.lock:
                core.refused_at = float("-inf")
            self.reserve_backoff.reset()
        elif isinstance(notice, SleepNotice):
            sleep_pool(core, notice)
        elif isinstance(notice, WakeNotice):
            wake_pool(core, notice)
        elif isinstance(notice, LimitNotice):
            core.set_limit({"max_bytes": notice.max_bytes, "revision": notice.revision})  # pages past it are owed
        elif isinstance(notice, RevokedNotice):
            self._revoke(notice.why)
        elif isinstance(notice, SleepCancelledNotice):
            log.info("pool %s: the daemon cancelled sleep %d", core.name, notice.sleep_id)
        elif isinstance(notice, ShutdownNotice):
            log.info("pool %s: the daemon is stopping; serving from the pages mapped", core.name)

    def _expired(self, notice: ReclaimNotice) -> bool:
        """True (logged) for an ask read after its ``expires_at``, by the daemon's clock as the
        last quick heartbeat placed it beside ours: nobody waits on it (the process was stopped
        or starved meanwhile), and shedding pages for it would only cost cache. Unknown (no
        stamp, no heartbeat yet): False. O(1)."""
        offset_s = self.daemon_clock_offset_s
        if notice.expires_at is None or offset_s is None:
            return False
        late_s = time.monotonic() + offset_s - notice.expires_at
        if late_s <= 0:
            return False
        log.info("pool %s: let go of a reclaim ask of %d page(s) read %.1f s after it lapsed",
                 self.core.name, notice.num_pages, late_s)
        return True

    def _reclaim(self, wanted: int, urgent: bool) -> None:
        core = self.core
        returned = return_spare(core, wanted)
        hook = core.reclaim_hook
        if returned < wanted and hook is not None:
            hook((wanted - returned) * core.allocator.blocks_per_page)  # cache-only pages next
            returned += return_spare(core, wanted - returned)
        if returned < wanted and urgent:
            with core.lock:  # the rest go back as their blocks are freed
                core.asked_pages = max(core.asked_pages, wanted - returned)
                core.asked_at = time.monotonic()
        log.info("pool %s: returned %d of %d page(s) on request", core.name, returned, wanted)

    def _revoke(self, why: str) -> None:
        core = self.core
        log.error("pool %s: the daemon revoked its lease (%s); every page is unmapped", core.name, why)
        with core.lock:
            core.drop_all_pages()
            core.cell.move(PoolState.REVOKED)

    def _housekeep(self) -> None:
        core = self.core
        if core.state.ended:
            return
        if core.lease.lost.is_set() and not self._detached():
            return  # else re-joined: it tells the new daemon at once what it holds and whether it can sleep
        with core.lock:
            if core.state is PoolState.ACTIVE:
                core.adopt_late_grants()
                if core.asked_pages and time.monotonic() - core.asked_at > OWED_S:
                    core.asked_pages = 0  # a limit's debt stays (``owed_pages``)
                self._grow_ahead()
        with returning(core) as may_return, core.lock:  # not held over the grows: they wait on the daemon
            if may_return and core.state is PoolState.ACTIVE:
                core.return_excess()
            core.retry_returns()
            report = self._report()
        now = time.monotonic()
        if core.active:
            self._active_at = now
        self._active, core.active = self._active or core.active, False
        urgent = self._reported is None or report[1] != self._reported[1]  # sleepable: told at once
        refused = core.num_limit_refusals - self._refusals_told
        due = now >= self._report_at and (report != self._reported or self._active or refused
                                          or now - self._report_at >= IDLE_HEARTBEAT_S - REPORT_MIN_S)
        if urgent or due:
            sent_at = time.monotonic()
            reply = core.lease.heartbeat(used_bytes=report[0], sleepable=report[1], active=self._active,
                                         num_refused=refused)  # fmt: skip
            self._note_daemon_clock(reply.get("now"), sent_at, time.monotonic())
            self._refusals_told += refused
            core.fair_bytes, core.ahead_room_bytes = (
                value if type(value) is int and value >= 0 else None
                for value in (reply.get("fair_bytes"), reply.get("ahead_bytes")))
            self._reported, self._active, self._report_at = report, False, now + REPORT_MIN_S

    def _note_daemon_clock(self, daemon_now: object, sent_at: float, replied_at: float) -> None:
        """Place the daemon's clock beside ours from one heartbeat: its reading against the
        midpoint of the round trip, kept only when the trip took under ``CLOCK_TRIP_S`` (the
        error is at most half of it). Both are ``CLOCK_MONOTONIC`` on one machine, so the offset
        holds until the next daemon (zero, unless the two sit in different time namespaces)."""
        if type(daemon_now) is float and math.isfinite(daemon_now) and replied_at - sent_at < CLOCK_TRIP_S:
            self.daemon_clock_offset_s = daemon_now - (sent_at + replied_at) / 2

    def _grow_ahead(self) -> None:
        """The reserve, then (once it is mapped) the floor, each unless backing off (lock held);
        a refusal backs off, whatever wakes the agent meanwhile (``keep_free``, most notices).
        Neither while the pool recycles its cache (``PoolCore.recycles``: the daemon has
        nothing to spare, as its last heartbeat reply or a refusal said): the reserve came
        from the cache first, and what the cache cannot cover the engine's own allocation
        asks for when it needs it (a grow here would be refused, and would have the daemon
        ask the other tenants, busy as this one, for pages at every back-off's end). A floor found mapped
        asks nothing and leaves the back-off as it is: only a grant ends it, so a floor that
        dips at every step of a busy engine asks a daemon short of memory at most as often as
        the back-off allows."""
        core, now = self.core, time.monotonic()
        recycles = core.recycles()
        if self.reserve_backoff.due(now) and not recycles:
            self.reserve_backoff.note(core.grow_reserve(), now)
        wants_floor = core.reserve_mapped() and not core.floor_mapped()
        if wants_floor and self.floor_backoff.due(now) and not recycles:
            granted = core.grow_floor()
            self.floor_backoff.note(granted, now)
            self._floor_refused = not granted

    def _blocks_from_cache(self, wanted: int) -> None:
        """Evict the engine's cache-only blocks (its reclaim hook, without the lock: the hook
        takes the engine's locks) until ``wanted`` blocks are free, as far as the cache
        allows: the reserve before the grows while the pool recycles (``PoolCore.recycles``:
        it holds its fair share and the daemon has nothing to spare; its floor stays cached,
        since the engine's allocations then evict their own cached blocks first, without a
        round trip), and the floor after a refused floor grow (once per refusal, so at most
        as often as the floor's back-off allows). Only while the engine works (it stepped
        within ``HEARTBEAT_S``): an idle engine's cache stays, and its next allocation
        evicts what it needs (``BlockManager``). Cost: one hook call, O(blocks evicted)."""
        self._floor_refused = False
        core, hook = self.core, self.core.reclaim_hook
        missing = min(wanted, core.allocator.num_blocks) - core.allocator.num_free
        working = core.active or time.monotonic() - self._active_at < HEARTBEAT_S
        if hook is not None and missing > 0 and working and core.state is PoolState.ACTIVE:
            hook(missing)

    def _detached(self) -> bool:
        """The daemon is gone: keep serving what is mapped; move to a new daemon once one answers
        (True once it has)."""
        core = self.core
        with core.lock:
            if core.state is PoolState.ACTIVE:
                core.cell.move(PoolState.DETACHED)
                log.warning("pool %s: its daemon is gone; serving from the pages mapped", core.name)
        if self.relink is not None and try_reconnect(core, self.relink, self.listen, self.unjoinable):
            self._reported = None  # tell the new daemon what we hold and whether we can sleep
            self.daemon_clock_offset_s = None  # the new daemon's clock is placed at its first heartbeat
            return True
        return False
