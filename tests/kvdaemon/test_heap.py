"""kvdaemon.heap: what a frozen heap keeps out of full collections, and that thawing gives it back."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from kvdaemon.heap import freeze_heap, frozen_heap, thaw_heap


class Node:
    """A container the collector tracks; two of them pointing at each other are a cycle."""

    def __init__(self) -> None:
        self.other: Node | None = None


def dropped_cycle() -> weakref.ref[Node]:
    """A two-node cycle with no reference from outside; a weak reference to one node."""
    first, second = Node(), Node()
    first.other, second.other = second, first
    return weakref.ref(first)


@pytest.fixture(autouse=True)
def thawed() -> Iterator[None]:
    """Every test starts and ends with nothing frozen (pytest's own heap included)."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_freeze_heap_moves_every_survivor_out_of_the_collected_generations() -> None:
    kept = Node()
    num_frozen = freeze_heap()
    assert num_frozen == gc.get_freeze_count() > 0
    assert not any(obj is kept for obj in gc.get_objects())  # no generation holds it now
    thaw_heap()
    assert gc.get_freeze_count() == 0
    assert any(obj is kept for obj in gc.get_objects())


def test_a_cycle_made_after_the_freeze_is_collected() -> None:
    freeze_heap()
    ref = dropped_cycle()
    gc.collect()
    assert ref() is None


def test_a_frozen_cycle_outlives_its_references_until_thawed() -> None:
    first, second = Node(), Node()
    first.other, second.other = second, first
    ref = weakref.ref(first)
    freeze_heap()
    del first, second
    gc.collect()
    assert ref() is not None  # frozen: no collection walks it
    thaw_heap()
    gc.collect()
    assert ref() is None


def test_freeze_heap_twice_adds_only_what_came_since() -> None:
    first = freeze_heap()
    made = [Node() for _ in range(100)]
    second = freeze_heap()
    assert second >= first + len(made)


def test_frozen_heap_thaws_on_exit_even_when_the_phase_raises() -> None:
    with pytest.raises(RuntimeError, match="mid-replay"):
        with frozen_heap() as num_frozen:
            assert num_frozen > 0 and gc.get_freeze_count() > 0  # frozen objects may die meanwhile
            raise RuntimeError("mid-replay")
    assert gc.get_freeze_count() == 0
