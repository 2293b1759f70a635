"""Errors on the wire: the code rebuilds the class, and ``NoMemory`` carries what would have fit."""

from __future__ import annotations

import pytest

from kvdaemon.errors import KVDaemonError, NoMemory, OverLimit, from_code
from kvdaemon.wire.protocol import decode, reply_error, result_of


def round_trip(error: KVDaemonError) -> KVDaemonError:
    with pytest.raises(KVDaemonError) as raised:
        result_of(decode(reply_error(7, error)))
    return raised.value


def test_a_refusal_brings_its_free_pages_across() -> None:
    error = round_trip(NoMemory("3 logical page(s) need 6 pages, 2 free", free_pages=1))
    assert isinstance(error, NoMemory) and error.free_pages == 1 and error.message.endswith("2 free")


def test_a_refusal_that_does_not_tell_says_none() -> None:
    error = round_trip(NoMemory("no memory"))
    assert isinstance(error, NoMemory) and error.free_pages is None
    assert "free_pages" not in decode(reply_error(7, NoMemory("no memory")))["error"]


@pytest.mark.parametrize("told", [-1, "2", 1.5, True, None, [1]])
def test_a_malformed_free_pages_is_dropped(told: object) -> None:
    error = from_code("NO_MEMORY", "no memory", {"free_pages": told})
    assert isinstance(error, NoMemory) and error.free_pages is None


def test_other_errors_carry_no_figures() -> None:
    error = round_trip(OverLimit("past its limit"))
    assert type(error) is OverLimit and error.wire_fields() == {}
    assert type(from_code("NO_SUCH_CODE", "what", {"free_pages": 3})) is KVDaemonError
