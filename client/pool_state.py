"""The one state of a ``KVPool``, with the transitions it may take.

=============  ==============================================================
ACTIVE         pages mapped on demand; the daemon is reachable
SLEEP_PENDING  quiesced and unmapped for a sleep; the daemon is deciding
ASLEEP_WARM    no pages; the daemon keeps the bytes; block ids stay valid
ASLEEP_COLD    no pages; every block was dropped
DETACHED       the daemon is gone: serving from what is mapped, no growth,
               re-registering with the next daemon on the same directory
REVOKED        the daemon took the lease back: nothing mapped (terminal but
               for closing)
CLOSED         closed by its user (terminal)
=============  ==============================================================

Every change goes through ``PoolStateCell.move``, which refuses a transition
not in ``TRANSITIONS`` (a bug, ``AssertionError``), and wakes whoever waits for
a state. The cell shares the pool's lock: read ``state`` freely, move it only
with the lock held.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from typing import Any


class PoolState(enum.Enum):
    ACTIVE = "active"
    SLEEP_PENDING = "sleep-pending"
    ASLEEP_WARM = "asleep-warm"
    ASLEEP_COLD = "asleep-cold"
    DETACHED = "detached"
    REVOKED = "revoked"
    CLOSED = "closed"

    @property
    def asleep(self) -> bool:
        return self in (PoolState.ASLEEP_WARM, PoolState.ASLEEP_COLD)

    @property
    def ended(self) -> bool:
        return self in (PoolState.REVOKED, PoolState.CLOSED)


_S = PoolState
TRANSITIONS: dict[PoolState, frozenset[PoolState]] = {
    _S.ACTIVE: frozenset({_S.SLEEP_PENDING, _S.DETACHED, _S.REVOKED, _S.CLOSED}),
    # the daemon decided: asleep, or refused (active again), or it died (detached)
    _S.SLEEP_PENDING: frozenset({_S.ASLEEP_WARM, _S.ASLEEP_COLD, _S.ACTIVE, _S.DETACHED}),
    # woken; or re-registered after a restart, empty (the warm copy died with the daemon)
    _S.ASLEEP_WARM: frozenset({_S.ACTIVE, _S.ASLEEP_COLD, _S.REVOKED, _S.CLOSED}),
    _S.ASLEEP_COLD: frozenset({_S.ACTIVE, _S.REVOKED, _S.CLOSED}),
    _S.DETACHED: frozenset({_S.ACTIVE, _S.CLOSED}),
    _S.REVOKED: frozenset({_S.CLOSED}),
    _S.CLOSED: frozenset(),
}


class PoolStateCell:
    """A pool's state and a condition to wait for it (see the module docstring)."""

    def __init__(self, lock: Any) -> None:
        self.state = PoolState.ACTIVE
        self.ended = False  # ``state.ended``, as a plain attribute for the engine's fast path
        self.num_sleeps = 0  # times the pool fell asleep (warm or cold), woken since or not
        self.num_wakes = 0  # times it woke (asleep to active), fallen asleep since or not
        self._changed = threading.Condition(lock)

    def move(self, new: PoolState) -> None:
        """Change to ``new``; the pool's lock must be held."""
        assert new in TRANSITIONS[self.state], f"pool state {self.state.value} -> {new.value}"
        self.num_wakes += self.state.asleep and new is PoolState.ACTIVE
        self.state = new
        self.ended = new.ended
        self.num_sleeps += new.asleep
        self._changed.notify_all()

    def wait_for(self, accept: Callable[[PoolState], bool], timeout_s: float) -> bool:
        """Wait (lock held; released while waiting) until ``accept(state)``; False on timeout."""
        return self._changed.wait_for(lambda: accept(self.state), timeout_s)

    def wait_slept(self, num_sleeps: int, timeout_s: float) -> bool:
        """Wait (lock held) until the pool is asleep, has fallen asleep more than ``num_sleeps``
        times in all (woken since: an engine auto-wakes at once), or ended."""
        return self._changed.wait_for(
            lambda: self.state.asleep or self.num_sleeps > num_sleeps or self.ended, timeout_s
        )

    def wait_woken(self, num_wakes: int, timeout_s: float) -> bool:
        """Wait (lock held) until the pool is awake, has woken more than ``num_wakes`` times in
        all (asleep again since: a sleep may follow a wake at once), or ended."""
        return self._changed.wait_for(
            lambda: not (self.state.asleep or self.state is PoolState.SLEEP_PENDING)
            or self.num_wakes > num_wakes or self.ended, timeout_s
        )
