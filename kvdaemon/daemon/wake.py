"""Wake of sleeping tenants: fresh pages at the same logical pages, their bytes copied back (warm).

``wake`` takes fresh pages for a warm sleeper's logical pages, copies its
saved bytes in, then sends the pages and a ``wake`` notice naming the grant; a
cold sleeper wakes with no pages. Its virtual addresses never changed, so block
tables stay valid (warm). Waking an awake tenant answers with its state
(``already``); waking one whose sleep is pending cancels that sleep.

A copy back of more than one slice runs a slice at a time between the loop's
other work (``kvdaemon.daemon.copies``): the tenant is ``waking`` meanwhile
(still asleep to everyone, holding the pages the copy fills), the pages go to
it only once their bytes are in, a second wake joins the first, a sleep is
refused (``Sleeper.begin``), and a tenant removed mid-copy has its copy stopped
(``forget``) before its pages go. A copy that fails gives the pages back and
leaves the tenant asleep with its host copy.

Cost: one host copy of every page (warm); O(pages) otherwise.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from kvdaemon.cuda_vmm.backend import PhysicalPage
from kvdaemon.daemon import swap
from kvdaemon.daemon.copies import run_through
from kvdaemon.daemon.ports import notify
from kvdaemon.daemon.reply import PendingReply
from kvdaemon.daemon.sleep import Sleeper, park
from kvdaemon.daemon.tenant import PendingWake, Tenant, TenantState
from kvdaemon.errors import BackendError, Conflict, KVDaemonError
from kvdaemon.wire.messages import WakeNotice
from kvdaemon.wire.sizes import format_bytes

log = logging.getLogger("kvdaemon.sleep")


class Waker:
    """Wakes over a ``Sleeper``'s grants, backend, copies and warm copies (module docstring)."""

    def __init__(self, sleeper: Sleeper) -> None:
        self.sleeper = sleeper
        self.num_wakes = 0

    def wake(
        self, tenant: Tenant, now: float, why: str = "woken by an admin", waiter: PendingReply | None = None,
    ) -> dict[str, Any] | None:
        """Give a sleeping tenant pages again (bytes restored when warm) and tell it; ``why``
        says who asked, for the log. An active tenant's pending sleep is cancelled (the later
        word wins; ``cancelled_sleep`` in the result); one with none: ``already``. ``None``
        while a sliced copy back runs: ``waiter`` is answered at its end (a wake meanwhile
        joins it). ``NoMemory`` (nothing taken) when the pool is short."""
        mode = tenant.state.mode
        if mode is None:
            pending = tenant.pending_sleep
            if pending is None:
                return {"state": tenant.state.value, "mapped_bytes": tenant.mapped_bytes, "already": True}
            self.sleeper.cancel(tenant, pending, f"{why} before it slept")  # the later word: nothing was freed
            return {"state": tenant.state.value, "mapped_bytes": tenant.mapped_bytes, "cancelled_sleep": True}
        if tenant.waking is not None:
            park(tenant.waking.waiters, waiter, f"tenant {tenant.name!r} is {tenant.copying}")
            return None
        warm = tenant.warm
        if warm is None:
            return self._woken(tenant, mode, [], why)
        pages = self.sleeper.grants.take(tenant, warm.logical_pages, now, overwrite=True)
        steps = swap.restore(self.sleeper.backend, warm, tenant.logical)
        if tenant.mapped_bytes <= self.sleeper.backend.copy_slice_bytes or waiter is None:
            try:
                run_through(steps)
            except (BackendError, OSError) as exc:
                raise self._restore_failed(tenant, [], exc) from exc
            return self._woken(tenant, mode, pages, why)
        waiters = [waiter]
        job = self.sleeper.copies.start(
            steps, lambda _: self._wake_done(tenant, mode, pages, why),
            lambda exc: self._restore_failed(tenant, waiters, exc),
        )
        tenant.waking = PendingWake(job, waiters, why)
        return None

    def _wake_done(self, tenant: Tenant, mode: str, pages: list[PhysicalPage], why: str) -> None:
        """The end of a sliced copy back: ``_woken``, whose failure has told the waiters."""
        with contextlib.suppress(BackendError):
            self._woken(tenant, mode, pages, why)

    def _woken(self, tenant: Tenant, mode: str, pages: list[PhysicalPage], why: str) -> dict[str, Any]:
        """Send the pages (their bytes in), make the tenant active, tell it, answer the waiters."""
        waking, tenant.waking = tenant.waking, None
        waiters = [] if waking is None else waking.waiters
        grant: dict[str, Any] = {"grant_id": 0, "pages": []}
        if tenant.warm is not None:
            try:
                grant = self.sleeper.grants.send(tenant, tenant.warm.logical_pages, pages)
            except (BackendError, OSError) as exc:
                raise self._restore_failed(tenant, waiters, exc) from exc
            self.sleeper.drop_warm(tenant)
        tenant.state = TenantState.ACTIVE
        self.sleeper.tenants.changed()
        tenant.note_engine_active(self.sleeper.clock())
        self.num_wakes += 1
        lps = [lp for lp, _ in grant["pages"]]
        for notice in WakeNotice.parts(mode, grant["grant_id"], lps):
            notify(self.sleeper.leases, tenant.tenant_id, notice)
        log.info("tenant %s is active (%s; was sleeping-%s): %s restored", tenant.name, why, mode,
                 format_bytes(tenant.mapped_bytes))  # fmt: skip
        result = {"state": tenant.state.value, "mapped_bytes": tenant.mapped_bytes}
        for reply in waiters:
            reply.ok(result)
        return result

    def _restore_failed(self, tenant: Tenant, waiters: list[PendingReply], exc: Exception) -> BackendError:
        """A copy back (or its grant) failed: the pages taken go back, the tenant sleeps on
        warm with its host copy, the waiters are told. Returns the error."""
        tenant.waking = None
        self.sleeper.grants.release_all(tenant)  # a sleeper holds only what its wake took
        error = BackendError(f"tenant {tenant.name!r} stays asleep (warm, its KV kept in host memory): "
                             f"its KV could not be copied back ({exc})")
        log.error("%s", error.message)
        for reply in waiters:
            reply.fail(error)
        return error

    def wake_pages(self, tenant: Tenant) -> int:
        """Logical pages a wake of ``tenant`` maps (its warm copy's; 0 for a cold sleeper)."""
        return 0 if tenant.warm is None else len(tenant.warm.logical_pages)

    def forget(self, tenant: Tenant, why: KVDaemonError | None = None) -> int:
        """Stop a removed tenant's copy back and free the pages it was filling (never sent:
        nobody maps them), and tell its waiters ``why`` (default: the tenant went away).
        Returns the physical pages freed."""
        waking, tenant.waking = tenant.waking, None
        if waking is None:
            return 0
        waking.job.cancel()
        num_freed = self.sleeper.grants.release_all(tenant)  # a sleeper holds only what its wake took
        for reply in waking.waiters:
            reply.fail(why or Conflict(f"tenant {tenant.name!r} went away while waking"))
        return num_freed

    def stats(self) -> dict[str, int]:
        return {"wakes": self.num_wakes}
