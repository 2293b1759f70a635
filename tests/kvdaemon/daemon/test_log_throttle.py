"""LogThrottle: one line per kind of warning per interval, every occurrence counted."""

from __future__ import annotations

import logging
import re

import pytest

from kvdaemon.daemon.log_throttle import LogThrottle


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_throttle(caplog: pytest.LogCaptureFixture) -> tuple[LogThrottle, FakeClock]:
    caplog.set_level(logging.WARNING, logger="test.throttle")
    clock = FakeClock()
    return LogThrottle(logging.getLogger("test.throttle"), interval_s=10.0, clock=clock), clock


def accounted(caplog: pytest.LogCaptureFixture) -> int:
    """Occurrences the log lines stand for: each line, plus the 'N more' it reports."""
    total = 0
    for record in caplog.records:
        more = re.search(r"and (\d+) more like it", record.getMessage())
        total += 1 + (int(more.group(1)) if more else 0)
    return total


def test_a_burst_is_one_line_then_one_summary(caplog: pytest.LogCaptureFixture) -> None:
    throttle, clock = make_throttle(caplog)
    for i in range(1000):
        throttle.warning("reply", "could not reply to client %d", i)
    assert [r.getMessage() for r in caplog.records] == ["could not reply to client 0"]
    throttle.flush()  # the interval has not passed: nothing yet
    assert len(caplog.records) == 1
    clock.now += 10.0
    throttle.flush()
    assert caplog.records[-1].getMessage() == (
        "could not reply to client 999 (and 998 more like it in the last 10 s)"
    )
    assert accounted(caplog) == throttle.count("reply") == 1000
    throttle.flush()  # nothing left to report
    assert len(caplog.records) == 2


def test_kinds_are_throttled_apart(caplog: pytest.LogCaptureFixture) -> None:
    throttle, clock = make_throttle(caplog)
    for _ in range(5):
        throttle.warning("reply", "could not reply")
        throttle.warning("evicted", "evicted a connection")
    assert [r.getMessage() for r in caplog.records] == ["could not reply", "evicted a connection"]
    assert throttle.count("reply") == throttle.count("evicted") == 5
    assert throttle.count("other") == 0


def test_a_warning_after_the_interval_carries_the_count(caplog: pytest.LogCaptureFixture) -> None:
    throttle, clock = make_throttle(caplog)
    throttle.warning("reply", "could not reply")
    throttle.warning("reply", "could not reply")
    clock.now += 11.0
    throttle.warning("reply", "could not reply")
    assert caplog.records[-1].getMessage() == "could not reply (and 1 more like it in the last 11 s)"
    clock.now += 11.0
    throttle.warning("reply", "could not reply")  # a quiet interval: logged plainly
    assert caplog.records[-1].getMessage() == "could not reply"
    assert accounted(caplog) == throttle.count("reply") == 4
