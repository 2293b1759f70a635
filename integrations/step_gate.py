"""``StepGate``: an engine's step lock that lets the pool's agent in between steps.

A plain lock is not fair: an engine thread that steps in a loop releases and
takes it back before a waiting thread wakes, so a sleep (or a restart's page
move) could wait on the engine forever. Here a waiting ``quiesce`` goes first:
no new step starts while one waits, and the step running finishes normally.

Invariant: at most one holder at a time (a step, or a quiesce until its
``resume``). Cost: one condition acquire per step.
"""

from __future__ import annotations

import threading


class StepGate:
    """Use ``with gate:`` around a step; ``quiesce()``/``resume()`` from the pool's agent."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held = False
        self._num_quiescing = 0

    def __enter__(self) -> StepGate:
        with self._cond:
            while self._held or self._num_quiescing:
                self._cond.wait()
            self._held = True
        return self

    def __exit__(self, *_exc: object) -> None:
        self._release()

    def quiesce(self) -> None:
        """Wait for the running step to end; no step starts until ``resume``."""
        with self._cond:
            self._num_quiescing += 1
            try:
                while self._held:
                    self._cond.wait()
            finally:
                self._num_quiescing -= 1
            self._held = True

    def resume(self) -> None:
        """Let steps run again."""
        self._release()

    def _release(self) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()
