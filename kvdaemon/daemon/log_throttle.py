"""``LogThrottle``: a repeated warning as one line and a count, not one line each.

A peer can make the daemon fail the same way thousands of times a second
(replies it never reads, connections it opens and drops). Each kind of warning
(a key) is logged at most once per ``interval_s``; the occurrences in between
are counted and reported with the next line of that kind, or by ``flush`` once
the interval has passed, so none goes uncounted and the log grows by at most
one line per kind per interval.

Cost: O(1) per warning, O(kinds) per ``flush``. Used from one thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

INTERVAL_S = 10.0


@dataclass
class _Kind:
    """One key's counts since its last line, and the last message to repeat."""

    logged_at: float
    num_total: int = 1
    num_suppressed: int = 0
    last: tuple[str, tuple[Any, ...]] = field(default=("", ()))


class LogThrottle:
    """Rate-limited warnings on ``logger``, one budget per key."""

    def __init__(
        self, logger: logging.Logger, interval_s: float = INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._clock = clock
        self._kinds: dict[str, _Kind] = {}

    def warning(self, key: str, msg: str, *args: Any, traceback: bool = False) -> None:
        """Log ``msg % args`` unless ``key`` was logged within the interval; count it either way.
        ``traceback``: the key's first line carries the exception being handled (the later ones,
        counted, do not)."""
        now = self._clock()
        kind = self._kinds.get(key)
        if kind is None:
            self._kinds[key] = _Kind(logged_at=now)
            self.logger.warning(msg, *args, exc_info=traceback)
            return
        kind.num_total += 1
        if now - kind.logged_at < self.interval_s:
            kind.num_suppressed += 1
            kind.last = (msg, args)
            return
        self._emit(kind, now, msg, args)

    def flush(self) -> None:
        """Report the counts of kinds whose interval has passed since their last line."""
        now = self._clock()
        for kind in self._kinds.values():
            if kind.num_suppressed and now - kind.logged_at >= self.interval_s:
                msg, args = kind.last
                kind.num_suppressed -= 1  # the repeated message itself is one of them
                self._emit(kind, now, msg, args)

    def count(self, key: str) -> int:
        """How many warnings of ``key`` were raised, logged or not."""
        kind = self._kinds.get(key)
        return 0 if kind is None else kind.num_total

    def _emit(self, kind: _Kind, now: float, msg: str, args: tuple[Any, ...]) -> None:
        if kind.num_suppressed:
            self.logger.warning(
                msg + " (and %d more like it in the last %.0f s)",
                *args, kind.num_suppressed, now - kind.logged_at,
            )
        else:
            self.logger.warning(msg, *args)
        kind.logged_at = now
        kind.num_suppressed = 0
