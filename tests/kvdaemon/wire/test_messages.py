"""The notice catalogue: every notice survives its wire form, and malformed ones are refused."""

from __future__ import annotations

import pytest

from kvdaemon.errors import BadRequest
from kvdaemon.wire.messages import FreeNotice, ReclaimNotice, parse_notice


@pytest.mark.parametrize("notice", [ReclaimNotice(3), ReclaimNotice(1, urgent=False), FreeNotice(16)])
def test_a_notice_comes_back_from_its_wire_form(notice: object) -> None:
    assert parse_notice(notice.to_wire()) == notice  # type: ignore[attr-defined]


def test_a_reclaim_without_the_urgent_field_is_urgent() -> None:
    """A daemon that does not send the field asked for a real need: what cannot go is owed."""
    assert parse_notice({"notice": "reclaim", "args": {"num_pages": 2}}) == ReclaimNotice(2, urgent=True)


@pytest.mark.parametrize("body", [
    {"notice": "reclaim", "args": {"num_pages": 2, "urgent": "no"}},
    {"notice": "reclaim", "args": {"num_pages": 0}},
    {"notice": "free", "args": {"num_pages": 0}},
    {"notice": "free", "args": {"num_pages": True}},
    {"notice": "free", "args": {}},
    {"notice": "free", "args": "x"},
])
def test_a_malformed_notice_is_refused(body: dict) -> None:
    with pytest.raises(BadRequest):
        parse_notice(body)
