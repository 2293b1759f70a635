"""The notice catalogue: every notice survives its wire form, and malformed ones are refused."""

from __future__ import annotations

import pytest

from kvdaemon.errors import BadRequest
from kvdaemon.wire.handles import MAX_FRAME_BYTES
from kvdaemon.wire.messages import (
    MAX_WAKE_PAGES, FreeNotice, ReclaimNotice, WakeJoin, WakeNotice, checked_limit, parse_notice,
)
from kvdaemon.wire.protocol import encode


@pytest.mark.parametrize("notice", [
    ReclaimNotice(3), ReclaimNotice(1, urgent=False), ReclaimNotice(2, True, 5123.25), FreeNotice(16),
    WakeNotice("warm", 4, [7, 2], 9, 3),
    WakeNotice("cold", 0),
])
def test_a_notice_comes_back_from_its_wire_form(notice: object) -> None:
    assert parse_notice(notice.to_wire()) == notice  # type: ignore[attr-defined]


def test_a_reclaim_without_the_urgent_field_is_urgent() -> None:
    """A daemon that does not send the field asked for a real need: what cannot go is owed."""
    assert parse_notice({"notice": "reclaim", "args": {"num_pages": 2}}) == ReclaimNotice(2, urgent=True)


def test_a_reclaim_without_an_expiry_never_expires() -> None:
    """An older daemon's ask (no ``expires_at``, or nil) is answered whenever it is read."""
    for args in ({"num_pages": 2}, {"num_pages": 2, "expires_at": None}):
        assert parse_notice({"notice": "reclaim", "args": args}).expires_at is None  # type: ignore[attr-defined]


@pytest.mark.parametrize("body", [
    {"notice": "reclaim", "args": {"num_pages": 2, "urgent": "no"}},
    {"notice": "reclaim", "args": {"num_pages": 0}},
    {"notice": "reclaim", "args": {"num_pages": 2, "expires_at": "soon"}},
    {"notice": "reclaim", "args": {"num_pages": 2, "expires_at": float("nan")}},
    {"notice": "reclaim", "args": {"num_pages": 2, "expires_at": float("inf")}},
    {"notice": "reclaim", "args": {"num_pages": 2, "expires_at": True}},
    {"notice": "free", "args": {"num_pages": 0}},
    {"notice": "free", "args": {"num_pages": True}},
    {"notice": "free", "args": {}},
    {"notice": "free", "args": "x"},
    {"notice": "wake", "args": {"mode": "warm", "grant_id": 1, "logical_pages": [1, 2], "num_logical_pages": 1}},
    {"notice": "wake", "args": {"mode": "warm", "grant_id": 1, "logical_pages": [1, 1]}},
    {"notice": "wake", "args": {"mode": "warm", "grant_id": 1, "logical_pages": list(range(MAX_WAKE_PAGES + 1))}},
    {"notice": "wake", "args": {"mode": "warm", "grant_id": 1, "logical_pages": [1], "num_logical_pages": 1 << 62}},
    {"notice": "wake", "args": {"mode": "warm", "grant_id": 1, "logical_pages": [1, 2], "num_logical_pages": 3,
                                "first_index": 2}},
    {"notice": "wake", "args": {"mode": "warm", "grant_id": 1, "logical_pages": [1 << 24]}},
])
def test_a_malformed_notice_is_refused(body: dict) -> None:
    with pytest.raises(BadRequest):
        parse_notice(body)


def test_a_wake_of_any_size_goes_in_notices_that_each_fit_a_handle_frame() -> None:
    pages = list(range((1 << 24) - 3 * MAX_WAKE_PAGES, 1 << 24))[::-1]  # the largest pages a tenant has
    parts = WakeNotice.parts("warm", 7, pages)
    assert len(parts) == 3 and all(len(encode(part.to_wire())) <= MAX_FRAME_BYTES for part in parts)
    assert [(part.first_index, part.num_logical_pages) for part in parts] == [
        (0, len(pages)), (MAX_WAKE_PAGES, len(pages)), (2 * MAX_WAKE_PAGES, len(pages))]
    join = WakeJoin(parse_notice(parts[0].to_wire()))
    assert not join.complete
    for part in parts[1:]:
        join.add(parse_notice(part.to_wire()))
    assert join.complete and join.whole() == WakeNotice("warm", 7, pages)


def test_a_wake_without_pages_is_one_complete_notice() -> None:
    (part,) = WakeNotice.parts("cold", 3, [])
    assert WakeJoin(part).complete and part.logical_pages == [] and part.num_logical_pages == 0


@pytest.mark.parametrize("part", [
    WakeNotice("warm", 8, [5], 3, 1),  # another grant
    WakeNotice("cold", 7, [5], 3, 1),  # another mode
    WakeNotice("warm", 7, [5], 4, 1),  # another count
    WakeNotice("warm", 7, [1], 3, 1),  # a page named twice
    WakeNotice("warm", 7, [5], 3, 2),  # not the next part (a part skipped)
    WakeNotice("warm", 7, [5], 3, 0),  # a wake starting over
])
def test_a_wake_part_out_of_step_is_refused_and_nothing_is_added(part: WakeNotice) -> None:
    join = WakeJoin(WakeNotice("warm", 7, [1], 3))
    with pytest.raises(BadRequest):
        join.add(part)
    assert join.pages == [1] and not join.complete


def test_a_wake_cannot_start_with_a_later_part() -> None:
    with pytest.raises(BadRequest):
        WakeJoin(WakeNotice("warm", 7, [5], 3, 1))


def test_a_replys_limit_map_is_checked_as_a_limit_notices_fields_are() -> None:
    assert checked_limit({"max_bytes": 8, "min_bytes": 0, "weight": 1.0, "revision": 3}) == {
        "max_bytes": 8, "revision": 3}
    assert checked_limit({"max_bytes": 8}) == {"max_bytes": 8, "revision": 0}  # a daemon's first limits
    for wrong in ({"max_bytes": "lots"}, {"max_bytes": -5}, {"max_bytes": True}, {"max_bytes": 8, "revision": 1 << 80},
                  {"max_bytes": 8, "revision": False}, {"max_bytes": 8, "revision": None}, {"revision": 1}, [8], None):
        assert checked_limit(wrong) is None, wrong
