"""The ``kvdaemon`` command line (DESIGN.md §13).

Every command takes ``--dir`` and ``--config``; every command that prints
takes ``--json`` (one JSON object on stdout, errors too: ``kvdaemon.cli.output``).
Exit statuses are those of ``kvdaemon.cli.exit_codes``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from kvdaemon.cli import detach, lifecycle, reach, status_view, top_live, top_view
from kvdaemon.cli.options import (
    JsonAwareCommand, SizeParam, command_help, config_option, daemon_dir, daemon_options,
    dir_option, json_option,
)  # fmt: skip
from kvdaemon.cli.output import emit, reporting
from kvdaemon.cli.tenant_wait import wait_for_tenants
from kvdaemon.cli.versions import version_text, versions
from kvdaemon.daemon.config import BACKENDS, LOG_LEVELS, load_config
from kvdaemon.errors import BadRequest, DaemonUnreachable, UnknownTenant
from kvdaemon.wire.sizes import SizeSpec, format_bytes

PIPE_WIDTH = 200
TOP_STATUS_TIMEOUT_S = 2.0  # a hung daemon freezes `top` at most this long per refresh
SLEEP_TIMEOUT_S = 60.0


def _stdout_console() -> Console:
    """A console on stdout; piped output is not cut to 80 columns, so long
    tenant names stay greppable."""
    return Console(highlight=False, width=None if sys.stdout.isatty() else PIPE_WIDTH)


def _show_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(version_text(versions(None), with_daemon=False))
        ctx.exit()


class _Group(click.Group):
    command_class = JsonAwareCommand


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"],
                                           "max_content_width": 100})  # fmt: skip
@click.option("--version", is_flag=True, expose_value=False, is_eager=True,
              callback=_show_version, help="Show the versions (as `kvdaemon version`) and exit.")
def main() -> None:
    """kvdaemon: elastic, multi-tenant KV-cache memory for LLM serving.

    One daemon per device owns the memory for KV caches; engines (tenants)
    register with it and map pages only while they need them. Shell
    completion: eval "$(_KVDAEMON_COMPLETE=bash_source kvdaemon)" (zsh_source,
    fish_source for other shells).
    """


@main.command(
    short_help="Start the daemon (detached, or --foreground).",
    epilog=command_help("""
kvdaemon start --capacity 40GiB --metrics-address 127.0.0.1:9400
kvdaemon start --foreground --config /etc/kvdaemon/kvdaemon.toml   # under systemd
"""),
)
@daemon_options
@click.option("--backend", type=click.Choice(BACKENDS, case_sensitive=False),
              help="Memory backend [default: auto: cuda where a GPU is usable, else host].")
@click.option("--device", type=int, metavar="N", help="CUDA device index [default: 0].")
@click.option("--capacity", metavar="SIZE",
              help="Pool size: bytes, 40GiB, or 90% of the device (host: of RAM) [default: 50%].")
@click.option("--page-size", metavar="SIZE", help="Physical page size [default: 2MiB].")
@click.option("--metrics-address", metavar="HOST:PORT",
              help="Serve Prometheus metrics and /healthz there (0.0.0.0:9400 for all "
                   "interfaces) [default: off].")
@click.option("--metrics-port", metavar="PORT", help="Short for --metrics-address 127.0.0.1:PORT.")
@click.option("--idle-sleep", metavar="SECONDS",
              help="Sleep tenants idle this long (300, 300s, 5m, off) [default: off].")
@click.option("--idle-mode", type=click.Choice(("warm", "cold"), case_sensitive=False),
              help="How idle tenants sleep [default: warm].")
@click.option("--reclaim-sleep/--no-reclaim-sleep", default=None,
              help="Warm-sleep an idle tenant when a grow cannot be served otherwise "
                   "[default: on].")
@click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False),
              help="Logging level [default: INFO].")
@click.option("--log-file", metavar="PATH",
              help="Append the log there; logrotate may rename it (reopened by itself or on "
                   "SIGHUP) [default: DIR/kvdaemon.log when detached, none with --foreground].")
@click.option("--foreground", is_flag=True,
              help="Run in this process until stopped, logging to stderr (and --log-file).")
@reporting
def start(dir_flag: Path | None, config_file: Path | None, as_json: bool, foreground: bool,
          **settings: Any) -> None:  # fmt: skip
    """Start the daemon: detached by default, returning once it accepts clients.

    --foreground runs it in this process until SIGTERM, SIGINT or `kvdaemon
    stop`, and tells systemd READY=1 / STOPPING=1 when $NOTIFY_SOCKET is set.
    Settings: flags, then KVDAEMON_* variables (KVDAEMON_PAGE_SIZE for
    --page-size), then the --config file (page-size = "64KiB").
    """
    flags = {"dir": dir_flag, **{key.replace("_", "-"): value for key, value in settings.items()}}
    config = load_config(flags, os.environ, config_file)
    if foreground:
        raise click.exceptions.Exit(lifecycle.run_foreground(config))
    pid = detach.start_detached(config)
    with reach.talking(config.dir) as client:
        info = client.hello()
    result = {
        "dir": str(config.dir), "pid": pid, "version": info.get("daemon_version"),
        "backend": info["backend"], "device": info.get("device"),
        "capacity_bytes": info["capacity_bytes"], "page_size": info["page_size"],
        "log_file": str(config.log_file or config.paths.log_file),
        "metrics_address": config.metrics_address,
    }  # fmt: skip
    emit(as_json, result, (
        f"kvdaemon running at {config.dir} (pid {pid}, backend {info['backend']}, "
        f"capacity {format_bytes(info['capacity_bytes'])})"
    ))  # fmt: skip


@main.command(
    short_help="Stop the daemon gracefully; a no-op when none runs.",
    epilog=command_help("kvdaemon stop && echo stopped"),
)
@daemon_options
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0.1), default=30.0,
              show_default=True, metavar="SECONDS", help="How long to wait for it to exit.")
@reporting
def stop(dir_flag: Path | None, config_file: Path | None, as_json: bool, timeout_s: float) -> None:
    """Stop the daemon gracefully and return once it has exited.

    Tenants are told and keep what they have mapped. With no daemon running it
    says so and exits 0. A daemon that runs but does not answer is sent
    SIGTERM.
    """
    root = daemon_dir(dir_flag, config_file)
    stopped = reach.stop(root, timeout_s)
    if stopped.pid is None:
        text = f"no kvdaemon running at {root}; nothing to stop"
    elif stopped.signalled:
        text = f"kvdaemon at {root} did not answer; stopped it with SIGTERM (pid {stopped.pid})"
    else:
        text = f"kvdaemon at {root} stopped (pid {stopped.pid})"
    result = {"dir": str(root), "pid": stopped.pid, "stopped": stopped.pid is not None,
              "signalled": stopped.signalled}  # fmt: skip
    emit(as_json, result, text)


@main.command(
    short_help="Show capacity, free memory and the tenants (all, or those named).",
    epilog=command_help("kvdaemon status\nkvdaemon status llama-a --json | jq .tenants[0].mapped_bytes"),
)
@click.argument("names", nargs=-1, metavar="[NAME]...")
@daemon_options
@reporting
def status(names: tuple[str, ...], dir_flag: Path | None, config_file: Path | None,
           as_json: bool) -> None:  # fmt: skip
    """Show capacity, free memory and every tenant, or only the tenants NAME...

    A NAME that is not registered is an error (UNKNOWN_TENANT, exit 3).
    --json prints the daemon's status object with its tenants filtered.
    """
    root = daemon_dir(dir_flag, config_file)
    with reach.talking(root) as client:
        snapshot = client.status()
    if names:
        snapshot = {**snapshot, "tenants": _only(snapshot["tenants"], names)}
    if as_json:
        emit(True, {"dir": str(root), **snapshot}, "")
        return
    status_view.render(_stdout_console(), root, snapshot)


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


def _tenant(client: Any, name: str) -> dict[str, Any]:
    return _only(client.status()["tenants"], (name,))[0]


@main.command(
    short_help="Change a tenant's limit, guarantee or weight.",
    epilog=command_help("kvdaemon limit llama-a --max 8GiB --min 1GiB\nkvdaemon limit qwen-b --max 40%"),
)
@click.argument("name")
@click.option("--max", "max_size", type=SizeParam(),
              help="Limit: bytes, 8GiB, or a percentage of the daemon's capacity.")
@click.option("--min", "min_size", type=SizeParam(),
              help="Guarantee: bytes, 1GiB, or a percentage of the daemon's capacity.")
@click.option("--weight", type=click.FloatRange(min=0, min_open=True),
              help="Share of contended memory, relative to other tenants.")
@daemon_options
@reporting
def limit(name: str, max_size: SizeSpec | None, min_size: SizeSpec | None,
          weight: float | None, dir_flag: Path | None, config_file: Path | None,
          as_json: bool) -> None:  # fmt: skip
    """Change a tenant's limit, guarantee or weight; takes effect at once.

    A percentage is of the daemon's capacity. A tenant above a lowered limit
    gives pages back; until it has, `status` and `top` show what it owes.
    """
    if max_size is None and min_size is None and weight is None:
        raise click.UsageError("give at least one of --max, --min, --weight")
    root = daemon_dir(dir_flag, config_file)
    with reach.talking(root) as client:
        capacity_bytes = int(client.hello()["capacity_bytes"])
        applied = client.set_limit(
            name,
            max_bytes=None if max_size is None else max_size.resolve(capacity_bytes),
            min_bytes=None if min_size is None else min_size.resolve(capacity_bytes),
            weight=weight,
        )
        row = _tenant(client, name)
    revision = applied.get("revision")
    cells = dict(zip(status_view.COLUMNS, status_view.tenant_row(row)))
    result = {"name": name, "revision": revision, "max_bytes": row.get("max_bytes"),
              "min_bytes": row.get("min_bytes"), "weight": row.get("weight")}  # fmt: skip
    emit(as_json, result, (
        f"{name}: limit {cells['limit']}, min {cells['min']}, weight {cells['weight']} "
        f"(revision {revision})"
    ))  # fmt: skip


@main.command(
    short_help="Put a tenant to sleep: its pages go back to the pool.",
    epilog=command_help("kvdaemon sleep llama-a\nkvdaemon sleep llama-a --cold"),
)
@click.argument("name")
@click.option("--cold", is_flag=True, help="Drop the KV instead of keeping it in host memory.")
@daemon_options
@reporting
def sleep(name: str, cold: bool, dir_flag: Path | None, config_file: Path | None,
          as_json: bool) -> None:  # fmt: skip
    """Put a tenant to sleep: its pages go back to the pool. Returns once it sleeps.

    Warm (the default) keeps its KV in host memory and restores it on wake at
    the same addresses; --cold drops it. A tenant already asleep that way is
    left as it is (exit 0). An engine that registered with auto-wake (as the
    transformers Engine does) wakes again at its next step with work.
    """
    mode = "cold" if cold else "warm"
    with reach.talking(daemon_dir(dir_flag, config_file)) as client:
        row = _tenant(client, name)
        if row["state"] == f"sleeping-{mode}":
            result = {"name": name, "state": row["state"], "changed": False,
                      "host_bytes": int(row.get("host_bytes", 0))}  # fmt: skip
            emit(as_json, result, f"{name}: already {row['state']}; nothing to do")
            return
        slept = client.sleep(name, mode, timeout_s=SLEEP_TIMEOUT_S)
    result = {"name": name, "state": slept["state"], "changed": True,
              "host_bytes": int(slept.get("host_bytes", 0))}  # fmt: skip
    kept = "" if cold else f", {format_bytes(result['host_bytes'])} kept in host memory"
    emit(as_json, result, f"{name}: {slept['state']}{kept}")


@main.command(
    short_help="Wake a sleeping tenant; a no-op for an awake one.",
    epilog=command_help("kvdaemon wake llama-a"),
)
@click.argument("name")
@daemon_options
@reporting
def wake(name: str, dir_flag: Path | None, config_file: Path | None, as_json: bool) -> None:
    """Wake a sleeping tenant: fresh pages at the same addresses, KV restored if warm.

    A tenant already awake is left as it is (exit 0, "already active").
    """
    with reach.talking(daemon_dir(dir_flag, config_file)) as client:
        row = _tenant(client, name)
        woke: dict[str, Any] | None = None
        if row["state"] != "active":
            try:
                woke = client.wake(name, timeout_s=SLEEP_TIMEOUT_S)
            except BadRequest:  # woken meanwhile (auto-wake)? then there is nothing to do
                row = _tenant(client, name)
                if row["state"] != "active":
                    raise
    if woke is None:
        result = {"name": name, "state": row["state"], "changed": False,
                  "mapped_bytes": int(row["mapped_bytes"])}  # fmt: skip
        emit(as_json, result, f"{name}: already {row['state']}; nothing to do")
        return
    result = {"name": name, "state": woke["state"], "changed": True,
              "mapped_bytes": int(woke["mapped_bytes"])}  # fmt: skip
    emit(as_json, result, f"{name}: {woke['state']}, {format_bytes(result['mapped_bytes'])} mapped")


@main.command(
    "wait",
    short_help="Wait until tenants have registered (or are in a state, or idle).",
    epilog=command_help("""
kvdaemon wait llama-a qwen-b --timeout 120
kvdaemon sleep llama-a && kvdaemon wait llama-a --state active   # until its engine wakes it
kvdaemon wait llama-a --idle 300 && kvdaemon sleep llama-a
"""),
)
@click.argument("names", nargs=-1, required=True, metavar="NAME...")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0), default=60.0,
              show_default=True, metavar="SECONDS", help="Give up after this long (exit 5).")
@click.option("--idle", "idle_s", type=click.FloatRange(min=0), metavar="SECONDS",
              help="Also wait until each has gone this long without its blocks changing.")
@click.option("--state", type=click.Choice(("active", "sleeping-warm", "sleeping-cold")),
              help="Also wait until each is in this state.")
@daemon_options
@reporting
def wait_command(names: tuple[str, ...], timeout_s: float, idle_s: float | None,
                 state: str | None, dir_flag: Path | None, config_file: Path | None,
                 as_json: bool) -> None:  # fmt: skip
    """Wait until every tenant NAME has registered with the daemon (and, with
    --state, is in that state; with --idle, has been idle that long).

    Exits 0 once they have, 5 (TIMEOUT) if they have not within --timeout,
    1 when no daemon runs.
    """
    root = daemon_dir(dir_flag, config_file)
    with reach.talking(root) as client:
        result = wait_for_tenants(client, list(dict.fromkeys(names)), timeout_s, idle_s, state)
    what = "registered" if state is None else state
    idle = f" and idle for {idle_s:g} s" if idle_s is not None else ""
    emit(as_json, result, f"{', '.join(dict.fromkeys(names))}: {what}{idle} "
                          f"(waited {result['waited_s']:.1f} s)")  # fmt: skip


@main.command(
    short_help="Show versions: kvdaemon, Python, torch, CUDA, driver, backend.",
    epilog=command_help("kvdaemon version --json"),
)
@daemon_options
@reporting
def version(dir_flag: Path | None, config_file: Path | None, as_json: bool) -> None:
    """Show the versions of kvdaemon, Python, torch, cuda-bindings and the NVIDIA
    driver, the backend, and the daemon running at the directory (if one answers).

    torch is not imported: its installed version is read.
    """
    root = daemon_dir(dir_flag, config_file)
    try:
        with reach.talking(root, timeout_s=1.0) as client:
            daemon: dict[str, Any] | None = client.hello()
    except DaemonUnreachable:  # none running, or not answering: report this install alone
        daemon = None
    info = versions(daemon)
    emit(as_json, info, version_text(info))


@main.command(
    short_help="Live view of every tenant; q quits.",
    epilog=command_help("kvdaemon top --sort idle\nkvdaemon top --once | grep llama"),
)
@dir_option
@config_option
@click.option("--once", is_flag=True, help="Print one frame and exit (also when stdout is no TTY).")
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              metavar="SECONDS", help="Seconds between refreshes.")
@click.option("--sort", type=click.Choice(tuple(top_view.SORTS)), default="mapped",
              show_default=True, help="Order of the tenants (keys m, u, n, i, s change it live).")
@reporting
def top(dir_flag: Path | None, config_file: Path | None, once: bool, interval: float,
        sort: str) -> None:  # fmt: skip
    """Live view of capacity, free memory and every tenant: state in words, sizes,
    a bar of mapped against the limit, idle time, and what a tenant over a lowered
    limit still owes. q or Ctrl-C quits; m, u, n, i, s sort.

    Exits 1 when no daemon answers at the start; a daemon that goes away
    later is shown as unreachable and polled until it is back.
    """
    root = daemon_dir(dir_flag, config_file)
    with reach.talking(root, timeout_s=TOP_STATUS_TIMEOUT_S) as client:
        snapshot = client.status()
        if once or not sys.stdout.isatty():
            _stdout_console().print(top_view.frame(root, snapshot, sort=sort))
            return
        try:
            top_live.run_live(client, root, snapshot, interval, sort)
        except KeyboardInterrupt:
            pass  # Ctrl-C is the other way to quit; the terminal is restored by then

