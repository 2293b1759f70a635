"""The human-readable rendering of ``kvdaemon status``, fit for 80 columns.

Takes the status object (what ``KVClient.status()`` returns; README "status
--json") and renders two header lines (the daemon: version, directory, pid,
uptime, backend, device; the pool: capacity, free, page, tenants), one table
row per tenant (state in words, sizes in at most six characters), then a note
per tenant that needs attention: over its limit and what it still owes, grows
refused (the last within a minute), short of memory now beside its fair share, an active tenant that
cannot be slept; and the operator's policies
(``kvdaemon limit``, the config file's ``[tenants]``), with the names not
registered yet, then what they cannot give (``warnings``). Pure apart from writing to the given console; O(tenants).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvdaemon.wire.sizes import format_bytes, format_bytes_short

SILENT_S = 15.0  # three of a pool's idle heartbeats missed (``pool_agent.IDLE_HEARTBEAT_S``)
REFUSED_LATELY_S = 60.0  # a tenant's refused grows are noted while the last is this recent
COLUMNS = ("name", "pid", "state", "mapped", "in use", "limit", "min", "weight", "idle")
NUMERIC = {"pid", "mapped", "in use", "limit", "min", "weight", "idle"}
NAME_WIDTH = 16  # the least a name gets: the other columns fit 80 columns beside it
STATE_WORDS = {"active": "active", "sleeping-warm": "asleep (warm)", "sleeping-cold": "asleep (cold)"}
POLICY_FIELDS = ("max", "min", "weight")


def header_lines(dir: Path, status: dict[str, Any], num_registered: int | None = None) -> list[str]:  # noqa: A002
    """``kvdaemon 0.1.0 at DIR (pid N, up 3m05s): backend host, device 0`` and
    ``capacity 4.00 GiB, free 1.00 GiB (25%), page 2.00 MiB, 2 tenant(s)`` (``1 of 2
    tenant(s) shown`` when only some are: ``num_registered``), then what is quarantined."""
    capacity, free = status["capacity_bytes"], status["free_bytes"]
    share = f"{100 * free / capacity:.0f}%" if capacity else "-"
    version = f" {status['version']}" if status.get("version") else ""
    process = [f"pid {status['pid']}"] if status.get("pid") else []
    if status.get("uptime_seconds") is not None:
        process.append(f"up {format_duration(float(status['uptime_seconds']))}")
    where = f" ({', '.join(process)})" if process else ""
    device = f", device {status['device']}" if status.get("device") is not None else ""
    shown = len(status["tenants"])
    count = f"{shown} tenant(s)"
    if num_registered is not None and num_registered != shown:
        count = f"{shown} of {num_registered} tenant(s) shown"
    lines = [
        f"kvdaemon{version} at {dir}{where}: backend {status['backend']}{device}",
        f"capacity {format_bytes(capacity)}, free {format_bytes(free)} ({share}), "
        f"page {format_bytes(status['page_size'])}, {count}",
    ]
    device_free = status.get("device_free_bytes")
    if device_free is not None and device_free < free:
        lines.append(f"device free {format_bytes(device_free)}, under the pool's: held elsewhere (engines' "
                     "weights, or pages a tenant kept mapped after giving them back); grows past it fail")
    if status.get("quarantined_bytes"):
        lines.append(f"quarantined {format_bytes(status['quarantined_bytes'])}: pages of ended leases "
                     "whose processes may still map them, freed when those processes exit")
    if status.get("retired_bytes"):
        lines.append(f"retired {format_bytes(status['retired_bytes'])}: pages whose release failed, never "
                     "granted again (see the daemon's log); restart the daemon to get them back")
    settings = status.get("settings") or {}
    if status.get("host_bytes"):
        bound = settings.get("warm_memory_bytes")
        allowed = f" of {format_bytes(bound)} allowed" if bound is not None else ""
        lines.append(f"host memory {format_bytes(status['host_bytes'])}{allowed}: the KV of warm sleepers")
    idle_sleep_s = settings.get("idle_sleep_s")
    if idle_sleep_s is not None:
        mode = status["settings"].get("idle_mode", "warm")
        lines.append(f"idle tenants sleep {mode} after {format_duration(float(idle_sleep_s))}")
    never = int(status.get("counters", {}).get("never_attached", 0))
    if never:
        lines.append(f"{never} registration(s) dropped without ever attaching (a client that died, or a flood)")
    return lines


def name_width(console_width: int, least: int = NAME_WIDTH, rest: int = 80 - NAME_WIDTH) -> int:
    """The widest a name may be on a console ``console_width`` wide: what the other columns
    (``rest``) leave, at least ``least``. Piped output is 200 wide: no name (128 at most) is cut."""
    return max(least, console_width - rest)


def fits_unicode(encoding: str | None) -> bool:
    """Whether a console of ``encoding`` prints the bars' and separators' glyphs (else ASCII)."""
    return (encoding or "").lower().replace("-", "").startswith("utf")


def tenant_table(tenants: list[dict[str, Any]], console_width: int = 80, unicode: bool = True) -> Table:
    """One row per tenant, in the order given, with the columns of ``COLUMNS``; a name longer
    than ``name_width(console_width)`` is cut (with an ellipsis where ``unicode``)."""
    table = Table(box=None, pad_edge=False, padding=(0, 1), collapse_padding=True,
                  header_style="bold")  # fmt: skip
    for column in COLUMNS:
        table.add_column(
            column, justify="right" if column in NUMERIC else "left", no_wrap=True,
            max_width=name_width(console_width) if column == "name" else None,
            overflow="ellipsis" if unicode else "crop",
        )  # fmt: skip
    for tenant in tenants:
        table.add_row(*(Text(cell) for cell in tenant_row(tenant)))  # names are not markup
    return table


def tenant_row(tenant: dict[str, Any]) -> list[str]:
    """The cells of one tenant's row, in ``COLUMNS`` order."""
    limit = tenant.get("max_bytes")
    return [
        str(tenant["name"]),
        str(tenant["pid"]),
        state_words(str(tenant["state"])) + (f", {tenant['copying']}" if tenant.get("copying") else ""),
        format_bytes_short(int(tenant["mapped_bytes"])),
        format_bytes_short(int(tenant["used_bytes"])),
        "none" if limit is None else format_bytes_short(int(limit)),
        format_bytes_short(int(tenant["min_bytes"])),
        f"{tenant['weight']:g}",
        format_duration(float(tenant["idle_seconds"])),
    ]


def state_words(state: str) -> str:
    """``active``, ``asleep (warm)``, ``asleep (cold)``; another state with its dashes as spaces."""
    return STATE_WORDS.get(state, state.replace("-", " "))


def owed_bytes(tenant: dict[str, Any]) -> int:
    """Bytes mapped above the tenant's limit (0 without a limit or under it): what a
    limit lowered under its mapping still has to take back."""
    if "over_limit_bytes" in tenant:
        return int(tenant["over_limit_bytes"])
    limit = tenant.get("max_bytes")
    return 0 if limit is None else max(0, int(tenant["mapped_bytes"]) - int(limit))


def cannot_sleep(tenant: dict[str, Any]) -> bool:
    """An active, attached tenant whose engine cannot be quiesced: `kvdaemon sleep` is refused."""
    return tenant.get("state") == "active" and tenant.get("sleepable") is False and tenant.get("attached") is not False


def tenant_notes(tenant: dict[str, Any]) -> list[str]:
    """What needs an operator's attention about ``tenant`` (empty when nothing does)."""
    if tenant.get("attached") is False:
        return ["registered; its handle channel is not attached yet (dropped if it never is)"]
    notes = []
    owed = owed_bytes(tenant)
    if owed:
        limit = format_bytes(int(tenant["max_bytes"]))
        notes.append(f"owes {format_bytes(owed)} over its {limit} limit")
    refused = int(tenant.get("refused_grows", 0))
    if refused and refused_lately(tenant):
        ago = tenant.get("refused_seconds_ago")
        notes.append(f"{refused} grow(s) refused" + ("" if ago is None else f", the last {format_duration(ago)} ago"))
    if tenant.get("short") is True and tenant.get("fair_bytes") is not None:
        notes.append(f"short of memory now ({format_bytes(int(tenant['mapped_bytes']))} held, "
                     f"fair share {format_bytes(int(tenant['fair_bytes']))})")
    unpaid = int(tenant.get("unpaid_reclaims", 0))
    if unpaid:
        notes.append(f"gave nothing back for {unpaid} urgent reclaim ask(s) since it registered "
                     f"({format_bytes(int(tenant['mapped_bytes']))} held now): it ignores them, or all its "
                     "blocks were in use then")
    if cannot_sleep(tenant):
        notes.append("cannot be slept (no quiesce hook)")
    if is_silent(tenant):
        silent = format_duration(float(tenant["silent_seconds"]))
        notes.append(f"silent for {silent} (pools tell the daemon every 5 s): stopped or hung?")
    return notes


def refused_lately(tenant: dict[str, Any]) -> bool:
    """A grow of it was refused within ``REFUSED_LATELY_S`` (a daemon that does not say when:
    whenever one was): what needs attention now, not a count from long ago."""
    ago = tenant.get("refused_seconds_ago")
    return int(tenant.get("refused_grows", 0)) > 0 and (ago is None or float(ago) < REFUSED_LATELY_S)


def is_silent(tenant: dict[str, Any]) -> bool:
    """No request from the tenant for ``SILENT_S``: its process may be stopped or hung."""
    return float(tenant.get("silent_seconds", 0.0)) >= SILENT_S


def describe_policy(policy: dict[str, Any], capacity_bytes: int | None = None) -> str:
    """``max 40% (config), weight 2 (limit)`` from a ``status`` policy row or a
    ``limit`` reply's ``policy`` (the sources only where given); a size above
    ``capacity_bytes`` says the capacity applies instead (it is clamped when applied)."""
    sources = policy.get("sources") or {}
    parts = []
    for field in POLICY_FIELDS:
        value = policy.get(field)
        if value is None:
            continue
        if isinstance(value, str):
            shown = value  # "40%" or "none"
        elif field == "weight":
            shown = f"{value:g}"
        else:
            shown = format_bytes(int(value))
        notes = [sources[field]] if field in sources else []
        if field != "weight" and isinstance(value, int) and capacity_bytes is not None and value > capacity_bytes:
            notes.append(f"the capacity, {format_bytes(capacity_bytes)}, applies")
        parts.append(f"{field} {shown}" + (f" ({'; '.join(notes)})" if notes else ""))
    return ", ".join(parts) or "none"


def format_duration(seconds: float) -> str:
    """``0s``, ``42s``, ``3m05s``, ``2h07m``, ``3d04h``: whole seconds, two units at most."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 100 * 3600:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def render(console: Console, dir: Path, status: dict[str, Any], num_registered: int | None = None) -> None:  # noqa: A002
    """Print the header lines, the tenant table (or that there are none), the notes and
    the policies; ``num_registered``: how many tenants there are when only some are shown."""
    for line in header_lines(dir, status, num_registered):
        console.print(Text(line), highlight=False, soft_wrap=True)
    tenants = status["tenants"]
    if tenants:
        console.print(tenant_table(tenants, console.width, fits_unicode(console.encoding)))
    else:
        console.print("no tenants registered", highlight=False)
    for tenant in tenants:
        notes = tenant_notes(tenant)
        if notes:
            console.print(Text(f"{tenant['name']}: {'; '.join(notes)}"), highlight=False)
    policies = status.get("policies") or []
    if policies:
        console.print(Text("operator policies (kvdaemon limit; [tenants] of the config file):"))
    for policy in policies:
        waiting = "" if policy.get("registered") else "; not registered (applied when it registers)"
        line = f"  {policy['name']}: {describe_policy(policy, status['capacity_bytes'])}{waiting}"
        console.print(Text(line), highlight=False)
    for warning in status.get("warnings") or []:
        console.print(Text(f"warning: {warning}"), highlight=False)
