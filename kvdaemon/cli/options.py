"""Options every command shares (``--dir``, ``--config``, ``--json``), the size type,
and the command class that reports usage errors as JSON under ``--json``."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from kvdaemon.cli.exit_codes import EPILOG
from kvdaemon.cli.output import fail_usage
from kvdaemon.daemon.config import dir_from
from kvdaemon.daemon.policies import MAX_WEIGHT, MIN_WEIGHT
from kvdaemon.daemon.tenant import check_name
from kvdaemon.errors import BadRequest, ConfigError
from kvdaemon.wire.sizes import SizeSpec, parse_size

F = TypeVar("F", bound=Callable[..., Any])

DIR_HELP = (
    "Daemon directory [default: $KVDAEMON_DIR, else /run/kvdaemon as root, else "
    "$XDG_RUNTIME_DIR/kvdaemon, else /tmp/kvdaemon-$UID]."
)
CONFIG_HELP = "TOML file of settings, keys spelled like the flags [env: KVDAEMON_CONFIG]."
JSON_HELP = "Print one JSON object (errors too: {\"error\": {\"code\", \"message\"}})."


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


class PolicySizeParam(SizeParam):
    """A policy's size: as ``SizeParam``, or ``none``; converted to the text the daemon reads."""

    name = "size|none"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and value.strip().lower() == "none":
            return "none"
        return str(super().convert(value, param, ctx))


class WeightParam(click.ParamType):
    """A policy's weight: a number in [1e-6, 1e6], or ``none``."""

    name = "weight|none"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and value.strip().lower() == "none":
            return "none"
        try:
            weight = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number or none", param, ctx)
        if not MIN_WEIGHT <= weight <= MAX_WEIGHT:
            self.fail(f"{value!r} is not in [{MIN_WEIGHT:g}, {MAX_WEIGHT:g}]", param, ctx)
        return weight


class TenantNameParam(click.ParamType):
    """A tenant's name as the daemon accepts it (1-128 of letters, digits, ``._:-``, starting
    with a letter or digit): a name no tenant could have is a usage error (exit 2), caught
    before the daemon is asked."""

    name = "name"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            return check_name(value)
        except BadRequest as err:
            self.fail(err.message, param, ctx)


class SecondsParam(click.FloatRange):
    """A duration in seconds of at least ``min``: a finite number (``nan`` and ``inf`` are not)."""

    name = "number of seconds"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        seconds = super().convert(value, param, ctx)
        if not math.isfinite(seconds):
            self.fail(f"{value!r} is not a finite number of seconds", param, ctx)
        return seconds


class JsonAwareCommand(click.Command):
    """A command whose usage errors (bad flags, bad values) print as ``USAGE`` JSON,
    exit 2, when ``--json`` is among its arguments; otherwise as click prints them."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["kvdaemon.json"] = "--json" in args
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as err:
            _json_usage(ctx, err)
            raise

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as err:
            _json_usage(ctx, err)
            raise


def _json_usage(ctx: click.Context, err: click.UsageError) -> None:
    if ctx.meta.get("kvdaemon.json"):
        fail_usage(err.format_message(), as_json=True)


def command_help(example: str, statuses: str = EPILOG) -> str:
    """A command's epilog: an example (kept as written) and the exit statuses."""
    lines = "\n".join(f"  {line}" for line in example.strip().splitlines())
    return f"\b\nExample:\n{lines}\n\n{statuses}"


class DirParam(click.Path):
    """The daemon directory: a path, never empty (``--dir ""`` is an unset variable in a
    script, not the working directory)."""

    def __init__(self) -> None:
        super().__init__(file_okay=False, path_type=Path)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value.strip():
            self.fail("the directory must be a non-empty path", param, ctx)
        return super().convert(value, param, ctx)


def dir_option(command: F) -> F:
    return click.option("--dir", "dir_flag", type=DirParam(), help=DIR_HELP)(command)


def config_option(command: F) -> F:
    return click.option(
        "--config", "config_file", type=click.Path(dir_okay=False, path_type=Path),
        envvar="KVDAEMON_CONFIG", help=CONFIG_HELP,
    )(command)  # fmt: skip


def json_option(command: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help=JSON_HELP)(command)


def daemon_options(command: F) -> F:
    """``--dir``, ``--config`` and ``--json``."""
    return dir_option(config_option(json_option(command)))


def daemon_dir(dir_flag: Path | None, config_file: Path | None) -> Path:
    """``--dir`` > ``$KVDAEMON_DIR`` > ``dir`` of the config file > the default."""
    return dir_from(dir_flag, os.environ, config_file)
