"""Decoding is bounded in cost, not only in bytes: containers and items are counted."""

from __future__ import annotations

import pytest

from kvdaemon.errors import BadRequest
from kvdaemon.wire.protocol import (
    MAX_LIST_LEN, MAX_MESSAGE_BYTES, MAX_REQUEST_LIST_LEN, REQUEST_LIMITS, DecodeLimits, decode, encode,
    request,
)


def status_with(payload: object) -> bytes:
    """A status request carrying ``payload``: just under the byte cap for the costly ones."""
    data = encode({"id": 1, "op": "status", "args": {"x": payload}})
    assert len(data) <= MAX_MESSAGE_BYTES
    return data


N = MAX_REQUEST_LIST_LEN  # the longest array a request may hold
COSTLY: list[tuple[str, object, str]] = [
    ("a million empty arrays", [[[]] * N] * 120, "arrays and maps"),
    ("a million empty maps", [[{}] * N] * 120, "arrays and maps"),
    ("a million small ints", [[0] * N] * 120, "items"),
    ("a million empty strings", [[""] * N] * 120, "items"),
]


@pytest.mark.parametrize("payload, what", [c[1:] for c in COSTLY], ids=[c[0] for c in COSTLY])
def test_a_costly_request_is_refused(payload: object, what: str) -> None:
    with pytest.raises(BadRequest, match=f"too complex: more than .* {what}"):
        decode(status_with(payload), REQUEST_LIMITS)


def test_a_request_list_past_its_length_is_refused_at_its_header() -> None:
    args = {"tenant": "a", "token": "x" * 32, "logical_pages": list(range(MAX_REQUEST_LIST_LEN))}
    assert decode(request(3, "grow", args), REQUEST_LIMITS)["args"] == args
    args["logical_pages"] = list(range(MAX_LIST_LEN))  # as the daemon took before: ~5 ms to decode
    with pytest.raises(BadRequest, match=f"65536 exceeds max_array_len\\({MAX_REQUEST_LIST_LEN}\\)"):
        decode(request(3, "grow", args), REQUEST_LIMITS)


def test_a_grant_reply_of_65536_pages_decodes_with_the_default_limits() -> None:
    result = {"grant_id": 1, "pages": [[lp, [2 * lp, 2 * lp + 1]] for lp in range(MAX_LIST_LEN)]}
    reply = encode({"id": 1, "ok": True, "result": result})
    assert decode(reply)["result"] == result
    with pytest.raises(BadRequest, match="exceeds max_array_len"):  # ... but not as a request
        decode(reply, REQUEST_LIMITS)


def test_containers_and_items_are_counted_exactly() -> None:
    nested = encode({"a": [[], []]})  # 4 containers, 2 + 2 items
    assert decode(nested, DecodeLimits(max_containers=4, max_items=4)) == {"a": [[], []]}
    with pytest.raises(BadRequest, match="more than 3 arrays and maps"):
        decode(nested, DecodeLimits(max_containers=3, max_items=4))
    with pytest.raises(BadRequest, match="more than 3 items"):
        decode(nested, DecodeLimits(max_containers=4, max_items=3))


def test_a_message_no_longer_than_the_limits_is_never_refused_for_them() -> None:
    limits = DecodeLimits(max_containers=8, max_items=8)
    small = encode({"a": [1]})
    assert limits.admit_all(len(small))
    assert decode(small, limits) == {"a": [1]}
    assert not limits.admit_all(9)
