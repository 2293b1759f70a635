"""Copies advance in turn, a slice per job per step, and each ends exactly once."""

from __future__ import annotations

import logging
from collections.abc import Generator
from typing import Any

import pytest

from kvdaemon.daemon.copies import Copies, Pacer, run_through
from kvdaemon.errors import BackendError


def counting(log: list[str], name: str, num_slices: int, fail_at: int | None = None) -> Generator[None, None, str]:
    """A copy of ``num_slices`` slices that logs each one (and its cleanup); raises at ``fail_at``."""
    try:
        for i in range(num_slices):
            if i == fail_at:
                raise OSError(5, "Input/output error")
            log.append(f"{name}{i}")
            if i + 1 < num_slices:
                yield
    finally:
        log.append(f"{name}-cleanup")
    return f"{name}-done"


class Ends:
    """What the jobs' callbacks were called with."""

    def __init__(self) -> None:
        self.done: list[Any] = []
        self.errors: list[Exception] = []


def start(copies: Copies, steps: Generator[None, None, Any], ends: Ends) -> Any:
    return copies.start(steps, ends.done.append, ends.errors.append)


def one_slice_per_step() -> Copies:
    return Copies(budget_s=0.0)  # every step ends after its first slice


def test_jobs_move_in_turn_a_slice_each() -> None:
    copies, ends, log = one_slice_per_step(), Ends(), []
    start(copies, counting(log, "a", 3), ends)
    start(copies, counting(log, "b", 2), ends)
    assert copies.busy and log == []  # nothing moves before a step
    for _ in range(5):  # a takes three slices, b two; each step one slice (no budget)
        copies.step()
    assert log == ["a0", "b0", "a1", "b1", "b-cleanup", "a2", "a-cleanup"]
    assert ends.done == ["b-done", "a-done"] and ends.errors == [] and not copies.busy


def test_a_step_moves_what_fits_its_budget() -> None:
    copies, ends, log = Copies(budget_s=60.0), Ends(), []
    start(copies, counting(log, "a", 5), ends)
    assert copies.step() == 1  # the budget holds every slice: the job ends in one step
    assert ends.done == ["a-done"]


def test_a_failed_copy_calls_its_error_once_and_the_others_go_on() -> None:
    copies, ends, log = one_slice_per_step(), Ends(), []
    start(copies, counting(log, "a", 3, fail_at=1), ends)
    start(copies, counting(log, "b", 2), ends)
    copies.run_all()
    assert [type(e) for e in ends.errors] == [OSError] and ends.done == ["b-done"]
    assert log.count("a-cleanup") == 1


def test_a_bug_in_a_copy_is_an_error_to_its_caller_not_the_loops_end(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> Generator[None, None, None]:
        yield
        raise KeyError("no such page")

    copies, ends = one_slice_per_step(), Ends()
    start(copies, broken(), ends)
    with caplog.at_level(logging.ERROR, "kvdaemon.copies"):
        copies.run_all()
    assert isinstance(ends.errors[0], BackendError) and "KeyError" in ends.errors[0].message
    assert "a copy failed" in caplog.text


def test_a_cancelled_copy_cleans_up_at_once_and_calls_nothing() -> None:
    copies, ends, log = one_slice_per_step(), Ends(), []
    job = start(copies, counting(log, "a", 3), ends)
    copies.step()
    job.cancel()
    assert log == ["a0", "a-cleanup"]
    job.cancel()  # a second cancel is a no-op
    copies.run_all()
    assert ends.done == [] and ends.errors == [] and not copies.busy


def test_a_callback_that_fails_is_logged_and_the_loop_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    def fails(_value: object) -> None:
        raise RuntimeError("boom")

    copies, log = one_slice_per_step(), []
    copies.start(counting(log, "a", 1), fails, fails)
    ends = Ends()
    start(copies, counting(log, "b", 2), ends)
    with caplog.at_level(logging.ERROR, "kvdaemon.copies"):
        copies.run_all()
    assert ends.done == ["b-done"] and "could not be handled" in caplog.text


def test_run_through_returns_the_value() -> None:
    log: list[str] = []
    assert run_through(counting(log, "a", 3)) == "a-done" and log == ["a0", "a1", "a2", "a-cleanup"]


class WorkClock:
    """A clock that ``work`` moves by ``seconds_per_unit`` for each unit it is given."""

    def __init__(self, seconds_per_unit: float) -> None:
        self.now = 0.0
        self.seconds_per_unit = seconds_per_unit
        self.counts: list[int] = []

    def __call__(self) -> float:
        return self.now

    def work(self, first: int, count: int) -> None:
        assert first == sum(self.counts)  # slices in order, none skipped
        self.counts.append(count)
        self.now += count * self.seconds_per_unit


def test_slices_grow_to_the_most_while_the_copy_is_fast() -> None:
    clock = WorkClock(seconds_per_unit=0.0001)  # 100 units fit the budget
    steps = Pacer(max_bytes=32, unit_bytes=1, first_bytes=2, budget_s=0.01, clock=clock).run(100, clock.work)
    assert sum(1 for _ in steps) == len(clock.counts) - 1  # a step between two slices
    assert clock.counts == [2, 8, 32, 32, 26]  # four times a slice at most, then the cap, then the rest


def test_slices_shrink_to_the_budget_where_memory_is_slow() -> None:
    clock = WorkClock(seconds_per_unit=0.004)  # fresh memory: 2.5 units fit the budget
    run_through(Pacer(max_bytes=32, unit_bytes=1, first_bytes=16, budget_s=0.01, clock=clock).run(30, clock.work))
    assert clock.counts[:3] == [16, 2, 2] and sum(clock.counts) == 30


def test_a_slice_is_one_unit_at_least() -> None:
    clock = WorkClock(seconds_per_unit=1.0)
    run_through(Pacer(max_bytes=8, unit_bytes=4, first_bytes=1, budget_s=0.01, clock=clock).run(3, clock.work))
    assert clock.counts == [1, 1, 1]
