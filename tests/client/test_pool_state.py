"""PoolStateCell: the transitions it allows and waiting for a sleep that may be over already."""

from __future__ import annotations

import threading

import pytest

from kvdaemon.client.pool_state import PoolState, PoolStateCell


def cell_through(*states: PoolState) -> PoolStateCell:
    cell = PoolStateCell(threading.Lock())
    with cell._changed:
        for state in states:
            cell.move(state)
    return cell


def test_a_sleep_woken_from_already_counts_for_a_waiter_that_came_late() -> None:
    """`KVClient.sleep` returns once the pool slept, even if an engine's step woke it before the
    reply arrived (a wait for 'asleep now' would sit out its whole timeout)."""
    cell = cell_through(PoolState.SLEEP_PENDING, PoolState.ASLEEP_WARM, PoolState.ACTIVE)
    with cell._changed:
        assert cell.wait_slept(0, 0.0) and not cell.wait_slept(1, 0.0)
        assert not cell.wait_for(lambda state: state.asleep, 0.0)  # what the old wait asked


def test_a_refused_sleep_is_no_sleep() -> None:
    cell = cell_through(PoolState.SLEEP_PENDING, PoolState.ACTIVE)
    with cell._changed:
        assert cell.num_sleeps == 0 and not cell.wait_slept(0, 0.0)


def test_each_sleep_counts_once_and_an_ended_pool_ends_the_wait() -> None:
    cell = cell_through(PoolState.SLEEP_PENDING, PoolState.ASLEEP_WARM, PoolState.ASLEEP_COLD)
    assert cell.num_sleeps == 2  # warm, then made cold by an operator
    with cell._changed:
        assert cell.wait_slept(5, 0.0)  # asleep now
        cell.move(PoolState.CLOSED)
        assert cell.wait_slept(5, 0.0)  # ended


def test_a_transition_outside_the_table_is_a_bug() -> None:
    with pytest.raises(AssertionError):
        cell_through(PoolState.ASLEEP_WARM)
