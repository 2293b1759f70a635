"""``kvdaemon wait``: poll the daemon until named tenants have registered (and, if asked,
have been idle a while).

Polls ``status`` every ``POLL_S`` (one round trip each) until every name is
registered and, with ``idle_s``, each has gone ``idle_s`` seconds without its
blocks changing (the status's ``idle_seconds``: between an engine's rounds, not
during one). Raises ``WaitTimeout`` naming what is still missing.
"""

from __future__ import annotations

import time
from typing import Any

from kvdaemon.client import KVClient
from kvdaemon.errors import WaitTimeout

POLL_S = 0.2


def wait_for_tenants(
    client: KVClient, names: list[str], timeout_s: float, idle_s: float | None = None
) -> dict[str, Any]:
    """Return ``{"tenants": [their status rows, in the order of names], "waited_s": s}``."""
    started = time.monotonic()
    deadline = started + timeout_s
    while True:
        rows = {str(t["name"]): t for t in client.status()["tenants"]}
        pending = _pending(names, rows, idle_s)
        now = time.monotonic()
        if not pending:
            return {"tenants": [rows[name] for name in names], "waited_s": round(now - started, 3)}
        if now >= deadline:
            raise WaitTimeout(f"after {timeout_s:g} s: {'; '.join(pending)}")
        time.sleep(min(POLL_S, deadline - now))


def _pending(names: list[str], rows: dict[str, Any], idle_s: float | None) -> list[str]:
    """What each name still waits for, as phrases (empty when all are there)."""
    pending = []
    for name in names:
        if name not in rows:
            pending.append(f"{name} has not registered")
        elif idle_s is not None and rows[name]["idle_seconds"] < idle_s:
            pending.append(
                f"{name} has been idle {rows[name]['idle_seconds']:.1f} s, not {idle_s:g} s"
            )
    return pending
