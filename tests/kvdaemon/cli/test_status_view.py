"""kvdaemon.cli.status_view: the table of ``kvdaemon status``."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from kvdaemon.cli import status_view

MiB = 1024 * 1024


def make_tenant(**overrides: Any) -> dict[str, Any]:
    tenant = {
        "name": "llama-a", "pid": 4242, "state": "active", "mapped_bytes": 1536 * MiB,
        "used_bytes": 512 * MiB, "max_bytes": 8192 * MiB, "min_bytes": 0, "weight": 1.0,
        "idle_seconds": 185.4,
    }  # fmt: skip
    tenant.update(overrides)
    return tenant


def make_status(tenants: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "backend": "host", "page_size": 2 * MiB, "capacity_bytes": 4096 * MiB,
        "free_bytes": 1024 * MiB, "tenants": tenants,
    }  # fmt: skip


def rendered(status: dict[str, Any]) -> str:
    out = io.StringIO()
    status_view.render(Console(file=out, width=200, color_system=None), Path("/tmp/kvd"), status)
    return out.getvalue()


def test_tenant_row() -> None:
    assert status_view.tenant_row(make_tenant()) == [
        "llama-a", "4242", "active", "1.50 GiB", "512.0 MiB", "8.00 GiB", "0 B", "1", "3m05s",
    ]  # fmt: skip
    unlimited = status_view.tenant_row(make_tenant(max_bytes=None, weight=2.5))
    assert unlimited[5:8] == ["none", "0 B", "2.5"]


@pytest.mark.parametrize(
    ("seconds", "text"), [(0, "0s"), (0.9, "0s"), (59.9, "59s"), (60, "1m00s"), (3725, "1h02m")]
)
def test_format_duration(seconds: float, text: str) -> None:
    assert status_view.format_duration(seconds) == text


def test_render_summary_and_rows() -> None:
    sleeper = make_tenant(name="[bold]x", pid=7, state="sleeping-warm")
    text = rendered(make_status([make_tenant(), sleeper]))
    lines = text.splitlines()
    assert lines[0] == (
        "kvdaemon at /tmp/kvd: backend host, capacity 4.00 GiB, free 1.00 GiB (25%), "
        "page 2.00 MiB, 2 tenant(s)"
    )
    assert lines[1].split() == [
        "name", "pid", "state", "mapped", "in", "use", "limit", "min", "weight", "idle",
    ]  # fmt: skip
    assert lines[2].split()[:3] == ["llama-a", "4242", "active"]
    assert lines[3].split()[:3] == ["[bold]x", "7", "sleeping-warm"]  # names are not markup


def test_render_without_tenants() -> None:
    text = rendered(make_status([]))
    assert text.splitlines()[1] == "no tenants registered"


def test_a_tenant_over_its_limit_shows_what_it_owes() -> None:
    over = make_tenant(name="over", mapped_bytes=3072 * MiB, max_bytes=2048 * MiB)
    text = rendered(make_status([make_tenant(), over]))
    lines = text.splitlines()
    assert lines[1].split()[-1] == "owes"
    assert lines[2].split()[-1] == "-"  # under its limit
    assert lines[3].split()[-2:] == ["1.00", "GiB"]  # 3 GiB mapped, limit lowered to 2 GiB
    assert status_view.owed_bytes(over) == 1024 * MiB
    assert status_view.owed_bytes(make_tenant(max_bytes=None)) == 0


def test_no_owes_column_while_every_tenant_is_within_its_limit() -> None:
    assert "owes" not in rendered(make_status([make_tenant()]))
