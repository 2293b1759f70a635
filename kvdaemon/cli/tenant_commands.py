"""The ``kvdaemon`` commands about tenants: ``status``, ``limit``, ``sleep``, ``wake``, ``wait``.

Each takes ``--dir``, ``--config`` and ``--json``; exit statuses are those of
``kvdaemon.cli.exit_codes``. ``kvdaemon.cli.commands`` adds them to the group.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from kvdaemon.cli import reach, status_view
from kvdaemon.cli.options import (
    JsonAwareCommand, PolicySizeParam, SecondsParam, TenantNameParam, WeightParam, command_help, daemon_dir,
    daemon_options,
)  # fmt: skip
from kvdaemon.cli.exit_codes import TALKING
from kvdaemon.cli.output import emit, reporting
from kvdaemon.cli.tenant_wait import wait_for_tenants
from kvdaemon.client import KVClient
from kvdaemon.errors import BadRequest, UnknownTenant
from kvdaemon.wire.messages import describe_clamp
from kvdaemon.wire.sizes import format_bytes

PIPE_WIDTH = 200
SLEEP_TIMEOUT_S = 60.0


def stdout_console() -> Console:
    """A console on stdout; piped output is not cut to 80 columns, so long
    tenant names stay greppable."""
    return Console(highlight=False, width=None if sys.stdout.isatty() else PIPE_WIDTH)


@click.command(
    cls=JsonAwareCommand,
    short_help="Show capacity, free memory and the tenants (all, or those named).",
    epilog=command_help("kvdaemon status\nkvdaemon status llama-a --json | jq .tenants[0].mapped_bytes", TALKING),
)
@click.argument("names", nargs=-1, metavar="[NAME]...", type=TenantNameParam())
@daemon_options
@reporting
def status(names: tuple[str, ...], dir_flag: Path | None, config_file: Path | None,
           as_json: bool) -> None:  # fmt: skip
    """Show capacity, free memory and every tenant, or only the tenants NAME...

    A NAME that is not registered is an error (UNKNOWN_TENANT, exit 3).
    --json prints the daemon's status object with its tenants and policies
    filtered; README "What status --json says" describes every field.
    """
    root = daemon_dir(dir_flag, config_file)
    with reach.talking(root) as client:
        snapshot = client.status()
    num_registered = len(snapshot["tenants"])
    if names:
        policies = [p for p in snapshot.get("policies", []) if p["name"] in names]
        snapshot = {**snapshot, "tenants": _only(snapshot["tenants"], names), "policies": policies}
    if as_json:
        emit(True, {"dir": str(root), **snapshot}, "")
        return
    status_view.render(stdout_console(), root, snapshot, num_registered)


def _only(tenants: list[dict[str, Any]], names: tuple[str, ...]) -> list[dict[str, Any]]:
    """The rows of ``names``, in that order; ``UnknownTenant`` naming any that is missing."""
    rows = {str(t["name"]): t for t in tenants}
    missing = [name for name in names if name not in rows]
    if missing:
        registered = ", ".join(sorted(rows)) or "none"
        raise UnknownTenant(
            f"no tenant named {', '.join(repr(n) for n in missing)} (registered: {registered})"
        )
    return [rows[name] for name in dict.fromkeys(names)]


def _tenant(client: KVClient, name: str) -> dict[str, Any]:
    """The status row of tenant ``name``; ``UnknownTenant`` when it is not registered."""
    return _only(client.status()["tenants"], (name,))[0]


@click.command(
    cls=JsonAwareCommand,
    short_help="Set a tenant's limit, guarantee or weight (kept across restarts).",
    epilog=command_help("""
kvdaemon limit llama-a --max 8GiB --min 1GiB
kvdaemon limit qwen-b --max 40%        # before qwen-b registers: applied when it does
kvdaemon limit qwen-b --max none       # remove the limit
kvdaemon limit qwen-b --reset          # forget what `limit` set: the config file's apply
""", TALKING),
)
@click.argument("name", type=TenantNameParam())
@click.option("--max", "max_size", type=PolicySizeParam(),
              help="Limit: bytes, 8GiB, a percentage of the daemon's capacity, or none.")
@click.option("--min", "min_size", type=PolicySizeParam(),
              help="Guarantee: bytes, 1GiB, a percentage of the daemon's capacity, or none.")
@click.option("--weight", type=WeightParam(),
              help="Share of contended memory, relative to other tenants, or none.")
@click.option("--reset", is_flag=True,
              help="Forget what `kvdaemon limit` set for NAME; its [tenants.NAME] of the "
                   "config file applies again. With --max/--min/--weight: forget, then set "
                   "those alone.")
@daemon_options
@reporting
def limit(name: str, max_size: str | None, min_size: str | None, weight: float | str | None,
          reset: bool, dir_flag: Path | None, config_file: Path | None,
          as_json: bool) -> None:  # fmt: skip
    """Set the operator's policy for tenant NAME, registered or not: its limit
    (--max), guarantee (--min) and weight. A registered tenant gets it at once;
    a name not registered yet gets it when it registers. The daemon keeps it
    across restarts (in its directory); it wins over the config file's
    [tenants.NAME]. A tenant's own request is bounded by the policy.

    A percentage is of the daemon's capacity; `none` removes that field of the
    policy (the tenant's own value applies). A limit above the capacity is
    clamped, and said so. A tenant above a lowered limit gives pages back;
    until it has, `status` and `top` show what it owes.
    """
    if max_size is None and min_size is None and weight is None and not reset:
        raise click.UsageError("give at least one of --max, --min, --weight, --reset")
    args: dict[str, Any] = {"name": name, "max": max_size, "min": min_size, "weight": weight}
    args = {key: value for key, value in args.items() if value is not None}
    if reset:
        args["reset"] = True
    root = daemon_dir(dir_flag, config_file)
    with reach.talking(root) as client:
        applied = client.call("set_limit", args)
        row = _tenant(client, name) if applied.get("registered") else None
        page_bytes = int((client.daemon_info or client.hello())["page_size"])
    result = limit_result(name, applied, row, page_bytes)
    emit(as_json, result, limit_text(result))


def limit_result(
    name: str, applied: dict[str, Any], row: dict[str, Any] | None, page_bytes: int
) -> dict[str, Any]:
    """The JSON of ``kvdaemon limit``: the tenant's limits now (``null`` until it registers),
    its policy, what was clamped, what it owes over its limit, and its logical page
    (``logical_page_bytes``: a limit under it lets the tenant map nothing; ``null`` until
    it registers)."""
    limits = applied.get("limit") or {}
    max_bytes = limits.get("max_bytes")
    logical_page_bytes = None if row is None else int(row["num_segments"]) * page_bytes
    warnings = list(applied.get("warnings", []))
    if logical_page_bytes and max_bytes is not None and max_bytes < logical_page_bytes:
        warnings.append(f"a limit under its logical page ({format_bytes(logical_page_bytes)}) lets it map "
                        "nothing; what it maps it gives back")  # fmt: skip
    return {
        "name": name, "registered": bool(applied.get("registered")),
        "revision": applied.get("revision"), "changed": bool(applied.get("changed", True)),
        "max_bytes": max_bytes, "min_bytes": limits.get("min_bytes"),
        "weight": limits.get("weight"),
        "over_limit_bytes": None if row is None else status_view.owed_bytes(row),
        "policy": applied.get("policy"), "clamped": applied.get("clamped", []),
        "warnings": warnings, "logical_page_bytes": logical_page_bytes,
    }  # fmt: skip


def limit_text(result: dict[str, Any]) -> str:
    """``llama-a: limit 8.00 GiB, min 0 B, weight 1 (revision 2)`` and what was clamped
    or is owed; for a name not registered, the policy kept for it."""
    name = result["name"]
    described = status_view.describe_policy(result["policy"] or {})
    policy = "no operator policy" if described == "none" else f"policy {described}"
    if not result["registered"]:
        kept = "kept, applied when it registers" if described != "none" else "for it"
        head = f"{name}: not registered; {policy} {kept}"
    else:
        head = (f"{name}: limit {format_bytes(result['max_bytes'])}, min "
                f"{format_bytes(result['min_bytes'])}, weight {result['weight']:g} "
                f"(revision {result['revision']}{'' if result['changed'] else ', unchanged'}; "
                f"{policy})")  # fmt: skip
    lines = [head]
    lines.extend(f"{name}: {describe_clamp(clamp)}" for clamp in result["clamped"])
    lines.extend(f"{name}: {warning}" for warning in result["warnings"])
    if result["over_limit_bytes"]:
        lines.append(f"{name}: owes {format_bytes(result['over_limit_bytes'])} over its limit; "
                     "asked to give it back")  # fmt: skip
    return "\n".join(lines)


@click.command(
    cls=JsonAwareCommand,
    short_help="Put a tenant to sleep: its pages go back to the pool.",
    epilog=command_help("kvdaemon sleep llama-a\nkvdaemon sleep llama-a --cold", TALKING),
)
@click.argument("name", type=TenantNameParam())
@click.option("--cold", is_flag=True, help="Drop the KV instead of keeping it in host memory.")
@daemon_options
@reporting
def sleep(name: str, cold: bool, dir_flag: Path | None, config_file: Path | None,
          as_json: bool) -> None:  # fmt: skip
    """Put a tenant to sleep: its pages go back to the pool. Returns once it sleeps.

    Warm (the default) keeps its KV in host memory and restores it on wake at
    the same addresses; --cold drops it. A tenant already asleep that way is
    left as it is (exit 0), and so is a cold sleeper asked to sleep warm (its KV
    is gone); --cold of a warm sleeper drops its host copy ("dropped_host_bytes").
    An engine that registered with auto-wake (as the transformers Engine does)
    wakes again at its next step with work.
    """
    mode = "cold" if cold else "warm"
    with reach.talking(daemon_dir(dir_flag, config_file)) as client:
        row = _tenant(client, name)
        before = {"state": row["state"], "host_bytes": int(row.get("host_bytes", 0)), "already": True}
        same = row["state"] == f"sleeping-{mode}"
        slept = before if same else client.sleep(name, mode, timeout_s=SLEEP_TIMEOUT_S)
    result = {"name": name, "state": slept["state"], "changed": not slept.get("already"),
              "host_bytes": int(slept.get("host_bytes", 0))}  # fmt: skip
    if not result["changed"]:
        emit(as_json, result, f"{name}: already {slept['state']}; nothing to do")
    elif row["state"] == "sleeping-warm":  # --cold of a warm sleeper: its host copy dropped
        result["dropped_host_bytes"] = before["host_bytes"]
        emit(as_json, result, f"{name}: {slept['state']} (was sleeping-warm; its host copy of "
                              f"{format_bytes(before['host_bytes'])} dropped)")  # fmt: skip
    else:
        kept = "" if cold else f", {format_bytes(result['host_bytes'])} kept in host memory"
        emit(as_json, result, f"{name}: {slept['state']}{kept}")


@click.command(
    cls=JsonAwareCommand,
    short_help="Wake a sleeping tenant; a no-op for an awake one.",
    epilog=command_help("kvdaemon wake llama-a", TALKING),
)
@click.argument("name", type=TenantNameParam())
@daemon_options
@reporting
def wake(name: str, dir_flag: Path | None, config_file: Path | None, as_json: bool) -> None:
    """Wake a sleeping tenant: fresh pages at the same addresses, KV restored if warm.

    A tenant already awake is left as it is (exit 0, "already active"); one whose
    sleep waits for its engine to quiesce has that sleep cancelled (the `kvdaemon
    sleep` waiting for it fails with CONFLICT) and stays awake.
    """
    with reach.talking(daemon_dir(dir_flag, config_file)) as client:
        row = _tenant(client, name)
        woke: dict[str, Any] | None = None
        if row["state"] != "active" or row.get("sleep_pending"):
            try:
                woke = client.wake(name, timeout_s=SLEEP_TIMEOUT_S)
            except BadRequest:  # woken meanwhile (auto-wake)? then there is nothing to do
                row = _tenant(client, name)
                if row["state"] != "active":
                    raise
    if woke is None or woke.get("already"):
        now = row if woke is None else woke
        result = {"name": name, "state": now["state"], "changed": False,
                  "mapped_bytes": int(now["mapped_bytes"]), "cancelled_sleep": False}  # fmt: skip
        emit(as_json, result, f"{name}: already {now['state']}; nothing to do")
        return
    cancelled = bool(woke.get("cancelled_sleep"))
    result = {"name": name, "state": woke["state"], "changed": True,
              "mapped_bytes": int(woke["mapped_bytes"]), "cancelled_sleep": cancelled}  # fmt: skip
    done = "its pending sleep cancelled, " if cancelled else ""
    emit(as_json, result, f"{name}: {woke['state']}, {done}{format_bytes(result['mapped_bytes'])} mapped")


@click.command(
    "wait",
    cls=JsonAwareCommand,
    short_help="Wait until tenants have registered (or are in a state, or idle).",
    epilog=command_help("""
kvdaemon wait llama-a qwen-b --timeout 120
kvdaemon sleep llama-a && kvdaemon wait llama-a --state active   # until its engine wakes it
kvdaemon wait llama-a --sleepable --idle 300 && kvdaemon sleep llama-a
"""),
)
@click.argument("names", nargs=-1, required=True, metavar="NAME...", type=TenantNameParam())
@click.option("--timeout", "timeout_s", type=SecondsParam(min=0), default=60.0,
              show_default=True, metavar="SECONDS", help="Give up after this long (exit 5).")
@click.option("--idle", "idle_s", type=SecondsParam(min=0), metavar="SECONDS",
              help="Also wait until each has gone this long without its blocks changing "
                   "(counted from registration: add --sleepable to wait for its engine too).")
@click.option("--sleepable", is_flag=True,
              help="Also wait until each one's engine can be quiesced, so `kvdaemon sleep` takes it.")
@click.option("--state", type=click.Choice(("active", "sleeping-warm", "sleeping-cold")),
              help="Also wait until each is in this state.")
@daemon_options
@reporting
def wait_command(names: tuple[str, ...], timeout_s: float, idle_s: float | None,
                 state: str | None, sleepable: bool, dir_flag: Path | None, config_file: Path | None,
                 as_json: bool) -> None:  # fmt: skip
    """Wait until every tenant NAME has registered with the daemon (and, with
    --state, is in that state; with --sleepable, its engine can be quiesced;
    with --idle, has been idle that long).

    Exits 0 once they have, 5 (TIMEOUT) if they have not within --timeout,
    1 when no daemon runs.
    """
    root = daemon_dir(dir_flag, config_file)
    with reach.talking(root) as client:
        result = wait_for_tenants(client, list(dict.fromkeys(names)), timeout_s, idle_s, state, sleepable)
    what = "registered" if state is None else state
    what += ", sleepable" if sleepable else ""
    idle = f" and idle for {idle_s:g} s" if idle_s is not None else ""
    emit(as_json, result, f"{', '.join(dict.fromkeys(names))}: {what}{idle} "
                          f"(waited {result['waited_s']:.1f} s)")  # fmt: skip


COMMANDS = (status, limit, sleep, wake, wait_command)
