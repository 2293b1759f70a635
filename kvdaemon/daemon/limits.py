"""Tenant limits: ``max_bytes``, ``min_bytes``, ``weight``, from the tenant's own request
bounded by the operator's policy (``kvdaemon.daemon.policies``), changed by revision.

``set_limit`` without a token is the operator's: it changes the policy of a
tenant *name* (``PolicyBook``), registered or not, and a registered tenant's
limits at once. Fields: ``max``/``min`` (a size: ``8GiB``, ``40%`` of the
capacity, bytes, or ``none`` to remove it), ``max_bytes``/``min_bytes``
(bytes), ``weight`` (a number or ``none``), ``reset`` (forget what ``limit``
set). With the tenant's ``token`` it changes the tenant's own request instead
(bytes only), still bounded by the policy; nothing is kept then.

A registered tenant's limits change by revision R (default: the current + 1, or
the current when the limits asked are the ones it has: nothing changes, nothing is told):

- R newer than the tenant's: applied, R becomes current;
- R equal with the same limits: applied again, nothing changes (idempotent retry);
- R equal with other limits: ``CONFLICT``;
- R older: ``STALE``.

R is at most ``MAX_REVISION`` (2^53 - 1), far below the wire's integer bound, so
the revisions after it (the current + 1 each) stay on the wire (``BAD_REQUEST``
past it); a tenant's own R at most the current + 1 (``BAD_REQUEST`` past it: a
tenant cannot spend the revisions and so shut the operator out).

A name that is not registered has no revision: its policy is stored (the
revision is not checked) and applied when a tenant of that name registers.
Every field is checked, and the policy written to disk, before anything
changes; a refused request changes nothing. A policy's min above its max is
``BAD_REQUEST``; a max above the capacity, or a tenant's own min above the
policy's max, is clamped and the reply says so (``clamped``). The sum of all
``min_bytes`` must fit in the capacity (``NO_MEMORY``). A tenant's own min (one
its policy does not set) is also clamped to what the operator's mins for names not
registered leave (``PolicyBook.promised``), so no tenant takes by asking first what
was promised to another: at registration, and whenever its min would rise (its own
change, or the operator removing its policy's min); a min it holds is not lowered
by a promise made later. An operator's min for a name not registered is kept even
where it does not fit now; the reply says so (``warnings``), and a tenant of that
name is refused until the guarantees in its way are released or lowered.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kvdaemon.daemon.grants import Grants
from kvdaemon.daemon.policies import (
    EMPTY, MAX_WEIGHT, MIN_WEIGHT, Bounded, Clamp, Limits, OwnLimits, Policy, bound, request_policy, sets_min,
)  # fmt: skip
from kvdaemon.daemon.policy_book import PolicyBook
from kvdaemon.daemon.ports import LeasePort, notify
from kvdaemon.daemon.tenant import Tenant, Tenants, check_name
from kvdaemon.errors import BadRequest, Conflict, NoMemory, StaleRevision
from kvdaemon.wire.messages import LimitNotice
from kvdaemon.wire.protocol import MAX_INT, Args
from kvdaemon.wire.sizes import SizeSpec, format_bytes

log = logging.getLogger("kvdaemon.limits")
MAX_POLICY_WARNINGS = 8  # lines of ``policy_warnings`` for policies under one page; the rest counted
MAX_REVISION = (1 << 53) - 1  # a limit revision; every one has a next on the wire (module docstring)


@dataclass(frozen=True)
class LimitPlan:
    """New limits for a tenant, checked and not yet applied (``commit_limit`` applies them)."""

    tenant: Tenant
    limits: Limits
    revision: int
    changed: bool


def plan_limit(
    tenant: Tenant, limits: Limits, revision: int | None, capacity_bytes: int, others_min_bytes: int
) -> LimitPlan:
    """Check ``limits`` for ``tenant`` at ``revision`` (module docstring); raise, or return
    the plan."""
    if revision is None:
        if limits == tenant.current_limits():  # a change to what holds: nothing to apply, no revision spent
            return LimitPlan(tenant, limits, tenant.limit_revision, changed=False)
        revision = tenant.limit_revision + 1
    if revision > MAX_REVISION:
        raise BadRequest(f"{tenant.name!r} is at revision {tenant.limit_revision}, the last there is")
    if revision < tenant.limit_revision:
        raise StaleRevision(
            f"revision {revision} is older than {tenant.name!r}'s {tenant.limit_revision}"
        )
    if revision == tenant.limit_revision:
        if limits != tenant.current_limits():
            raise Conflict(f"revision {revision} was already applied with other values")
        return LimitPlan(tenant, limits, revision, changed=False)
    rises = limits.min_bytes > tenant.min_bytes  # one kept or lowered fits as it did
    if rises and others_min_bytes + limits.min_bytes > capacity_bytes:
        raise NoMemory(
            f"min {format_bytes(limits.min_bytes)} does not fit next to "
            f"{format_bytes(others_min_bytes)} guaranteed to others in {format_bytes(capacity_bytes)}"
        )
    return LimitPlan(tenant, limits, revision, changed=True)


def promised_names(promised: dict[str, int]) -> str:
    """``'y', 'z'`` (the first four names, sorted)."""
    return ", ".join(repr(name) for name in sorted(promised)[:4]) + (", ..." if len(promised) > 4 else "")


def commit_limit(plan: LimitPlan) -> None:
    """Apply a plan of ``plan_limit`` (nothing when it changes nothing)."""
    if plan.changed:
        tenant = plan.tenant
        tenant.max_bytes, tenant.min_bytes, tenant.weight = (
            plan.limits.max_bytes, plan.limits.min_bytes, plan.limits.weight,
        )  # fmt: skip
        tenant.limit_revision = plan.revision


BY_OWNER = "by the tenant itself"
OWN_LOG_INTERVAL_S = 10.0  # a tenant's own limit changes: at most one log line per interval


ADMIN_LOG_BURST = 30  # an admin's limit changes logged per window; past it counted, told with the next line
ADMIN_LOG_WINDOW_S = 10.0


class AdminLines:
    """Every admin limit change is logged, up to ``ADMIN_LOG_BURST`` lines per
    ``ADMIN_LOG_WINDOW_S`` (a peer changing limits in a loop once wrote 100 KB/s);
    the ones past it are counted and told with the next line. O(1)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.window_start = float("-inf")
        self.num_logged = 0
        self.num_unlogged = 0

    def due(self) -> bool:
        now = self.clock()
        if now - self.window_start >= ADMIN_LOG_WINDOW_S:
            self.window_start, self.num_logged = now, 0
        if self.num_logged < ADMIN_LOG_BURST:
            self.num_logged += 1
            return True
        self.num_unlogged += 1
        return False

    def unlogged(self) -> str:
        """`` (N more ... not logged)``, and resets the count."""
        count, self.num_unlogged = self.num_unlogged, 0
        return f" ({count} more admin limit changes before this one, not logged)" if count else ""


def _log_due(tenant: Tenant, by_owner: bool) -> bool:
    """Whether this change is logged (an admin's: ``AdminLines``); a tenant's own at most once per
    ``OWN_LOG_INTERVAL_S`` (a tenant changing its limits in a loop cannot flood the log),
    the ones in between counted on the tenant and told with its next line."""
    if not by_owner:
        return True
    now = time.monotonic()
    if now - tenant.own_limit_logged_at < OWN_LOG_INTERVAL_S:
        tenant.num_own_limits_unlogged += 1
        return False
    tenant.own_limit_logged_at = now
    return True


def _unlogged(tenant: Tenant) -> str:
    """`` (N more own changes before it, not logged)``, and resets the count."""
    count, tenant.num_own_limits_unlogged = tenant.num_own_limits_unlogged, 0
    return f" ({count} more of its own changes before this one, not logged)" if count else ""


class Limiter:
    """Limits at registration and on ``set_limit``, over the tenants and the policy book."""

    def __init__(
        self, tenants: Tenants, policies: PolicyBook, grants: Grants, leases: LeasePort,
        capacity_bytes: int,
    ) -> None:
        self.tenants = tenants
        self.policies = policies
        self.grants = grants
        self.leases = leases
        self.capacity_bytes = capacity_bytes
        self.admin_lines = AdminLines()

    def for_registration(self, name: str, own: OwnLimits) -> Bounded:
        """The limits a tenant ``name`` asking ``own`` gets; ``NoMemory`` if its min does not fit
        (beside the operator's promises to others too, where the min is its own)."""
        policy = self.policies.effective(name)
        guaranteed = self.tenants.guaranteed_bytes()
        bounded = self._within_promises(name, bound(own, policy, self.capacity_bytes), policy, 0, guaranteed)
        if guaranteed + bounded.limits.min_bytes > self.capacity_bytes:
            raise NoMemory(
                f"min {format_bytes(bounded.limits.min_bytes)} of {name!r} does not fit: "
                f"{format_bytes(guaranteed)} of {format_bytes(self.capacity_bytes)} "
                "already guaranteed"
            )
        return bounded

    def _within_promises(
        self, name: str, bounded: Bounded, policy: Policy, held_bytes: int, others_bytes: int
    ) -> Bounded:
        """``bounded`` with a min of the tenant's own that would rise past ``held_bytes`` (the
        min it has) clamped to what the operator's mins for names not registered leave beside
        ``others_bytes`` (the other tenants' guarantees), or to ``held_bytes`` where that is
        more. A min that does not fit beside ``others_bytes`` alone is left as it is, to be
        refused (``NO_MEMORY``), as one its policy sets is: the operator's word, first come,
        first served among the operator's own (see the module docstring). O(policies)."""
        wanted = bounded.limits.min_bytes
        if sets_min(policy) or wanted <= held_bytes:
            return bounded
        promised = self.policies.promised(self.capacity_bytes, (t.name for t in self.tenants), other_than=name)
        room = self.capacity_bytes - others_bytes - sum(promised.values())
        if wanted <= room or wanted > self.capacity_bytes - others_bytes:  # fits, or refused whatever promised
            return bounded
        applied = max(room, held_bytes, 0)
        clamp = Clamp("min", wanted, applied, f"promised by the operator to {promised_names(promised)}")
        return Bounded(replace(bounded.limits, min_bytes=applied), (*bounded.clamped, clamp))

    def policy_warnings(self) -> list[str]:
        """What the operator's policies cannot give, said in the log at start: a max under one
        page (that tenant maps nothing), mins for names not registered that add up past what
        the registered tenants leave (those that register last are refused). O(policies)."""
        registered = {t.name for t in self.tenants}
        warnings = []
        for name in self.policies.names():
            if name not in registered:
                bounded = bound(OwnLimits(None, 0, 1.0), self.policies.effective(name), self.capacity_bytes)
                warnings.extend(f"policy of {name}: {w}" for w in self._tiny_max(name, bounded))
        if len(warnings) > MAX_POLICY_WARNINGS:  # a line each would bury the rest
            more = len(warnings) - MAX_POLICY_WARNINGS + 1
            warnings = [*warnings[:MAX_POLICY_WARNINGS - 1], f"{more} more policies with a max under one page"]
        return warnings + self._over_promised()

    def _tiny_max(self, name: str, bounded: Bounded) -> list[str]:
        page_bytes, max_bytes = self.grants.pages.page_size_bytes, bounded.limits.max_bytes
        if max_bytes is None or max_bytes >= page_bytes:
            return []
        return [f"max {format_bytes(max_bytes)} is under one page ({format_bytes(page_bytes)}): "
                f"a tenant {name!r} could map nothing"]  # fmt: skip

    def _over_promised(self) -> list[str]:
        guaranteed = self.tenants.guaranteed_bytes()
        promised = self.policies.promised(self.capacity_bytes, (t.name for t in self.tenants))
        if guaranteed + sum(promised.values()) <= self.capacity_bytes:
            return []
        return [f"the operator's mins for names not registered add up to {format_bytes(sum(promised.values()))}, "
                f"past the {format_bytes(self.capacity_bytes - guaranteed)} left beside registered tenants' "
                "guarantees: those that register last are refused"]  # fmt: skip

    def _unfit(self, name: str, bounded: Bounded) -> list[str]:
        """Why a policy the operator just set for ``name`` (not registered) may not be honoured:
        its max is under one page, its min does not fit beside the registered tenants'
        guarantees now (its registration would be refused), or the operator's mins for names
        not registered pass what those leave (the last to register are refused). Empty when
        none."""
        tiny = self._tiny_max(name, bounded)
        min_bytes, guaranteed = bounded.limits.min_bytes, self.tenants.guaranteed_bytes()
        if not min_bytes:
            return tiny
        if guaranteed + min_bytes > self.capacity_bytes:
            return [*tiny, f"min {format_bytes(min_bytes)} does not fit now: {format_bytes(guaranteed)} of "
                    f"{format_bytes(self.capacity_bytes)} are guaranteed to registered tenants; a tenant {name!r} "
                    "is refused until they release or lower theirs"]  # fmt: skip
        return tiny + self._over_promised()

    def set_limit(self, args: Args, by_owner: Tenant | None) -> dict[str, Any]:
        """Serve ``set_limit`` (module docstring); ``by_owner``: the tenant whose token it carries."""
        if by_owner is not None:
            return self._set_own(by_owner, args)
        name = check_name(args.str("name"))
        change = _policy_change(args)
        reset = args.bool("reset")
        if change.is_empty and not reset:
            raise BadRequest("set_limit needs at least one of max, min, weight (or reset)")
        revision = args.opt_int("revision", 1, MAX_REVISION)
        layer = change.over(EMPTY if reset else self.policies.layer(name))
        policy = self.policies.effective(name, layer)
        self._check_policy(name, policy)
        tenant = self.tenants.find(name)
        if tenant is None:
            bounded = bound(OwnLimits(None, 0, 1.0), policy, self.capacity_bytes)
            self.policies.store(name, layer)
            warnings = self._unfit(name, bounded)
            # unsettled: a removed field reads 'max none', which says what it overrides
            if self.admin_lines.due():
                log.log(logging.WARNING if warnings else logging.INFO,
                        "policy of %s (not registered) is now %s%s; applied when it registers%s%s",
                        name, policy.describe(), _clamps(bounded), "".join(f"; {w}" for w in warnings),
                        self.admin_lines.unlogged())  # fmt: skip
            return {"result": "stored", "registered": False, "revision": None, "changed": True,
                    **self._report(name, bounded, registered=False), "warnings": warnings}  # fmt: skip
        assert tenant.own is not None
        bounded = self._bound_registered(tenant, tenant.own, policy)
        plan = self._plan(tenant, bounded, revision)
        self.policies.store(name, layer)
        return self._commit(plan, bounded, "by an admin")

    def _set_own(self, tenant: Tenant, args: Args) -> dict[str, Any]:
        if any(args.has(key) for key in ("max", "min", "reset")):
            raise BadRequest("a tenant changes its own limits in bytes: max_bytes, min_bytes, weight")
        assert tenant.own is not None
        max_bytes = args.opt_int("max_bytes", 0, MAX_INT)
        min_bytes = args.opt_int("min_bytes", 0, MAX_INT)
        weight = args.opt_float("weight", MIN_WEIGHT, MAX_WEIGHT)
        if max_bytes is None and min_bytes is None and weight is None:
            raise BadRequest("set_limit needs at least one of max_bytes, min_bytes, weight")
        own = OwnLimits(
            tenant.own.max_bytes if max_bytes is None else max_bytes,
            tenant.own.min_bytes if min_bytes is None else min_bytes,
            tenant.own.weight if weight is None else weight,
        )
        check_own(own, self.capacity_bytes)
        bounded = self._bound_registered(tenant, own, self.policies.effective(tenant.name))
        # its own revision may not jump: a tenant could otherwise spend them all and shut the operator out
        revision = args.opt_int("revision", 1, min(tenant.limit_revision + 1, MAX_REVISION))
        plan = self._plan(tenant, bounded, revision)
        tenant.own = own
        return self._commit(plan, bounded, BY_OWNER)

    def _bound_registered(self, tenant: Tenant, own: OwnLimits, policy: Policy) -> Bounded:
        """The limits of registered ``tenant`` asking ``own`` under ``policy``, within the promises."""
        others = self.tenants.guaranteed_bytes(other_than=tenant)
        bounded = bound(own, policy, self.capacity_bytes)
        return self._within_promises(tenant.name, bounded, policy, tenant.min_bytes, others)

    def _plan(self, tenant: Tenant, bounded: Bounded, revision: int | None) -> LimitPlan:
        others = self.tenants.guaranteed_bytes(other_than=tenant)
        return plan_limit(tenant, bounded.limits, revision, self.capacity_bytes, others)

    def _commit(self, plan: LimitPlan, bounded: Bounded, by: str) -> dict[str, Any]:
        tenant = plan.tenant
        before = tenant.current_limits()
        commit_limit(plan)
        self.tenants.changed()  # a weight or minimum moves the fair shares
        by_owner = by == BY_OWNER
        if plan.changed:
            notify(self.leases, tenant.tenant_id, LimitNotice(**tenant.limits()))  # the pool pays any debt
            if _log_due(tenant, by_owner) if by_owner else self.admin_lines.due():
                log.info("limits of %s set %s: %s (was %s; revision %d)%s%s%s", tenant.name, by,
                         describe_limits(plan.limits), describe_limits(before), plan.revision,
                         _clamps(bounded), _owing(tenant), self._unlogged(tenant, by_owner))  # fmt: skip
        elif not by_owner and self.admin_lines.due():  # the operator's word, also when it changes no limit
            log.info("limits of %s unchanged %s: %s (revision %d)%s%s", tenant.name, by,
                     describe_limits(plan.limits), plan.revision, _clamps(bounded), self._unlogged(tenant, False))
        report = self._report(tenant.name, bounded, registered=True)
        return {"result": "applied", "registered": True, "revision": plan.revision,
                "changed": plan.changed, **report}  # fmt: skip

    def _unlogged(self, tenant: Tenant, by_owner: bool) -> str:
        """What went unlogged before this line: the tenant's own changes, and an admin's."""
        return _unlogged(tenant) + ("" if by_owner else self.admin_lines.unlogged())

    def _check_policy(self, name: str, policy: Policy) -> None:
        settled = policy.settled()
        if not isinstance(settled.min, SizeSpec) or not isinstance(settled.max, SizeSpec):
            return
        low, high = settled.min.resolve(self.capacity_bytes), settled.max.resolve(self.capacity_bytes)
        if low > high:
            raise BadRequest(
                f"min {settled.min} ({format_bytes(low)}) of {name!r} exceeds its max "
                f"{settled.max} ({format_bytes(high)}; `kvdaemon status` shows where each comes from)"
            )

    def _report(self, name: str, bounded: Bounded, registered: bool) -> dict[str, Any]:
        """The reply's fields about ``name``: its limits (``None`` until it registers), its
        policy and what was clamped."""
        policy = self.policies.effective(name).to_json()
        limits = bounded.limits
        return {
            "limit": {"max_bytes": limits.max_bytes, "min_bytes": limits.min_bytes,
                      "weight": limits.weight} if registered else None,
            "policy": {"max": policy.get("max"), "min": policy.get("min"),
                       "weight": policy.get("weight")},
            "clamped": [clamp.to_json() for clamp in bounded.clamped],
        }  # fmt: skip


def check_own(own: OwnLimits, capacity_bytes: int) -> None:
    """``BadRequest`` when a tenant's own min exceeds its own max (or the capacity)."""
    ceiling = capacity_bytes if own.max_bytes is None else min(own.max_bytes, capacity_bytes)
    if own.min_bytes > ceiling:
        raise BadRequest(f"min_bytes {own.min_bytes} exceeds max_bytes {ceiling}")


def describe_limits(limits: Limits) -> str:
    """``max 8.00 GiB, min 0 B, weight 1``."""
    return (f"max {format_bytes(limits.max_bytes)}, min {format_bytes(limits.min_bytes)}, "
            f"weight {limits.weight:g}")  # fmt: skip


def _clamps(bounded: Bounded) -> str:
    return "".join(f"; {clamp.describe()}" for clamp in bounded.clamped)


def _owing(tenant: Tenant) -> str:
    over = tenant.mapped_bytes - tenant.max_bytes
    return f"; {format_bytes(over)} over it, asked back" if over > 0 else ""


def _policy_change(args: Args) -> Policy:
    """The policy fields of an operator's ``set_limit`` (``max_bytes``/``min_bytes``: exact sizes)."""
    raw: dict[str, Any] = {key: args.raw(key) for key in ("max", "min", "weight")}
    for key in ("max", "min"):
        if args.has(f"{key}_bytes"):
            if raw[key] is not None:
                raise BadRequest(f"give {key} or {key}_bytes, not both")
            raw[key] = args.int(f"{key}_bytes", 0, MAX_INT)
    return request_policy(raw)
