"""The Python heap of a long-running serving process, frozen once start-up is done.

CPython's oldest generation keeps every container object that outlived two
young collections. After importing torch and transformers and building three
small models it holds ~370,000 of them, and a full collection walks them all:
~170 ms on a 2-core VM. Such a collection comes when the allocation count says
so, wherever the process happens to be; in an engine process that is often
inside a forward, and every request waiting then takes the pause into its TTFT
(one multitenant replay's p99 went from ~45 ms to ~240 ms on one of them).

``freeze_heap`` collects once, then moves every survivor into the permanent
generation, which no collection walks: later full collections see only what
serving created (a few ms). Frozen objects are still freed by reference
counting; only a cycle among them outlives its last reference, until
``thaw_heap``. vLLM freezes its engine process's heap after start-up for the
same reason; the daemon freezes its own once it serves (``kvdaemon start``),
and an engine that runs over kvdaemon's pools should call ``freeze_heap`` after
its models are built and warmed up.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


def freeze_heap() -> int:
    """Collect every generation, then freeze all that survives; return the number of objects frozen.

    Cost: one full collection (~170 ms with torch, transformers and a model
    loaded on a 2-core VM; ~5 ms in the daemon). A second call adds only
    what was created since the first.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw_heap() -> None:
    """Return every frozen object to the oldest generation, for the next full collection to walk."""
    gc.unfreeze()


@contextmanager
def frozen_heap() -> Iterator[int]:
    """``freeze_heap`` on entry (yielding the number frozen), ``thaw_heap`` on exit, however it exits.

    For a bounded phase, such as one benchmark replay: each one starts with the
    same collector state (nothing pending in the oldest generation), whatever
    the phases before it allocated.
    """
    num_frozen = freeze_heap()
    try:
        yield num_frozen
    finally:
        thaw_heap()
