"""How a command's result or error reaches the operator: text, or one JSON object.

Every printing command takes ``--json``; with it, stdout carries exactly one
JSON object, the result or ``{"error": {"code": CODE, "message": TEXT}}``, and
stderr stays empty. Without it, results go to stdout and errors to stderr as
one line: the message alone when no daemon runs or answers, else
``error CODE: message``. The exit status follows ``kvdaemon.cli.exit_codes``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click

from kvdaemon.cli.exit_codes import EXIT_USAGE, exit_code_of
from kvdaemon.errors import DaemonUnreachable, KVDaemonError

F = TypeVar("F", bound=Callable[..., Any])


def emit(as_json: bool, result: dict[str, Any], text: str) -> None:
    """Print ``result`` as one JSON object, or ``text``."""
    click.echo(json.dumps(result, indent=2) if as_json else text)


def error_object(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


def fail(error: KVDaemonError, as_json: bool) -> NoReturn:
    """Print ``error`` (see the module docstring) and exit with its status."""
    if as_json:
        click.echo(json.dumps(error_object(error.code, error.message), indent=2))
    elif isinstance(error, DaemonUnreachable):
        click.echo(error.message, err=True)
    else:
        click.echo(f"error {error.code}: {error.message}", err=True)
    raise click.exceptions.Exit(exit_code_of(error))


def fail_usage(message: str, as_json: bool) -> NoReturn:
    """A usage error found by click (a bad flag or value) as ``USAGE``, exit 2."""
    if as_json:
        click.echo(json.dumps(error_object("USAGE", message), indent=2))
    else:
        click.echo(f"error USAGE: {message}", err=True)
    raise click.exceptions.Exit(EXIT_USAGE)


def reporting(command: F) -> F:
    """Turn a ``KVDaemonError`` escaping ``command`` into ``fail``; ``--json`` is read
    from the command's ``as_json`` argument."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except KVDaemonError as err:
            fail(err, bool(kwargs.get("as_json")))

    return run  # type: ignore[return-value]
