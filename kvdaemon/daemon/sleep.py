"""Sleep of tenants: warm (bytes kept in host memory) or cold (dropped).

A sleep is a three-step exchange, so that nothing is freed under a busy engine
and both sides always end in the same state:

1. ``begin``: the daemon sends the tenant a ``sleep`` notice and parks the
   caller's reply (the CLI or another client) until step 2 or a deadline;
2. the tenant finishes its step, unmaps its pages (keeping its virtual ranges
   and handles) and calls ``sleep_ready``. ``finish`` is the decision: it
   copies the pages to host memory (warm), frees them, and answers both the
   tenant and the caller. The tenant waits for that answer however long the
   copy takes (a timeout on its side is not a decision), and a retried
   ``sleep_ready`` gets the same answer again;
3. a tenant that cannot be quiesced (no quiesce hook) answers
   ``sleep_ready(refused)``: the caller gets ``CONFLICT``, nothing changes;
4. if the tenant does not answer before the deadline, ``expire`` answers the
   caller with ``CONFLICT`` and tells the tenant ``sleep_cancelled``; a late
   ``sleep_ready`` is refused, so the tenant maps its pages back. Only the
   daemon decides; the tenant acts on the decision.

A warm sleeper's pages stay idle in the pool for ``IDLE_KEEP_S`` (where the
backend gains from it, ``DevicePages``): a wake soon after writes its bytes
back into memory that is already there instead of into memory the OS must
fault in; anyone else's grant gets them zeroed.

Sleeping a sleeper again answers with its state (``already``); ``cold``
converts a warm sleeper. The wake is ``kvdaemon.daemon.wake``.

A copy of more than one slice (the backend's ``copy_slice_bytes``) runs a
slice at a time between the loop's other work (``kvdaemon.daemon.copies``);
its callers are answered when it ends. Meanwhile the tenant's pages stay put
(no shrink), a wake of a tenant being saved cancels the sleep (the copy stops,
nothing was freed; its ``sleep_ready`` is answered ``CONFLICT`` and it maps its
pages back), a sleep of a waking tenant is refused, and a tenant removed
mid-copy has its copy stopped before its pages go.

Cost: one host copy of every page each way (warm); O(pages) otherwise.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

from kvdaemon.cuda_vmm.backend import Backend
from kvdaemon.daemon import swap
from kvdaemon.daemon.copies import Copies, Steps, run_through
from kvdaemon.daemon.grants import Grants
from kvdaemon.daemon.ports import LeasePort, notify
from kvdaemon.daemon.reply import PendingReply
from kvdaemon.daemon.tenant import PendingSleep, Tenant, Tenants, TenantState
from kvdaemon.errors import BackendError, Conflict, KVDaemonError, NoMemory
from kvdaemon.wire.messages import SleepCancelledNotice, SleepNotice
from kvdaemon.wire.sizes import format_bytes

log = logging.getLogger("kvdaemon.sleep")
MAX_CACHED_BUFFER_BYTES = 2 << 30  # host memory kept for the next warm sleep, at most
IDLE_KEEP_S = 30.0  # a warm sleeper's freed pages stay backed this long (host backend)
MAX_ANSWERS = 16  # calls parked on one copy's end per tenant (retried sleep_readys, more wakes)


class Sleeper:
    """Sleep and wake over the grants and the tenants' leases (see the module docstring)."""

    def __init__(
        self, tenants: Tenants, grants: Grants, backend: Backend, leases: LeasePort, timeout_s: float,
        clock: Callable[[], float] = time.monotonic, max_host_bytes: int | None = None,
    ) -> None:
        self.tenants = tenants
        self.grants = grants
        self.clock = clock
        self.copies = Copies()
        self.backend = backend
        self.leases = leases
        self.timeout_s = timeout_s
        self.max_host_bytes = max_host_bytes  # what warm sleepers' KV may take (None: no bound)
        self._ids = itertools.count(1)
        self.num_sleeps = 0
        self.num_victims_slept = 0  # the sleeps above that reclaim asked for (done, not only asked)
        self.buffers = swap.BufferCache(
            min(grants.pages.capacity_bytes, MAX_CACHED_BUFFER_BYTES,
                MAX_CACHED_BUFFER_BYTES if max_host_bytes is None else max_host_bytes),
            backend, clock,
        )

    def begin(
        self, tenant: Tenant, mode: str, waiter: PendingReply | None, now: float,
        by_owner: bool = False, why: str = "asked by an admin", victim: bool = False,
    ) -> dict[str, Any] | None:
        """Ask ``tenant`` to quiesce; ``waiter`` is answered by ``finish`` or ``expire``.

        Returns a result at once (and leaves ``waiter`` alone) when nothing is
        to be done: the tenant already sleeps, or a cold sleep dropped a warm
        sleeper's copy. ``waiter`` is ``None`` for the daemon's own sleeps;
        ``why`` says who asked, for the log; ``victim``: reclaim asked it (counted once done).
        """
        if tenant.waking is not None:
            raise Conflict(f"tenant {tenant.name!r} is {tenant.copying}: put it to sleep once it is awake")
        if tenant.state is not TenantState.ACTIVE:
            return self._sleep_again(tenant, mode, why)
        if tenant.pending_sleep is not None:
            raise Conflict(f"tenant {tenant.name!r} is already being put to sleep")
        if not tenant.leased:
            raise Conflict(f"tenant {tenant.name!r} has no handle channel to be told on")
        if mode == "warm" and not self._host_room_for(tenant):
            if waiter is not None or by_owner:
                raise NoMemory(
                    f"a warm sleep of {tenant.name!r} needs {format_bytes(tenant.mapped_bytes)} of host memory; "
                    f"warm sleepers hold {format_bytes(self.host_bytes_held())} of the "
                    f"{format_bytes(self.max_host_bytes or 0)} allowed (--warm-memory): sleep it cold, or wake one"
                )
            log.warning("tenant %s sleeps cold, not warm (%s): a warm copy of %s would pass --warm-memory "
                        "(%s held of %s)", tenant.name, why, format_bytes(tenant.mapped_bytes),
                        format_bytes(self.host_bytes_held()), format_bytes(self.max_host_bytes or 0))  # fmt: skip
            mode = "cold"
        sleep_id = next(self._ids)
        tenant.pending_sleep = PendingSleep(sleep_id, mode, waiter, now + self.timeout_s, why, victim)
        notify(self.leases, tenant.tenant_id, SleepNotice(mode, sleep_id, by_owner))
        return None

    def host_bytes_held(self) -> int:
        """Host memory warm sleepers' buffers hold (a reused buffer may be larger than its
        copy), and what the warm sleeps under way may take. O(tenants)."""
        held = 0
        for t in self.tenants:
            if t.warm is not None:
                held += t.warm.held_bytes
            elif t.pending_sleep is not None and t.pending_sleep.mode == "warm":
                held += t.mapped_bytes
        return held

    def _host_room_for(self, tenant: Tenant) -> bool:
        """Whether a warm sleep of ``tenant`` fits under ``max_host_bytes`` with what warm
        sleepers hold; the buffer cache gives up its oldest buffers to make the room."""
        if self.max_host_bytes is None:
            return True
        room = self.max_host_bytes - self.host_bytes_held() - tenant.mapped_bytes
        if room < 0:
            return False
        self.buffers.shrink_to(room)
        return True

    def _sleep_again(self, tenant: Tenant, mode: str, why: str) -> dict[str, Any]:
        if mode == "cold" and tenant.state is TenantState.SLEEPING_WARM:
            host_bytes = 0 if tenant.warm is None else tenant.warm.host_bytes
            self.drop_warm(tenant)
            tenant.state = TenantState.SLEEPING_COLD
            log.info("tenant %s is sleeping-cold (%s): warm sleep made cold, its host copy of %s "
                     "dropped", tenant.name, why, format_bytes(host_bytes))  # fmt: skip
            return self._result(tenant, 0)
        return {**self._result(tenant, 0), "already": True}

    def finish(
        self, tenant: Tenant, sleep_id: int, refused: bool, now: float, answer: PendingReply | None = None,
        why: str | None = None,
    ) -> dict[str, Any] | None:
        """The tenant's answer to sleep ``sleep_id``: the daemon's decision (module docstring).
        ``None`` while a sliced warm copy runs: ``answer`` (the tenant's reply) is answered at its
        end, as are retried ``sleep_ready``s meanwhile (``park``). ``why``: a refusal's reason
        when it is not the want of a quiesce hook."""
        if tenant.last_sleep is not None and tenant.last_sleep[0] == sleep_id:
            return tenant.last_sleep[1]  # a retried sleep_ready: the same answer
        pending = tenant.pending_sleep
        if pending is None or pending.sleep_id != sleep_id:
            raise Conflict(f"sleep {sleep_id} of {tenant.name!r} was cancelled or never asked")
        if pending.saving is not None:  # a retried sleep_ready while the copy runs
            park(pending.answers, answer)
            return None
        if refused:
            tenant.pending_sleep = None
            return self._refused(tenant, pending, why, now)
        if pending.mode == "cold":
            tenant.pending_sleep = None
            return self._slept(tenant, pending, None, now)
        steps = self._save(tenant)
        if tenant.mapped_bytes <= self.backend.copy_slice_bytes or answer is None:
            try:
                copy = run_through(steps)
            except (BackendError, OSError) as exc:
                raise self._save_failed(tenant, pending, exc) from exc
            return self._slept(tenant, pending, copy, now)
        pending.answers.append(answer)
        pending.saving = self.copies.start(
            steps, lambda copy: self._slept(tenant, pending, copy, self.clock()),
            lambda exc: self._save_failed(tenant, pending, exc),
        )
        return None

    def _refused(self, tenant: Tenant, pending: PendingSleep, why: str | None, now: float) -> dict[str, Any]:
        """A refused sleep: without ``why`` its engine has no quiesce hook (not sleepable until a
        heartbeat says otherwise); with one the daemon asks it again on its own no sooner than
        ``SLEEP_REFUSED_S`` later (``Tenant.may_be_slept``)."""
        if why is None:
            log.warning("tenant %s refused to sleep (%s): its engine has no quiesce hook",
                        tenant.name, pending.why)  # fmt: skip
            tenant.sleepable = False
            error = Conflict(
                f"tenant {tenant.name!r} cannot be put to sleep: its engine has no quiesce hook "
                "(a pool may still sleep itself)"
            )
        else:
            log.warning("tenant %s refused to sleep (%s): %r", tenant.name, pending.why, why)  # its text, quoted
            tenant.sleep_refused_at = now
            error = Conflict(f"tenant {tenant.name!r} refused to sleep: {why}")
        if pending.waiter is not None:
            pending.waiter.fail(error)
        return {"state": tenant.state.value, "refused": True}

    def _slept(self, tenant: Tenant, pending: PendingSleep, copy: swap.WarmCopy | None, now: float) -> dict[str, Any]:
        """Free a quiesced tenant's pages (its bytes in ``copy`` when warm) and answer everyone."""
        tenant.pending_sleep = None
        tenant.warm = copy
        keep_until = None if copy is None else now + IDLE_KEEP_S
        num_pages = self.grants.release_all(tenant, keep_until)
        tenant.state = TenantState.sleeping(pending.mode)
        self.tenants.changed()
        tenant.num_sleeps += 1
        self.num_sleeps += 1
        self.num_victims_slept += pending.victim
        result = self._result(tenant, num_pages)
        tenant.last_sleep = (pending.sleep_id, result)
        for reply in _replies(pending.waiter, pending.answers):
            reply.ok(result)
        kept = ""
        if tenant.warm is not None and num_pages:
            kept = f", {format_bytes(tenant.warm.host_bytes)} kept in host memory"
        log.info("tenant %s is %s (%s): %d physical page(s) (%s) freed%s", tenant.name, tenant.state.value,
                 pending.why, num_pages, format_bytes(num_pages * tenant.page_size_bytes),
                 kept)  # fmt: skip
        return result

    def _save(self, tenant: Tenant) -> Steps:
        """The steps of a copy of a quiesced tenant's pages to host memory."""
        # what the others hold or reserve (its own pending sleep reserves its mapped bytes)
        others = self.host_bytes_held() - tenant.mapped_bytes
        largest = None if self.max_host_bytes is None else self.max_host_bytes - others
        return swap.save(self.backend, tenant.logical, tenant.spec.num_segments, self.buffers, largest)

    def _save_failed(self, tenant: Tenant, pending: PendingSleep, exc: Exception) -> BackendError:
        """A warm copy failed (no host memory, a failed copy): nothing is released; the callers
        are told, and so is the tenant, which maps its pages back. Returns the error."""
        tenant.pending_sleep = None
        error = BackendError(f"tenant {tenant.name!r} stays active: its KV could not be copied to host "
                             f"memory for a warm sleep ({exc}); nothing was released")
        log.error("%s", error.message)
        for reply in _replies(pending.waiter, pending.answers):
            reply.fail(error)
        return error

    def _result(self, tenant: Tenant, num_released: int) -> dict[str, Any]:
        host = 0 if tenant.warm is None else tenant.warm.host_bytes
        return {"state": tenant.state.value, "num_released": num_released, "host_bytes": host}

    def expire(self, now: float) -> None:
        """Cancel sleeps whose tenant did not quiesce in time; nothing was freed."""
        for tenant in self.tenants:
            pending = tenant.pending_sleep
            if pending is None or pending.saving is not None or now < pending.deadline:
                continue  # none, or the tenant quiesced in time: its copy runs
            tenant.sleep_unanswered_at = now  # not asked again by a policy until heard from
            self.cancel(tenant, pending, f"did not quiesce within {self.timeout_s:g} s")

    def cancel(self, tenant: Tenant, pending: PendingSleep, why: str) -> None:
        """Cancel ``tenant``'s pending sleep (nothing was freed): its caller is told ``why``
        (``CONFLICT``), the tenant too; a ``sleep_ready`` on its way is refused (``finish``),
        and the tenant maps its pages back."""
        tenant.pending_sleep = None
        if pending.saving is not None:
            pending.saving.cancel()  # its buffer goes back; the tenant's sleep_ready is answered below
        log.warning("tenant %s: its sleep (%s) is cancelled, nothing freed: %s", tenant.name, pending.why, why)
        for reply in _replies(pending.waiter, pending.answers):
            reply.fail(Conflict(f"tenant {tenant.name!r}: sleep cancelled, {why}"))
        notify(self.leases, tenant.tenant_id, SleepCancelledNotice(pending.sleep_id))

    def sleep_idle(self, now: float, idle_s: float, mode: str) -> None:
        """The idle policy: sleep active, quiescable tenants whose blocks have not changed for ``idle_s``."""
        for tenant in self.tenants:
            idle = now - tenant.last_active
            if (tenant.state is TenantState.ACTIVE and tenant.leased and tenant.may_be_slept(now)
                    and tenant.pending_sleep is None and idle >= idle_s):  # fmt: skip
                log.info("tenant %s idle for %.0f s: asking it to sleep (%s)",
                         tenant.name, idle, mode)  # fmt: skip
                self.begin(tenant, mode, None, now, why=f"idle policy: idle for {idle:.0f} s")

    def stats(self) -> dict[str, int]:
        return {"sleeps": self.num_sleeps, "victims_slept": self.num_victims_slept}

    def forget(self, tenant: Tenant, why: KVDaemonError | None = None) -> None:
        """Drop what a removed tenant kept: its warm copy and any parked caller, told ``why``
        (default: the tenant went away)."""
        pending, tenant.pending_sleep = tenant.pending_sleep, None
        if pending is not None and pending.saving is not None:
            pending.saving.cancel()  # before its pages go (the caller frees them next)
        self.drop_warm(tenant)
        if pending is not None:
            for reply in _replies(pending.waiter, pending.answers):
                reply.fail(why or Conflict(f"tenant {tenant.name!r} went away while going to sleep"))

    def drop_warm(self, tenant: Tenant) -> None:
        """Give a warm sleeper's host copy back (its buffer to the cache)."""
        if tenant.warm is not None:
            tenant.warm.discard()
            tenant.warm = None


def _replies(waiter: PendingReply | None, answers: list[PendingReply]) -> list[PendingReply]:
    """The caller's reply (if any) and the tenant's own parked ones."""
    return answers if waiter is None else [waiter, *answers]


def park(replies: list[PendingReply], reply: PendingReply | None, busy: str | None = None) -> None:
    """Park ``reply`` until a copy ends: every parked call gets the copy's final answer.

    A peer's newer call takes the place of its older one (left unanswered: the peer sent
    again). Past ``MAX_ANSWERS`` peers, with ``busy`` (a wake: a refusal decides nothing) the
    call is refused, ``Conflict(busy)``; without (a tenant's own ``sleep_ready``: any error
    would make it map back pages the end may free) the oldest after the first caller's is
    dropped, unanswered. O(MAX_ANSWERS).
    """
    if reply is None:
        return
    own = [i for i, parked in enumerate(replies) if parked.routing_id == reply.routing_id]
    if own:
        del replies[own[0]]
    elif len(replies) >= MAX_ANSWERS:
        if busy is not None:
            raise Conflict(f"{busy}; {MAX_ANSWERS} callers already wait for it: ask again when it is done")
        del replies[min(1, len(replies) - 1)]
    replies.append(reply)
