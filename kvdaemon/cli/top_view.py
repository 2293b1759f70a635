"""The frame of ``kvdaemon top``: the status object as one rich renderable.

Takes the status object of DESIGN.md §13 (what ``KVClient.status()``
returns) and builds the summary line and tenant cells of
``kvdaemon.cli.status_view``, plus bars: the capacity mapped by tenants, and per
tenant its mapped bytes against its limit (against the capacity when it has
none) and its share of the capacity. Pure: builds renderables, prints
nothing, reads no clock; O(tenants).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvdaemon.cli import status_view

BAR_WIDTH = 20
FILLED, EMPTY = "█", "░"
UNREACHABLE = "daemon unreachable"


def frame(dir: Path, status: dict[str, Any] | None, footer: str | None = None) -> RenderableType:
    """One screen of ``kvdaemon top``.

    With a status: the ``status`` summary line, a bar of the capacity mapped
    by tenants, then one row per tenant in the order given (or ``no tenants
    registered``). With ``None`` (no daemon answered): one line saying
    ``daemon unreachable``. ``footer``, when given, is the last line.
    """
    parts: list[RenderableType] = []
    if status is None:
        parts.append(Text(f"kvdaemon at {dir}: {UNREACHABLE}, retrying", style="bold red"))
    else:
        parts.append(Text(status_view.summary_line(dir, status)))
        parts.append(capacity_line(status))
        parts.append(tenant_table(status) if status["tenants"] else Text("no tenants registered"))
    if footer:
        parts.append(Text(footer, style="dim"))
    return Group(*parts)


def capacity_line(status: dict[str, Any]) -> Text:
    """``mapped ████░░… 25%``: the share of the capacity that is not free."""
    capacity = status["capacity_bytes"]
    return Text.assemble("mapped ", usage_bar(capacity - status["free_bytes"], capacity))


def tenant_table(status: dict[str, Any]) -> Table:
    """The ``status`` table of the tenants plus two columns: ``of limit`` (a bar of
    mapped bytes against the limit, or the capacity where there is none) and
    ``of capacity`` (mapped bytes as a percentage of the capacity)."""
    table = status_view.tenant_table([])  # its columns; the rows are added here
    table.add_column("of limit", no_wrap=True)
    table.add_column("of capacity", justify="right", no_wrap=True)
    capacity = status["capacity_bytes"]
    for tenant in status["tenants"]:
        limit = tenant.get("max_bytes")
        mapped = tenant["mapped_bytes"]
        cells = [Text(cell) for cell in status_view.tenant_row(tenant)]  # names are not markup
        bar = usage_bar(mapped, capacity if limit is None else limit)
        table.add_row(*cells, bar, Text(percent(mapped, capacity)))
    return table


def usage_bar(used: int, total: int, width: int = BAR_WIDTH) -> Text:
    """``width`` cells, the share ``used / total`` of them filled, then that share in %.

    Anything used fills at least one cell; at or over the total (a limit
    lowered under what is mapped) the bar is full and red. A zero total
    counts as full once anything is used.
    """
    ratio = _ratio(used, total)
    filled = min(width, max(round(width * ratio), 1 if used > 0 else 0))
    style = "red" if ratio >= 1 else "yellow" if ratio >= 0.8 else "green"
    return Text.assemble(
        (FILLED * filled, style), (EMPTY * (width - filled), "dim"), f" {percent(used, total):>4}"
    )


def percent(used: int, total: int) -> str:
    """``used / total`` as a whole percentage (``0%``, ``37%``, ``150%``); see ``usage_bar``."""
    return f"{100 * _ratio(used, total):.0f}%"


def _ratio(used: int, total: int) -> float:
    if total > 0:
        return used / total
    return 1.0 if used > 0 else 0.0
