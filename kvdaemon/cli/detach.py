"""Starting a daemon in a new session, detached from the terminal.

:func:`start_detached` spawns ``python -m kvdaemon start --foreground`` with
the resolved configuration as flags and returns once the child answers; a
child that fails tells why through its log, whose new lines the error carries.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from kvdaemon.cli.exit_codes import EXIT_USAGE
from kvdaemon.cli.lifecycle import already_running, prepare_dir
from kvdaemon.wire.paths import running_pid
from kvdaemon.cli.logs import open_append
from kvdaemon.client import KVClient
from kvdaemon.daemon.config import DaemonConfig
from kvdaemon.errors import ConfigError, DaemonUnreachable, KVDaemonError, LifecycleError, from_code

POLL_S = 0.05
LOG_TAIL_BYTES = 4000
_ERROR_LINE = re.compile(r"^error (?P<code>[A-Z_]+): (?P<message>.*)$")


def start_detached(config: DaemonConfig, timeout_s: float = 30.0) -> int:
    """Start a daemon in a new session and return its pid once it answers ``hello``.

    The child runs ``python -m kvdaemon start --foreground`` with the resolved
    config as flags, logging to ``config.log_file`` (default: ``kvdaemon.log``
    in its directory), where its stdout and stderr go too. Raises ``Conflict``
    when a daemon already runs there; ``ConfigError`` (or ``UnsafeDirectory``)
    when the log file is not a regular file it can append to (no child is started then;
    see ``open_append``), or when the child refused its configuration (exit status 2: e.g. a capacity
    larger than the device), with the child's one-line reason;
    ``LifecycleError`` (with the tail of the log) when it exits otherwise or
    does not answer within ``timeout_s`` (then it is killed), or when the
    process cannot be started at all (its interpreter missing or not executable). Costs one
    process start plus a ``hello`` every 50 ms.
    """
    paths = config.paths
    prepare_dir(paths.root)
    pid = running_pid(paths)
    if pid is not None:
        raise already_running(paths, pid)
    log_file = config.log_file or paths.log_file
    log_fd = open_append(log_file)  # ConfigError for anything but a regular file, before any child
    log_offset = os.fstat(log_fd).st_size  # the file opened, not whatever the path names later
    with os.fdopen(log_fd, "ab") as log_stream:
        try:
            child = subprocess.Popen(
                [sys.executable, "-m", "kvdaemon", "start", "--foreground",
                 *replace(config, log_file=log_file).to_argv()],
                stdin=subprocess.DEVNULL,
                stdout=log_stream,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
                cwd="/",
                env=_child_env(os.environ),
            )  # fmt: skip
        except OSError as err:  # the interpreter gone, or not this user's to run
            raise LifecycleError(
                f"cannot start the daemon's process with {sys.executable}: {err.strerror or err}; "
                "run kvdaemon from an installation this user can execute, or start --foreground"
            ) from err
    return _await_hello(child, paths.root, log_file, log_offset, timeout_s)


def _child_env(env: Mapping[str, str]) -> dict[str, str]:
    # The child gets its whole config as flags; stray KVDAEMON_* must not leak into it,
    # and it is no systemd service of its own.
    return {
        key: value for key, value in env.items()
        if not key.startswith("KVDAEMON_") and key != "NOTIFY_SOCKET"
    }  # fmt: skip


def _log_tail(log_file: Path, offset: int) -> str:
    """What the log gained since ``offset``, at most its last ``LOG_TAIL_BYTES``."""
    try:
        with open(log_file, "rb") as stream:
            end = stream.seek(0, os.SEEK_END)
            stream.seek(max(offset, end - LOG_TAIL_BYTES))
            return stream.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _own_error(tail: str) -> KVDaemonError | None:
    """The child's own ``error CODE: message`` line as the error it names (``CONFLICT``: another
    daemon won a race to start), without the rest of the log (another daemon's lines, then)."""
    for line in reversed(tail.splitlines()):
        match = _ERROR_LINE.match(line)
        if match:
            return from_code(match["code"], match["message"])
    return None


def _refusal(tail: str, log_file: Path) -> ConfigError:
    """The child's own ``error CODE: message`` line (exit status 2) as the error it names."""
    for line in reversed(tail.splitlines()):
        match = _ERROR_LINE.match(line)
        if match:
            error = from_code(match["code"], match["message"])
            if isinstance(error, ConfigError):
                return error
    return ConfigError(f"kvdaemon refused its configuration (log: {log_file}):\n{tail}")


def _await_hello(
    child: subprocess.Popen[bytes], root: Path, log_file: Path, log_offset: int, timeout_s: float
) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        code = child.poll()
        if code == EXIT_USAGE:
            raise _refusal(_log_tail(log_file, log_offset), log_file)
        if code is not None:
            tail = _log_tail(log_file, log_offset)
            raise _own_error(tail) or LifecycleError(
                f"kvdaemon exited with status {code} before accepting clients (log: {log_file}):\n{tail}"
            )
        if _answers(root, child.pid):
            return child.pid
        if time.monotonic() >= deadline:
            _kill(child)
            raise LifecycleError(
                f"kvdaemon did not accept clients within {timeout_s:g} s and was killed "
                f"(log: {log_file}):\n{_log_tail(log_file, log_offset)}"
            )
        time.sleep(POLL_S)


def _answers(root: Path, pid: int) -> bool:
    """True when the daemon at ``root`` answers ``hello`` as process ``pid``."""
    client = KVClient(dir=root, timeout_s=0.5)
    try:
        return client.hello().get("pid") == pid
    except DaemonUnreachable:
        return False
    finally:
        client.close()


def _kill(child: subprocess.Popen[bytes]) -> None:
    child.kill()
    child.wait()
