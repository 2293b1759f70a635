"""The ``kvdaemon`` command line (DESIGN.md §13): the group, and the commands about the
daemon itself (``start``, ``stop``, ``version``, ``top``); the tenant commands are
``kvdaemon.cli.tenant_commands``.

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

from kvdaemon.cli import detach, lifecycle, log_tail, reach, tenant_commands, top_live, top_view
from kvdaemon.cli.options import (
    JsonAwareCommand, SecondsParam, command_help, daemon_dir, daemon_options,
)  # fmt: skip
from kvdaemon.cli.exit_codes import (
    EXIT_DAEMON_ERROR, EXIT_NOT_ANSWERING, EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE, statuses,
)  # fmt: skip
from kvdaemon.cli.output import emit, fail_usage, reporting
from kvdaemon.cli.tenant_commands import stdout_console
from kvdaemon.cli.versions import version_text, versions
from kvdaemon.daemon.config import load_config
from kvdaemon.daemon.config_values import BACKENDS, LOG_LEVELS
from kvdaemon.errors import ConfigError, DaemonUnreachable
from kvdaemon.wire.sizes import format_bytes

TOP_STATUS_TIMEOUT_S = 2.0  # a hung daemon freezes `top` at most this long per refresh

START_STATUSES = statuses(
    EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE, EXIT_DAEMON_ERROR, EXIT_NOT_ANSWERING, s0="started, and it accepts clients",
    s1="it started, then was gone at once", s4="it started, then stopped answering at once",
    s3="it did not start: one runs there already (CONFLICT), or it failed (its error code is printed)",
)
VERSION_STATUSES = statuses(EXIT_OK, EXIT_USAGE, s0="done (with no daemon running too: it says so)")
TOP_STATUSES = statuses(EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE, EXIT_DAEMON_ERROR, EXIT_NOT_ANSWERING)
LOGS_STATUSES = statuses(EXIT_OK, EXIT_USAGE, s2="usage or configuration error, or no log file there")


def _show_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(version_text(versions(None), with_daemon=False))
        ctx.exit()


class _Group(click.Group):
    """The ``kvdaemon`` group: ``kvdaemon --json CMD ...`` is ``kvdaemon CMD ... --json``
    (the flag is every printing command's; the group has none of its own)."""

    command_class = JsonAwareCommand

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        head = 0
        while head < len(args) and args[head].startswith("-") and args[head] != "--json":
            head += 1  # the group's own flags (--help, --version) before the command
        if head < len(args) and args[head] == "--json" and head + 1 < len(args) \
                and not args[head + 1].startswith("-"):
            args = [*args[:head], *args[head + 1:], "--json"]
        ctx.meta["kvdaemon.json"] = "--json" in args
        return super().parse_args(ctx, args)

    def resolve_command(self, ctx: click.Context, args: list[str]) -> Any:
        """As click's; an unknown command with ``--json`` among the arguments is a ``USAGE``
        JSON error (exit 2), as a bad flag of a known one is."""
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as err:
            if ctx.meta.get("kvdaemon.json"):
                fail_usage(err.format_message(), as_json=True)
            raise


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
""", START_STATUSES),
)
@daemon_options
@click.option("--backend", type=click.Choice(BACKENDS, case_sensitive=False),
              help="Memory backend [default: auto: cuda where a GPU is usable, else host].")
@click.option("--device", type=int, metavar="N",
              help="CUDA device index [default: 0]. A nonzero one that is not usable is an error "
                   "(auto does not fall back to host memory for it); host is device 0 alone.")
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
@click.option("--warm-memory", metavar="SIZE",
              help="Host memory the KV of warm sleepers may take: bytes, 64GiB, or 50% of RAM (or of the "
                   "cgroup's memory limit); past it "
                   "a warm sleep asked of the daemon is refused and its own sleeps go cold "
                   "[default: 50%].")
@click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False),
              help="Logging level [default: INFO].")
@click.option("--log-file", metavar="PATH",
              help="Append the log there; logrotate may rename it (reopened by itself or on "
                   "SIGHUP) [default: DIR/kvdaemon.log when detached, none with --foreground].")
@click.option("--foreground", is_flag=True,
              help="Run in this process until stopped, logging to stderr (and --log-file).")
@click.option("--tenant-policy", multiple=True, hidden=True,
              help="A [tenants.NAME] policy as JSON (how a detached start hands them on).")
@reporting
def start(dir_flag: Path | None, config_file: Path | None, as_json: bool, foreground: bool,
          **settings: Any) -> None:  # fmt: skip
    """Start the daemon: detached by default, returning once it accepts clients.

    --foreground runs it in this process until SIGTERM, SIGINT or `kvdaemon
    stop`, and tells systemd READY=1 / STOPPING=1 when $NOTIFY_SOCKET is set
    (with --json it prints one JSON object once ready).
    Settings: flags, then KVDAEMON_* variables (KVDAEMON_PAGE_SIZE for
    --page-size), then the --config file (page-size = "64KiB"), whose
    [tenants.NAME] tables set limits for tenants before they register.
    """
    flags = {"dir": dir_flag, **{key.replace("_", "-"): value for key, value in settings.items()}}
    config = load_config(flags, os.environ, config_file)
    if foreground:
        raise click.exceptions.Exit(lifecycle.run_foreground(config, ready_json=as_json))
    pid = detach.start_detached(config)
    with reach.talking(config.dir) as client:
        info = client.hello()
        warnings = [str(w) for w in client.status().get("warnings", [])]  # what its policies cannot give
    wanted, capacity = config.capacity.exact_bytes, format_bytes(info["capacity_bytes"])
    result = {
        "dir": str(config.dir), "pid": pid, "version": info.get("daemon_version"),
        "backend": info["backend"], "device": info.get("device"),
        "capacity_bytes": info["capacity_bytes"], "capacity_asked_bytes": wanted, "page_size": info["page_size"],
        "log_file": str(config.log_file or config.paths.log_file),
        "metrics_address": config.metrics_address,
        "metrics_url": f"http://{config.metrics_address}/metrics" if config.metrics_address else None,
        "warnings": warnings,
    }  # fmt: skip
    rounded = ""
    if wanted is not None and wanted != info["capacity_bytes"]:
        asked = format_bytes(wanted)
        if asked == capacity:  # too close to tell apart rounded: say the bytes
            asked, capacity = f"{wanted} B", f"{capacity} ({info['capacity_bytes']} B)"
        rounded = f"; the {asked} asked, rounded down to whole {format_bytes(info['page_size'])} pages"
    metrics = f", metrics http://{config.metrics_address}/metrics" if config.metrics_port else ""
    emit(as_json, result, "\n".join([
        f"kvdaemon running at {config.dir} (pid {pid}, backend {info['backend']}, capacity {capacity}{rounded}"
        f"{metrics})", *(f"warning: {warning}" for warning in warnings),
    ]))  # fmt: skip


STOP_STATUSES = (
    "Exit status: 0 stopped, or none was running; 2 usage or configuration error; 3 it did not "
    "exit within --timeout; 4 a daemon runs but does not answer and could not be signalled."
)


@main.command(
    short_help="Stop the daemon gracefully; a no-op when none runs.",
    epilog=command_help("kvdaemon stop && echo 'none runs there now'", STOP_STATUSES),
)
@daemon_options
@click.option("--timeout", "timeout_s", type=SecondsParam(min=0.1), default=30.0,
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
    if stopped.dropped_warm:
        names = ", ".join(f"{t['name']} ({format_bytes(int(t['host_bytes']))})" for t in stopped.dropped_warm)
        wakes = "it wakes" if len(stopped.dropped_warm) == 1 else "they wake"
        text += f"; the warm KV of {names} died with it: {wakes} with an empty cache"
    result = {"dir": str(root), "pid": stopped.pid, "stopped": stopped.pid is not None,
              "signalled": stopped.signalled, "dropped_warm": list(stopped.dropped_warm)}  # fmt: skip
    emit(as_json, result, text)


@main.command(
    short_help="Show versions: kvdaemon, Python, torch, CUDA, driver, backend.",
    epilog=command_help("kvdaemon version --json", VERSION_STATUSES),
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
    except (DaemonUnreachable, ConfigError):  # none running or answering, or no usable dir
        daemon = None
    info = versions(daemon)
    emit(as_json, info, version_text(info))


@main.command(
    short_help="Live view of every tenant; q quits.",
    epilog=command_help("kvdaemon top --sort idle\nkvdaemon top --once | grep llama", TOP_STATUSES),
)
@daemon_options
@click.option("--once", is_flag=True, help="Print one frame and exit (also when stdout is no TTY).")
@click.option("--interval", type=SecondsParam(min=0.1), default=1.0, show_default=True,
              metavar="SECONDS", help="Seconds between refreshes.")
@click.option("--sort", type=click.Choice(tuple(top_view.SORTS)), default="mapped",
              show_default=True, help="Order of the tenants (keys m, u, n, i, s change it live).")
@reporting
def top(dir_flag: Path | None, config_file: Path | None, as_json: bool, once: bool, interval: float,
        sort: str) -> None:  # fmt: skip
    """Live view of capacity, free memory and every tenant: state in words, sizes,
    a bar of mapped against the limit, idle time, and what a tenant over a lowered
    limit still owes. q or Ctrl-C quits; m, u, n, i, s sort.

    Exits 1 when no daemon answers at the start; a daemon that goes away
    later is shown as unreachable and polled until it is back. --json prints
    one frame's data, the status object (as `status --json`), and exits.
    """
    root = daemon_dir(dir_flag, config_file)
    with reach.talking(root, timeout_s=TOP_STATUS_TIMEOUT_S) as client:
        snapshot = client.status()
        if as_json:
            emit(True, {"dir": str(root), **snapshot}, "")
            return
        if once or not sys.stdout.isatty():
            stdout_console().print(top_view.frame(root, snapshot, sort=sort))
            return
        try:
            top_live.run_live(client, root, snapshot, interval, sort)
        except KeyboardInterrupt:
            pass  # Ctrl-C is the other way to quit; the terminal is restored by then


@main.command(
    short_help="Show the daemon's log: its last lines, or follow it.",
    epilog=command_help("kvdaemon logs -n 100\nkvdaemon logs --follow | grep llama-a", LOGS_STATUSES),
)
@daemon_options
@click.option("-n", "--lines", "num_lines", type=click.IntRange(0, log_tail.MAX_LINES), default=40,
              show_default=True, help="How many of the last lines to show.")
@click.option("-f", "--follow", "follow_log", is_flag=True,
              help="Then print what the daemon logs next, across log rotations, until Ctrl-C.")
@click.option("--log-file", type=click.Path(dir_okay=False, path_type=Path), metavar="PATH",
              help="The file the daemon was started with --log-file (also KVDAEMON_LOG_FILE, the config file).")
@reporting
def logs(dir_flag: Path | None, config_file: Path | None, as_json: bool, num_lines: int,
         follow_log: bool, log_file: Path | None) -> None:  # fmt: skip
    """Print the last lines of the log of the daemon at the directory: the file
    --log-file names (the flag, KVDAEMON_LOG_FILE, the config file: as given to
    `start`), else kvdaemon.log in the directory. It needs no daemon running.
    --json prints {"log_file", "lines"}.
    """
    if as_json and follow_log:
        fail_usage("--follow prints lines as they come: it does not go with --json", as_json)
    config = load_config({"dir": dir_flag, "log-file": log_file}, os.environ, config_file)
    path = config.log_file or config.paths.log_file
    fd = log_tail.open_log(path)
    lines, size = log_tail.last_lines(fd, num_lines)
    if as_json:
        os.close(fd)
        emit(True, {"log_file": str(path), "lines": lines}, "")
        return
    for line in lines:
        click.echo(line)
    if not follow_log:
        os.close(fd)
        return
    try:
        for line in log_tail.follow(path, fd, size):
            click.echo(line)
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a follow ends


for _command in tenant_commands.COMMANDS:
    main.add_command(_command)
