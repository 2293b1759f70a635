"""``KVClient``'s own checks: a bad timeout is refused before anything is sent."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest

from kvdaemon.client import KVClient
from kvdaemon.errors import BadRequest

from tests.conftest import RunningDaemon, running_daemon, small_spec


@pytest.fixture
def kvd() -> Iterator[RunningDaemon]:
    with running_daemon("64MiB") as running:
        yield running


BAD_TIMEOUTS = [-1, 0, math.inf, math.nan, "5", True, None]


@pytest.mark.parametrize("timeout_s", BAD_TIMEOUTS)
def test_a_client_with_a_bad_timeout_is_refused(kvd: RunningDaemon, timeout_s: object) -> None:
    with pytest.raises(BadRequest, match="timeout_s must be a positive number of seconds"):
        KVClient(kvd.dir, timeout_s=timeout_s)  # type: ignore[arg-type]


@pytest.mark.parametrize("timeout_s", BAD_TIMEOUTS[:-1])
def test_a_sleep_with_a_bad_timeout_is_refused_before_it_is_sent(kvd: RunningDaemon, timeout_s: object) -> None:
    client = kvd.client()
    pool = client.register("a", small_spec())
    other = kvd.client()
    for call in (lambda: other.sleep("a", timeout_s=timeout_s), lambda: other.wake("a", timeout_s=timeout_s),
                 lambda: other.call("status", timeout_s=timeout_s)):
        with pytest.raises(BadRequest, match="timeout_s"):
            call()  # type: ignore[no-untyped-call]
    assert [t["state"] for t in other.status()["tenants"]] == ["active"]  # no sleep went out
    pool.close()
