"""Bulk copies of warm sleeps and wakes, done a slice at a time on the daemon's loop.

A warm sleep or wake of a big tenant moves GiBs between its pages and host
memory; done in one go it would hold the loop (every other tenant's grows and
heartbeats, the CLI) for seconds, and a tenant may ask for its own sleep and
wake as often as it likes. A copy is a generator that moves one slice per
``next`` (sized by a ``Pacer``: about ``BUDGET_S``, at most the backend's
``copy_slice_bytes``) and returns its result at the end.
``Copies.step`` advances the jobs in turn, a slice each, for at most
``BUDGET_S``; then the loop serves what came meanwhile, and polls without
waiting while a job is left.

The copies run on the loop's own thread, so no page changes between two slices
unless the loop changes it, and the callers keep to one rule: the pages of a
tenant with a copy under way are not freed by anyone but the copy's owner (a
shrink is refused, ``Tenant.copying``), and a tenant removed mid-copy has its
job cancelled (``CopyJob.cancel``) before the loop runs another slice.

Invariants: a job ends exactly once, by ``on_done`` (its generator's value),
``on_error`` (the exception that stopped it), or ``cancel`` (no callback; the
generator's own cleanup runs at once).

Cost: one generator step per slice; O(1) per step besides the copy.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Generator
from typing import Any, TypeVar

from kvdaemon.errors import BackendError

log = logging.getLogger("kvdaemon.copies")
T = TypeVar("T")
Steps = Generator[None, None, Any]
BUDGET_S = 0.01  # one step's share of the loop: the slices that fit, at least one
FIRST_SLICE_BYTES = 16 << 20  # a copy's first slice, before its speed is known


def run_through(steps: Generator[None, None, T]) -> T:
    """Run ``steps`` to its end at once and return its value (a copy small enough not to slice)."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


class Pacer:
    """The sizes of one copy's slices: each about ``budget_s`` at the speed the last one went
    (fresh memory, faulted in as it is written, can be ten times slower than memory already
    there), a multiple of ``unit_bytes`` between one unit and ``max_bytes``, growing at most
    ``GROWTH`` times a slice; the first is ``first_bytes``. O(1)."""

    GROWTH = 4

    def __init__(
        self, max_bytes: int, unit_bytes: int, first_bytes: int, budget_s: float = BUDGET_S,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.max_units = max(1, max_bytes // unit_bytes)
        self.budget_s = budget_s
        self.clock = clock
        self._units = min(self.max_units, max(1, first_bytes // unit_bytes))

    def run(self, num_units: int, work: Callable[[int, int], None]) -> Generator[None, None, None]:
        """``work(first unit, number of units)`` over ``num_units``, a slice per step, each
        slice sized by how long ``work`` took over the one before."""
        start = 0
        while start < num_units:
            count = min(self._units, num_units - start)
            began = self.clock()
            work(start, count)
            self._pace(count, self.clock() - began)
            start += count
            if start < num_units:
                yield

    def _pace(self, count: int, seconds: float) -> None:
        fits = count * self.budget_s / seconds if seconds > 0 else self.max_units
        self._units = max(1, min(self.max_units, self.GROWTH * count, int(fits)))


class CopyJob:
    """One copy under way (see the module docstring); ``cancel`` ends it without a callback."""

    def __init__(self, steps: Steps, on_done: Callable[[Any], None], on_error: Callable[[Exception], None]) -> None:
        self.steps = steps
        self.on_done = on_done
        self.on_error = on_error
        self.ended = False

    def cancel(self) -> None:
        """End the copy now: its generator's cleanup runs (a buffer goes back), nothing is called."""
        if not self.ended:
            self.ended = True
            self.steps.close()

    def advance(self) -> None:
        """Move one slice; at the end (or on an error) mark the job ended and call back."""
        try:
            next(self.steps)
            return
        except StopIteration as done:
            self.ended = True
            _call(self.on_done, done.value)
        except (BackendError, OSError) as exc:
            self.ended = True
            _call(self.on_error, exc)
        except Exception as exc:  # a bug must not leave a tenant waiting for ever: it is told
            log.exception("a copy failed")
            self.ended = True
            _call(self.on_error, BackendError(f"the copy failed: {type(exc).__name__}: {exc}"))


def _call(callback: Callable[[Any], None], value: Any) -> None:
    """A job's callback: the loop's boundary, so an error is logged and the loop goes on."""
    try:
        callback(value)
    except Exception:
        log.exception("the end of a copy could not be handled")


class Copies:
    """The copies under way, advanced in turn by ``step`` (module docstring)."""

    def __init__(self, budget_s: float = BUDGET_S, clock: Callable[[], float] = time.perf_counter) -> None:
        self.budget_s = budget_s
        self.clock = clock
        self._jobs: collections.deque[CopyJob] = collections.deque()

    @property
    def busy(self) -> bool:
        """Whether a job is left (not cancelled): the loop then polls without waiting. O(jobs)."""
        return any(not job.ended for job in self._jobs)

    def start(self, steps: Steps, on_done: Callable[[Any], None], on_error: Callable[[Exception], None]) -> CopyJob:
        """Queue a copy; nothing moves before the next ``step``."""
        job = CopyJob(steps, on_done, on_error)
        self._jobs.append(job)
        return job

    def step(self) -> int:
        """Advance the jobs a slice each, in turn, for at least one slice and at most about
        ``budget_s``; return how many jobs ended (their callbacks ran)."""
        deadline = self.clock() + self.budget_s
        num_ended = 0
        while self._jobs:
            job = self._jobs.popleft()
            if not job.ended:
                job.advance()
            if job.ended:
                num_ended += 1
            else:
                self._jobs.append(job)
            if self.clock() >= deadline:
                break
        return num_ended

    def run_all(self) -> None:
        """Step until no job is left (tests)."""
        while self.busy:
            self.step()
