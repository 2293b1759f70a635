"""The ``kvdaemon`` command line (DESIGN.md §13).

Exit codes: 0 ok, 1 no daemon answers at the directory, 2 usage or
configuration error, 3 the daemon (or starting it) failed with an error,
printed as ``error CODE: message``.
"""

from __future__ import annotations

import functools
import json
import os
import select
import sys
import termios
import time
import tty
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, TypeVar

import click
from rich.console import Console
from rich.live import Live

from kvdaemon import __version__
from kvdaemon.cli import lifecycle, status_view, top_view
from kvdaemon.client import KVClient
from kvdaemon.daemon.config import BACKENDS, LOG_LEVELS, dir_from, load_config
from kvdaemon.errors import ConfigError, DaemonUnreachable, KVDaemonError
from kvdaemon.wire.paths import DaemonPaths
from kvdaemon.wire.sizes import SizeSpec, format_bytes, parse_size

EXIT_UNREACHABLE = 1
EXIT_USAGE = 2
EXIT_DAEMON_ERROR = 3
PIPE_WIDTH = 200
TOP_STATUS_TIMEOUT_S = 2.0  # a hung daemon freezes `top` at most this long per refresh
QUIT_KEYS = b"qQ"

F = TypeVar("F", bound=Callable[..., Any])


class SizeParam(click.ParamType):
    """A size option: bytes, ``512MiB``, ``2GiB``, ``40%`` (see ``kvdaemon.wire.sizes``)."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, SizeSpec):
            return value
        try:
            return parse_size(value)
        except ConfigError as err:
            self.fail(err.message, param, ctx)


def _reporting_errors(command: F) -> F:
    """Turn kvdaemon errors into a one-line message on stderr and the exit codes above."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except DaemonUnreachable as err:
            click.echo(err.message, err=True)
            raise click.exceptions.Exit(EXIT_UNREACHABLE) from err
        except ConfigError as err:
            click.echo(f"error {err.code}: {err.message}", err=True)
            raise click.exceptions.Exit(EXIT_USAGE) from err
        except KVDaemonError as err:
            click.echo(f"error {err.code}: {err.message}", err=True)
            raise click.exceptions.Exit(EXIT_DAEMON_ERROR) from err

    return run  # type: ignore[return-value]


def _dir_option(command: F) -> F:
    return click.option(
        "--dir",
        "dir_flag",
        type=click.Path(file_okay=False, path_type=Path),
        help="Daemon directory [default: $KVDAEMON_DIR, else /tmp/kvdaemon-$UID].",
    )(command)


def _daemon_dir(dir_flag: Path | None) -> Path:
    return dir_from(dir_flag, os.environ)


def _stdout_console() -> Console:
    """A console on stdout; piped output is not cut to 80 columns, so long
    tenant names stay greppable."""
    return Console(highlight=False, width=None if sys.stdout.isatty() else PIPE_WIDTH)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvdaemon")
def main() -> None:
    """kvdaemon: elastic, multi-tenant KV-cache memory for LLM serving."""


@main.command()
@_dir_option
@click.option("--backend", type=click.Choice(BACKENDS, case_sensitive=False),
              help="Memory backend [default: auto: cuda where a GPU is usable, else host].")
@click.option("--device", type=int, metavar="N", help="CUDA device index [default: 0].")
@click.option("--capacity", metavar="SIZE",
              help="Pool size: bytes, 40GiB, or 90% of the device (host: of RAM) [default: 50%].")
@click.option("--page-size", metavar="SIZE", help="Physical page size [default: 2MiB].")
@click.option("--metrics-port", type=int, metavar="PORT",
              help="Serve Prometheus metrics on 127.0.0.1:PORT.")
@click.option("--idle-sleep", metavar="SECONDS",
              help="Sleep tenants idle this long (300, 300s, 5m, off).")
@click.option("--idle-mode", type=click.Choice(("warm", "cold"), case_sensitive=False),
              help="How idle tenants sleep [default: warm].")
@click.option("--reclaim-sleep/--no-reclaim-sleep", default=None,
              help="Warm-sleep an idle tenant when a grow cannot be served otherwise "
                   "[default: on].")
@click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False),
              help="Logging level [default: INFO].")
@click.option("--config", "config_file", type=click.Path(dir_okay=False, path_type=Path),
              help="TOML file of settings (flags and KVDAEMON_* variables override it).")
@click.option("--foreground", is_flag=True, help="Run in this process until stopped.")
@_reporting_errors
def start(dir_flag: Path | None, config_file: Path | None, foreground: bool,
          **settings: Any) -> None:  # fmt: skip
    """Start the daemon (returns once it accepts clients).

    Detached by default; --foreground runs it in this process until stopped.
    """
    flags = {"dir": dir_flag, **settings}
    config = load_config(flags, os.environ, config_file)
    if foreground:
        raise click.exceptions.Exit(lifecycle.run_foreground(config))
    pid = lifecycle.start_detached(config)
    with lifecycle.connect(config.dir) as client:
        info = client.hello()
    click.echo(
        f"kvdaemon running at {config.dir} (pid {pid}, backend {info['backend']}, "
        f"capacity {format_bytes(info['capacity_bytes'])})"
    )


@main.command()
@_dir_option
@_reporting_errors
def stop(dir_flag: Path | None) -> None:
    """Stop the daemon gracefully; returns once it has exited."""
    root = _daemon_dir(dir_flag)
    pid = lifecycle.stop(root)
    click.echo(f"kvdaemon at {root} stopped (pid {pid})")


@main.command()
@_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print the status object as JSON.")
@_reporting_errors
def status(dir_flag: Path | None, as_json: bool) -> None:
    """Show capacity, free memory and every tenant."""
    root = _daemon_dir(dir_flag)
    with lifecycle.connect(root) as client:
        snapshot = client.status()
    if as_json:
        click.echo(json.dumps(snapshot, indent=2))
        return
    status_view.render(_stdout_console(), root, snapshot)


@main.command()
@click.argument("name")
@click.option("--max", "max_size", type=SizeParam(),
              help="Limit: bytes, 8GiB, or a percentage of the daemon's capacity.")
@click.option("--min", "min_size", type=SizeParam(),
              help="Guarantee: bytes, 1GiB, or a percentage of the daemon's capacity.")
@click.option("--weight", type=click.FloatRange(min=0, min_open=True),
              help="Share of contended memory, relative to other tenants.")
@_dir_option
@_reporting_errors
def limit(name: str, max_size: SizeSpec | None, min_size: SizeSpec | None,
          weight: float | None, dir_flag: Path | None) -> None:  # fmt: skip
    """Change a tenant's limit, guarantee or weight.

    Takes effect at once. A percentage is of the daemon's capacity.
    """
    if max_size is None and min_size is None and weight is None:
        raise click.UsageError("give at least one of --max, --min, --weight")
    root = _daemon_dir(dir_flag)
    with lifecycle.connect(root) as client:
        capacity_bytes = int(client.hello()["capacity_bytes"])
        result = client.set_limit(
            name,
            max_bytes=None if max_size is None else max_size.resolve(capacity_bytes),
            min_bytes=None if min_size is None else min_size.resolve(capacity_bytes),
            weight=weight,
        )
        tenants = client.status()["tenants"]
    click.echo(_limit_summary(name, result, tenants))


def _limit_summary(name: str, result: dict[str, Any], tenants: list[dict[str, Any]]) -> str:
    revision = result.get("revision")
    for tenant in tenants:
        if tenant["name"] == name:
            cells = dict(zip(status_view.COLUMNS, status_view.tenant_row(tenant)))
            return (
                f"{name}: limit {cells['limit']}, min {cells['min']}, weight {cells['weight']} "
                f"(revision {revision})"
            )
    return f"{name}: limits applied (revision {revision})"


@main.command()
@click.argument("name")
@click.option("--cold", is_flag=True, help="Drop the KV instead of keeping it in host memory.")
@_dir_option
@_reporting_errors
def sleep(name: str, cold: bool, dir_flag: Path | None) -> None:
    """Put a tenant to sleep: its pages go back to the pool.

    Warm (the default) keeps its KV in host memory and restores it on wake at
    the same addresses; --cold drops it. Returns once the tenant sleeps.
    """
    with lifecycle.connect(_daemon_dir(dir_flag)) as client:
        result = client.sleep(name, "cold" if cold else "warm")
    kept = f", {format_bytes(int(result['host_bytes']))} kept in host memory" if not cold else ""
    click.echo(f"{name}: {result['state']}{kept}")


@main.command()
@click.argument("name")
@_dir_option
@_reporting_errors
def wake(name: str, dir_flag: Path | None) -> None:
    """Wake a sleeping tenant: fresh pages at the same addresses, KV restored if warm."""
    with lifecycle.connect(_daemon_dir(dir_flag)) as client:
        result = client.wake(name)
    click.echo(f"{name}: {result['state']}, {format_bytes(int(result['mapped_bytes']))} mapped")


@main.command()
@_dir_option
@click.option("--once", is_flag=True, help="Print one frame and exit.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              metavar="SECONDS", help="Seconds between refreshes.")
@_reporting_errors
def top(dir_flag: Path | None, once: bool, interval: float) -> None:
    """Live view of capacity, free memory and every tenant; q or Ctrl-C quits.

    Exits 1 when no daemon answers at the start; a daemon that goes away
    later is shown as unreachable and polled until it is back.
    """
    root = _daemon_dir(dir_flag)
    with lifecycle.connect(root, timeout_s=TOP_STATUS_TIMEOUT_S) as client:
        snapshot = client.status()
        if once:
            _stdout_console().print(top_view.frame(root, snapshot))
            return
        try:
            _live_top(client, root, snapshot, interval)
        except KeyboardInterrupt:
            pass  # Ctrl-C is the other way to quit; the terminal is restored by then


def _live_top(client: KVClient, root: Path, first: dict[str, Any], interval: float) -> None:
    """Redraw a frame every ``interval`` seconds until ``q`` is read from a TTY stdin.

    The terminal's settings are restored on every way out, Ctrl-C included.
    """
    footer = f"every {interval:g}s · q or Ctrl-C quits"
    with _keys(sys.stdin) as keys_fd, Live(
        top_view.frame(root, first, footer), console=Console(highlight=False),
        auto_refresh=False,
    ) as live:  # fmt: skip
        while not _quit_pressed(keys_fd, interval):
            live.update(top_view.frame(root, _poll_status(client, root), footer), refresh=True)


@contextmanager
def _keys(stream: IO[str] | None) -> Iterator[int | None]:
    """Yield the fd to read keys from, in cbreak mode, when ``stream`` is a TTY (else None).

    The TTY's settings are restored on exit, however the block ends.
    """
    if stream is None or not stream.isatty():
        yield None
        return
    fd = stream.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd, termios.TCSANOW)  # TCSANOW keeps a key typed early
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _quit_pressed(keys_fd: int | None, timeout_s: float) -> bool:
    """Wait ``timeout_s`` for a quit key; True as soon as one (or the TTY's end) is read.

    Other keys are ignored without ending the wait early. Without a keys fd,
    just sleeps and returns False.
    """
    if keys_fd is None:
        time.sleep(timeout_s)
        return False
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([keys_fd], [], [], left)
        if not ready:
            return False
        data = os.read(keys_fd, 64)
        if not data or any(key in QUIT_KEYS for key in data):
            return True
    return False


def _poll_status(client: KVClient, root: Path) -> dict[str, Any] | None:
    """The daemon's status object, or None when no daemon runs or answers at ``root``.

    A daemon found dead by its lock costs no timeout; a hung one costs at most
    the client's timeout. The client reconnects by itself to a new daemon.
    """
    if lifecycle.running_pid(DaemonPaths(root)) is None:
        return None
    try:
        return client.status()
    except DaemonUnreachable:
        return None
