"""The frame of ``kvdaemon top``: the status object as one rich renderable, fit for 80 columns.

Takes the status object of DESIGN.md §13 (what ``KVClient.status()``
returns) and builds two header lines (where, backend, page, tenants; capacity,
free and a bar of the mapped share), one row per tenant and a help line. A
row shows the tenant's state in words (``active*``: it cannot be slept, its
engine has no quiesce hook; a legend line says so), its sizes in at most six
characters, a short bar and the share of mapped bytes against its limit
(against the capacity without one), its idle time, what it owes (the bytes it
maps above a limit lowered under it, in red; ``-`` when none) and how many of
its grows were refused. A frame is laid out when printed: names get what the
console's width leaves beside the other columns (which fit 80) and only longer
ones are cut, and a console that cannot print the bars' glyphs gets ASCII
ones. Pure: builds renderables, prints nothing, reads no clock; O(tenants log
tenants).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.table import Table
from rich.text import Text

from kvdaemon.cli.status_view import (
    SILENT_S, cannot_sleep, fits_unicode, format_duration, is_silent, name_width, owed_bytes, refused_lately,
    state_words,
)  # fmt: skip
from kvdaemon.wire.sizes import format_bytes, format_bytes_short

BAR_WIDTH = 20
ROW_BAR_WIDTH = 3
NAME_WIDTH = 14  # the least a name gets
GLYPHS = {True: ("█", "░", "·"), False: ("#", ".", "|")}  # filled, empty, separator; by fits_unicode
UNREACHABLE = "daemon unreachable"
NO_SLEEP_MARK = "*"
NO_SLEEP_LEGEND = "* cannot be slept: its engine has no quiesce hook"
SILENT_MARK = "?"
SILENT_LEGEND = f"? silent {SILENT_S:g} s or more (pools tell the daemon every 5 s): stopped or hung?"

# sort key name -> (key letter, function of a tenant, descending?)
SORTS: dict[str, tuple[str, Callable[[dict[str, Any]], Any], bool]] = {
    "mapped": ("m", lambda t: t["mapped_bytes"], True),
    "used": ("u", lambda t: t["used_bytes"], True),
    "name": ("n", lambda t: str(t["name"]), False),
    "idle": ("i", lambda t: t["idle_seconds"], True),
    "state": ("s", lambda t: str(t["state"]), False),
}
SORT_KEYS = {letter: name for name, (letter, _, _) in SORTS.items()}


def frame(
    dir: Path,  # noqa: A002
    status: dict[str, Any] | None,
    footer: str | None = None,
    sort: str = "mapped",
) -> RenderableType:
    """One screen of ``kvdaemon top``: header, tenants sorted by ``sort``, then ``footer``,
    laid out for the console it is printed on (see the module docstring).

    With ``None`` (no daemon answered): one line saying ``daemon unreachable``.
    """
    return _Frame(dir, status, footer, sort)


class _Frame:
    """``frame``'s renderable: built at print time from the console's width and encoding."""

    def __init__(self, dir: Path, status: dict[str, Any] | None, footer: str | None, sort: str) -> None:  # noqa: A002
        self.dir, self.status, self.footer, self.sort = dir, status, footer, sort

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield layout(self.dir, self.status, self.footer, self.sort, options.max_width,
                     fits_unicode(console.encoding))  # fmt: skip


def layout(
    dir: Path,  # noqa: A002
    status: dict[str, Any] | None,
    footer: str | None,
    sort: str,
    width: int = 80,
    unicode: bool = True,
) -> RenderableType:
    """``frame`` for a console ``width`` wide that prints ``unicode`` glyphs or not."""
    parts: list[RenderableType] = []
    if status is None:
        parts.append(Text(f"kvdaemon at {dir}: {UNREACHABLE}, retrying", style="bold red"))
    else:
        parts.extend(header(dir, status, unicode))
        tenants = sorted_tenants(status["tenants"], sort)
        table = tenant_table(status, tenants, width, unicode)
        parts.append(table if tenants else Text("no tenants registered"))
        if any(cannot_sleep(tenant) for tenant in tenants):
            parts.append(Text(NO_SLEEP_LEGEND, style="dim"))
        if any(is_silent(tenant) for tenant in tenants):
            parts.append(Text(SILENT_LEGEND, style="dim"))
    if footer:
        parts.append(Text(footer if unicode else footer.replace(GLYPHS[True][2], GLYPHS[False][2]), style="dim"))
    return Group(*parts)


def help_line(sort: str, interval_s: float) -> str:
    """``q quit · sort by m mapped, u in use, n name, i idle, s state [mapped] · 1s``."""
    keys = ", ".join(f"{letter} {_column(name)}" for name, (letter, _, _) in SORTS.items())
    return f"q quit · sort by {keys} [{_column(sort)}] · {interval_s:g}s"


def _column(sort: str) -> str:
    return "in use" if sort == "used" else sort


def header(dir: Path, status: dict[str, Any], unicode: bool = True) -> list[Text]:  # noqa: A002
    """Where and what (directory, backend, page, tenants), then capacity, free and the bar."""
    capacity, free = status["capacity_bytes"], status["free_bytes"]
    num_tenants = len(status["tenants"])
    dot = GLYPHS[unicode][2]
    return [
        Text(
            f"kvdaemon at {dir} {dot} backend {status['backend']} {dot} "
            f"page {format_bytes(status['page_size'])} {dot} {num_tenants} tenant(s)"
        ),
        Text.assemble(
            f"capacity {format_bytes(capacity)} {dot} free {format_bytes(free)} {dot} mapped ",
            usage_bar(capacity - free, capacity, unicode=unicode),
        ),
    ]


def sorted_tenants(tenants: list[dict[str, Any]], sort: str) -> list[dict[str, Any]]:
    """``tenants`` ordered by the ``SORTS`` key ``sort`` (ties by name); ``ValueError`` if unknown."""
    if sort not in SORTS:
        raise ValueError(f"unknown sort key {sort!r}; choose one of {', '.join(SORTS)}")
    _, key, descending = SORTS[sort]
    by_name = sorted(tenants, key=lambda t: str(t["name"]))
    return sorted(by_name, key=key, reverse=descending)


def tenant_table(
    status: dict[str, Any], tenants: list[dict[str, Any]], width: int = 80, unicode: bool = True,
) -> Table:
    """One row per tenant of ``tenants``, in that order, for a console ``width`` wide."""
    table = Table(box=None, pad_edge=False, padding=(0, 1), collapse_padding=True,
                  header_style="bold")  # fmt: skip
    table.add_column("name", max_width=name_width(width, NAME_WIDTH, 80 - NAME_WIDTH),
                     overflow="ellipsis" if unicode else "crop", no_wrap=True)  # fmt: skip
    table.add_column("state", no_wrap=True)
    for column in ("mapped", "in use", "limit"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("% of limit", no_wrap=True)
    table.add_column("idle", justify="right", no_wrap=True)
    table.add_column("owes", justify="right", no_wrap=True)
    table.add_column("refused", justify="right", no_wrap=True)
    capacity = status["capacity_bytes"]
    for tenant in tenants:
        limit = tenant.get("max_bytes")
        mapped = int(tenant["mapped_bytes"])
        owed = owed_bytes(tenant)
        refused = int(tenant.get("refused_grows", 0))
        mark = (NO_SLEEP_MARK if cannot_sleep(tenant) else "") + (SILENT_MARK if is_silent(tenant) else "")
        table.add_row(
            Text(str(tenant["name"])),  # names are not markup
            Text(state_words(str(tenant["state"])) + mark),
            format_bytes_short(mapped),
            format_bytes_short(int(tenant["used_bytes"])),
            "none" if limit is None else format_bytes_short(int(limit)),
            usage_bar(mapped, capacity if limit is None else int(limit), width=ROW_BAR_WIDTH, unicode=unicode),
            format_duration(float(tenant["idle_seconds"])),
            Text(format_bytes_short(owed), style="bold red") if owed else Text("-", style="dim"),
            Text(str(refused), style="yellow" if refused_lately(tenant) else "") if refused
            else Text("-", style="dim"),
        )
    return table


def usage_bar(used: int, total: int, width: int = BAR_WIDTH, unicode: bool = True) -> Text:
    """``width`` cells, the share ``used / total`` of them filled, then that share in %.

    Anything used fills at least one cell; at or over the total (a limit
    lowered under what is mapped) the bar is full and red. A zero total
    counts as full once anything is used.
    """
    ratio = _ratio(used, total)
    filled = min(width, max(round(width * ratio), 1 if used > 0 else 0))
    style = "red" if ratio >= 1 else "yellow" if ratio >= 0.8 else "green"
    full, empty, _ = GLYPHS[unicode]
    return Text.assemble(
        (full * filled, style), (empty * (width - filled), "dim"), f" {percent(used, total):>4}"
    )


def percent(used: int, total: int) -> str:
    """``used / total`` as a whole percentage (``0%``, ``37%``, ``150%``); see ``usage_bar``."""
    return f"{100 * _ratio(used, total):.0f}%"


def _ratio(used: int, total: int) -> float:
    if total > 0:
        return used / total
    return 1.0 if used > 0 else 0.0
