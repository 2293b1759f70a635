"""``kvdaemon wait``: poll the daemon until named tenants have registered (and, if asked,
are in a given state, or have been idle a while).

Polls ``status`` every ``POLL_S`` (one round trip each) until every name is
registered and, with ``state``, in that state (``active`` after an engine woke
itself), with ``sleepable``, its engine can be quiesced (``kvdaemon sleep``
would take it: an ``Engine`` says so once it is built), and, with ``idle_s``,
has gone ``idle_s`` seconds without its blocks changing (the status's
``idle_seconds``, counted from registration: an engine still loading its model
looks idle; a slow engine's single step can too). Raises ``WaitTimeout``
naming what is still missing, also when the daemon does not answer by the
deadline (each ``status`` waits only for what is left of it, at least
``MIN_ASK_S``): a stopped daemon holds the wait no longer than its timeout.
"""

from __future__ import annotations

import time
from typing import Any

from kvdaemon.client import KVClient
from kvdaemon.errors import NoReply, WaitTimeout

POLL_S = 0.2
MIN_ASK_S = 0.5  # the least a status is waited for, past the deadline too


def wait_for_tenants(
    client: KVClient,
    names: list[str],
    timeout_s: float,
    idle_s: float | None = None,
    state: str | None = None,
    sleepable: bool = False,
) -> dict[str, Any]:
    """Return ``{"tenants": [their status rows, in the order of names], "waited_s": s}``."""
    started = time.monotonic()
    deadline = started + timeout_s
    while True:
        try:
            status = client.call("status", timeout_s=max(MIN_ASK_S, deadline - time.monotonic()))
        except NoReply as exc:
            raise WaitTimeout(f"after {timeout_s:g} s: the daemon did not answer ({exc.message})") from exc
        rows = {str(t["name"]): t for t in status["tenants"]}
        pending = _pending(names, rows, idle_s, state, sleepable)
        now = time.monotonic()
        if not pending:
            return {"tenants": [rows[name] for name in names], "waited_s": round(now - started, 3)}
        if now >= deadline:
            raise WaitTimeout(f"after {timeout_s:g} s: {'; '.join(pending)}")
        time.sleep(min(POLL_S, deadline - now))


def _pending(
    names: list[str], rows: dict[str, Any], idle_s: float | None, state: str | None, sleepable: bool
) -> list[str]:
    """What each name still waits for, as phrases (empty when all are there)."""
    pending = []
    for name in names:
        if name not in rows:
            pending.append(f"{name} has not registered")
        elif state is not None and rows[name]["state"] != state:
            pending.append(f"{name} is {rows[name]['state']}, not {state}")
        elif sleepable and not rows[name].get("sleepable"):
            pending.append(f"{name}'s engine cannot be quiesced yet (not built, or it has no quiesce hook)")
        elif idle_s is not None and rows[name]["idle_seconds"] < idle_s:
            pending.append(
                f"{name} has been idle {rows[name]['idle_seconds']:.1f} s, not {idle_s:g} s"
            )
    return pending
