"""``PoolAgent``: the thread that answers the daemon for a pool while the engine is busy or idle.

The lease's reader thread hands it notices (``on_notice`` never blocks: it
records and wakes the agent). The agent then, holding the pool's lock only as
long as each answer takes:

- ``reclaim`` N: returns up to N spare pages (pages with live blocks stay);
- ``revoked``: the daemon took the lease back, so every page is unmapped here
  and later allocations fail instead of touching memory now owned by others;
- every ``HEARTBEAT_S``: retries page returns the daemon has not confirmed and
  reports ``used_bytes`` when it changed.

Cost: one wake-up per notice or heartbeat; nothing on the engine's hot path.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from kvdaemon.client.pool_reconnect import try_reconnect
from kvdaemon.client.pool_sleep import sleep_pool, wake_pool
from kvdaemon.errors import KVDaemonError

if TYPE_CHECKING:
    from kvdaemon.client.pool import KVPool

log = logging.getLogger("kvdaemon.client.pool")
HEARTBEAT_S = 1.0


class PoolAgent:
    """Background answers to the daemon for one ``KVPool``."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.revoked = False
        self._reclaim_pages = 0
        self._revoke_pending = False
        self._sleeps: list[tuple[str, dict[str, Any]]] = []  # sleep/wake notices, in order
        self._notice_lock = threading.Lock()  # guards the two fields above; never held long
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._reported_used = -1

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._loop, name=f"kvpool-{self.pool.name}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)

    def on_notice(self, body: dict[str, Any]) -> None:
        """Called on the lease's reader thread: record the request and wake the agent."""
        kind, args = body.get("notice"), body.get("args")
        with self._notice_lock:
            if kind == "reclaim" and isinstance(args, dict):
                num_pages = args.get("num_pages")
                if isinstance(num_pages, int) and num_pages > 0:
                    self._reclaim_pages = max(self._reclaim_pages, num_pages)
            elif kind == "revoked":
                self._revoke_pending = True
            elif kind in ("sleep", "wake") and isinstance(args, dict):
                self._sleeps.append((kind, args))
        self._wake.set()

    def _loop(self) -> None:
        while not self._stopping:
            self._wake.wait(HEARTBEAT_S)
            self._wake.clear()
            if self._stopping:
                return
            with self._notice_lock:
                wanted, self._reclaim_pages = self._reclaim_pages, 0
                revoke, self._revoke_pending = self._revoke_pending, False
                sleeps, self._sleeps = self._sleeps, []
            if revoke:
                self._revoke()
                return
            if self.pool.lease.lost.is_set():
                # The daemon is gone: keep serving from what is mapped, and move
                # to a new daemon as soon as one answers on the same directory.
                try_reconnect(self.pool)
                continue
            try:
                self._sleep_or_wake(sleeps)
                self._answer(wanted)
            except KVDaemonError as exc:
                log.warning("pool %s: daemon request failed: %s", self.pool.name, exc)

    def _sleep_or_wake(self, sleeps: list[tuple[str, dict[str, Any]]]) -> None:
        for kind, args in sleeps:
            mode = str(args.get("mode"))
            if kind == "sleep":
                sleep_pool(self.pool, mode, int(args.get("sleep_id", 0)))
            else:
                wake_pool(self.pool, mode, int(args.get("grant_id", 0)), list(args.get("pages", [])))

    def _answer(self, wanted: int) -> None:
        if wanted:
            num_returned = self.pool.return_spare(wanted)
            hook = self.pool.reclaim_hook
            if num_returned < wanted and hook is not None:
                # Cache-only pages next: evicting unreferenced cached blocks empties pages.
                hook((wanted - num_returned) * self.pool.blocks_per_page)
                num_returned += self.pool.return_spare(wanted - num_returned)
            if num_returned < wanted:
                with self.pool.lock:  # the rest go back as their blocks are freed
                    self.pool.owed_pages = max(self.pool.owed_pages, wanted - num_returned)
            log.info("pool %s: returned %d page(s) on request", self.pool.name, num_returned)
        with self.pool.lock:
            self.pool.retry_returns()
        used = self.pool.used_bytes
        if used != self._reported_used:
            self.pool.lease.heartbeat(used_bytes=used)
            self._reported_used = used

    def _revoke(self) -> None:
        log.error("pool %s: the daemon revoked its lease; every page is unmapped", self.pool.name)
        with self.pool.lock:
            self.revoked = True
            self.pool.drop_all_pages()
