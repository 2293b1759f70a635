"""The live loop of ``kvdaemon top``: redraw a frame every interval, read keys.

Keys (read from a TTY stdin in cbreak mode, restored however the loop ends):
``q`` quits, ``m``/``u``/``n``/``i``/``s`` sort by mapped, in use, name, idle
time or state (``kvdaemon.cli.top_view.SORTS``). A daemon that goes away is
shown as unreachable and polled until one answers again.
"""

from __future__ import annotations

import os
import select
import sys
import termios
import time
import tty
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.live import Live

from kvdaemon.cli import top_view
from kvdaemon.wire.paths import running_pid
from kvdaemon.client import KVClient
from kvdaemon.errors import DaemonUnreachable
from kvdaemon.wire.paths import DaemonPaths

QUIT = "quit"
QUIT_KEYS = b"qQ"


def run_live(client: KVClient, root: Path, first: dict[str, Any], interval_s: float,
             sort: str) -> None:  # fmt: skip
    """Redraw every ``interval_s`` until ``q`` (or the TTY's end) is read from a TTY stdin.

    A sort key redraws at once, sorted its way. Ctrl-C is left to the caller.
    """
    status: dict[str, Any] | None = first
    with _keys(sys.stdin) as keys_fd, Live(
        top_view.frame(root, status, top_view.help_line(sort, interval_s), sort),
        console=Console(highlight=False), auto_refresh=False,
    ) as live:  # fmt: skip
        while (key := next_key(keys_fd, interval_s)) != QUIT:
            if key is None:
                status = poll_status(client, root)
            else:
                sort = key
            live.update(top_view.frame(root, status, top_view.help_line(sort, interval_s), sort),
                        refresh=True)  # fmt: skip


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


def next_key(keys_fd: int | None, timeout_s: float) -> str | None:
    """Wait ``timeout_s`` for a key that matters: ``QUIT`` (a quit key or the TTY's end),
    a sort name, or None when the time ran out. Other keys do not end the wait.
    Without a keys fd, sleeps and returns None."""
    if keys_fd is None:
        time.sleep(timeout_s)
        return None
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([keys_fd], [], [], left)
        if not ready:
            return None
        data = os.read(keys_fd, 64)
        if not data or any(key in QUIT_KEYS for key in data):
            return QUIT
        for key in reversed(data.decode("ascii", "ignore").lower()):
            if key in top_view.SORT_KEYS:
                return top_view.SORT_KEYS[key]
    return None


def poll_status(client: KVClient, root: Path) -> dict[str, Any] | None:
    """The daemon's status object, or None when no daemon runs or answers at ``root``.

    A daemon found dead by its lock costs no timeout; a hung one costs at most
    the client's timeout. The client reconnects by itself to a new daemon.
    """
    if running_pid(DaemonPaths(root)) is None:
        return None
    try:
        return client.status()
    except DaemonUnreachable:
        return None
