"""The human-readable rendering of ``kvdaemon status``.

Takes the status object of DESIGN.md §13 (what ``KVClient.status()``
returns) and renders a summary line plus one table row per tenant, sizes in
binary units. Pure apart from writing to the given console; O(tenants).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvdaemon.wire.sizes import format_bytes

COLUMNS = ("name", "pid", "state", "mapped", "in use", "limit", "min", "weight", "idle")
NUMERIC = {"pid", "mapped", "in use", "limit", "min", "weight", "idle"}


def summary_line(dir: Path, status: dict[str, Any]) -> str:
    """``kvdaemon at DIR: backend host, capacity 1.00 GiB, free 512.0 MiB (50%), ...``."""
    capacity, free = status["capacity_bytes"], status["free_bytes"]
    share = f"{100 * free / capacity:.0f}%" if capacity else "-"
    return (
        f"kvdaemon at {dir}: backend {status['backend']}, "
        f"capacity {format_bytes(capacity)}, free {format_bytes(free)} ({share}), "
        f"page {format_bytes(status['page_size'])}, {len(status['tenants'])} tenant(s)"
    )


def tenant_table(tenants: list[dict[str, Any]]) -> Table:
    """One row per tenant, in the order given, with the columns of ``COLUMNS``; plus an
    ``owes`` column (bytes mapped above the limit) when some tenant is over its limit."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in COLUMNS:
        table.add_column(column, justify="right" if column in NUMERIC else "left", no_wrap=True)
    any_over = any(owed_bytes(tenant) for tenant in tenants)
    if any_over:
        table.add_column("owes", justify="right", no_wrap=True)
    for tenant in tenants:
        cells = [Text(cell) for cell in tenant_row(tenant)]  # names are not markup
        if any_over:
            owed = owed_bytes(tenant)
            cells.append(Text(format_bytes(owed), style="bold red") if owed else Text("-"))
        table.add_row(*cells)
    return table


def owed_bytes(tenant: dict[str, Any]) -> int:
    """Bytes mapped above the tenant's limit (0 without a limit or under it): what a
    limit lowered under its mapping still has to take back."""
    limit = tenant.get("max_bytes")
    return 0 if limit is None else max(0, int(tenant["mapped_bytes"]) - int(limit))


def tenant_row(tenant: dict[str, Any]) -> list[str]:
    """The cells of one tenant's row, in ``COLUMNS`` order."""
    limit = tenant.get("max_bytes")
    return [
        str(tenant["name"]),
        str(tenant["pid"]),
        str(tenant["state"]),
        format_bytes(tenant["mapped_bytes"]),
        format_bytes(tenant["used_bytes"]),
        "none" if limit is None else format_bytes(limit),
        format_bytes(tenant["min_bytes"]),
        f"{tenant['weight']:g}",
        format_duration(tenant["idle_seconds"]),
    ]


def format_duration(seconds: float) -> str:
    """``0s``, ``42s``, ``3m05s``, ``2h07m``: whole seconds, two units at most."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def render(console: Console, dir: Path, status: dict[str, Any]) -> None:
    """Print the summary line, then the tenant table (or a note that there are none)."""
    console.print(Text(summary_line(dir, status)), highlight=False, soft_wrap=True)
    if status["tenants"]:
        console.print(tenant_table(status["tenants"]))
    else:
        console.print("no tenants registered", highlight=False)
