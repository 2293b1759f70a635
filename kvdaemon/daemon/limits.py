"""Tenant limits: ``max_bytes``, ``min_bytes``, ``weight``, changed by revision.

A ``set_limit`` carries an optional revision R (default: the current one + 1):

- R newer than the tenant's: applied, R becomes current;
- R equal with the same values: applied again, nothing changes (idempotent retry);
- R equal with other values: ``CONFLICT``;
- R older: ``STALE``.

Every field is checked before anything changes. ``max_bytes`` is capped at the
pool's capacity; the sum of all ``min_bytes`` must fit in it.
"""

from __future__ import annotations

import logging
from typing import Any

from kvdaemon.errors import BadRequest, Conflict, NoMemory, StaleRevision
from kvdaemon.wire.protocol import MAX_INT, Args
from kvdaemon.daemon.tenant import Tenant

log = logging.getLogger("kvdaemon.daemon.limits")
MAX_WEIGHT = 1e6


def apply_limit(tenant: Tenant, args: Args, capacity_bytes: int, others_min_bytes: int) -> dict[str, Any]:
    """Apply a ``set_limit`` request to ``tenant``; see the module docstring for revisions."""
    old_max, old_min, old_weight = tenant.max_bytes, tenant.min_bytes, tenant.weight
    max_bytes = args.opt_int("max_bytes", 0, MAX_INT)
    min_bytes = args.opt_int("min_bytes", 0, MAX_INT)
    weight = args.opt_float("weight", 1e-6, MAX_WEIGHT)
    if max_bytes is None and min_bytes is None and weight is None:
        raise BadRequest("set_limit needs at least one of max_bytes, min_bytes, weight")
    values = (
        old_max if max_bytes is None else min(max_bytes, capacity_bytes),
        old_min if min_bytes is None else min_bytes,
        old_weight if weight is None else weight,
    )
    revision = args.opt_int("revision", 1, MAX_INT)
    if revision is None:
        revision = tenant.limit_revision + 1
    if revision < tenant.limit_revision:
        raise StaleRevision(
            f"revision {revision} is older than {tenant.name!r}'s {tenant.limit_revision}"
        )
    if revision == tenant.limit_revision:
        if values != (old_max, old_min, old_weight):
            raise Conflict(f"revision {revision} was already applied with other values")
        return {"result": "applied", "revision": revision, "changed": False}
    if values[1] > values[0]:
        raise BadRequest(f"min_bytes {values[1]} exceeds max_bytes {values[0]}")
    if others_min_bytes + values[1] > capacity_bytes:
        raise NoMemory(
            f"min_bytes {values[1]} does not fit next to {others_min_bytes} guaranteed"
        )
    tenant.max_bytes, tenant.min_bytes, tenant.weight = values
    tenant.limit_revision = revision
    log.info("limits of %s now max=%d min=%d weight=%g (rev %d)", tenant.name, *values, revision)
    return {"result": "applied", "revision": revision, "changed": True}
