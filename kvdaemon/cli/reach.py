"""Reaching a running daemon from the CLI, and stopping it.

Whether a daemon runs is read from its directory's lock (one open and flock,
``wire.paths.running_pid``), so a dead daemon's leftover socket costs no
timeout, and a daemon that holds the lock but does not answer is told apart
from none at all: ``NotAnswering`` (exit 4) instead of ``DaemonUnreachable``
(exit 1).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from kvdaemon.wire.paths import running_pid
from kvdaemon.client import KVClient
from kvdaemon.errors import DaemonUnreachable, LifecycleError, NotAnswering
from kvdaemon.wire.paths import DaemonPaths, check_private_dir

log = logging.getLogger("kvdaemon")

POLL_S = 0.05
CONTROL_TIMEOUT_S = 5.0


def not_running(dir: Path) -> DaemonUnreachable:  # noqa: A002
    return DaemonUnreachable(f"no kvdaemon running at {dir} — start it with `kvdaemon start`")


def not_answering(dir: Path, pid: int) -> NotAnswering:  # noqa: A002
    who = f"pid {pid}" if pid else "pid not written yet"
    return NotAnswering(
        f"kvdaemon at {dir} is running ({who}) but not answering; it may be busy, starting "
        f"or hung: see its log, or `kvdaemon stop` signals it"
    )


def connect(dir: Path, timeout_s: float = CONTROL_TIMEOUT_S) -> KVClient:  # noqa: A002
    """A client for the daemon at ``dir``; raises ``DaemonUnreachable`` at once when none runs.

    An existing ``dir`` must be private (``check_private_dir``: ``UnsafeDirectory``).
    """
    if os.path.lexists(dir):
        check_private_dir(dir)
    if running_pid(DaemonPaths(dir)) is None:
        raise not_running(dir)
    return KVClient(dir=dir, timeout_s=timeout_s)


@contextmanager
def talking(dir: Path, timeout_s: float = CONTROL_TIMEOUT_S) -> Iterator[KVClient]:  # noqa: A002
    """``connect`` for the block's length; a ``DaemonUnreachable`` raised inside while the
    daemon still holds its lock becomes ``NotAnswering``, unless the daemon answered it
    itself (a stopping daemon telling a waiting caller). The client is closed on exit."""
    client = connect(dir, timeout_s)
    try:
        yield client
    except NotAnswering:
        raise
    except DaemonUnreachable as err:
        if err.from_daemon:
            raise
        pid = running_pid(DaemonPaths(dir))
        if pid is None:
            raise not_running(dir) from err
        raise not_answering(dir, pid) from err
    finally:
        client.close()


@dataclass(frozen=True)
class Stopped:
    """What ``stop`` did: ``pid`` of the daemon that exited (None: none was running),
    and whether it had to be sent SIGTERM because it did not answer."""

    pid: int | None
    signalled: bool = False
    dropped_warm: tuple[dict[str, Any], ...] = ()  # warm sleepers whose KV died with it


def stop(dir: Path, timeout_s: float = 30.0) -> Stopped:  # noqa: A002
    """Stop the daemon at ``dir`` and return once it has exited; a no-op when none runs.

    Asks it with a ``shutdown`` op; a daemon that holds the lock but does not
    answer is sent SIGTERM instead (only once its process is seen holding the
    lock file, so a stale pid file can never aim the signal at another process).
    Raises ``NotAnswering`` when it does not answer and cannot be signalled,
    ``LifecycleError`` when it has not exited within ``timeout_s``.
    """
    paths = DaemonPaths(dir)
    try:
        with talking(dir, timeout_s=min(timeout_s, CONTROL_TIMEOUT_S)) as client:
            pid = int(client.hello()["pid"])
            dropped = tuple(client.shutdown())
        signalled = False
    except NotAnswering:
        pid = running_pid(paths) or 0
        if not _holds_lock(pid, paths):
            raise
        log.warning("kvdaemon %d at %s does not answer; sending SIGTERM", pid, dir)
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGCONT)  # a stopped (SIGSTOP) daemon handles the TERM once it runs
        signalled, dropped = True, ()
    except DaemonUnreachable:
        return Stopped(None)
    if not _wait_exited(paths, pid, timeout_s):
        raise LifecycleError(f"kvdaemon (pid {pid}) at {dir} did not exit within {timeout_s:g} s")
    return Stopped(pid, signalled, dropped)


def _holds_lock(pid: int, paths: DaemonPaths) -> bool:
    """True when process ``pid`` has ``paths.lock_file`` open (the daemon holding it)."""
    if pid <= 0:
        return False
    try:
        open_files = psutil.Process(pid).open_files()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    lock = os.path.realpath(paths.lock_file)
    return any(os.path.realpath(f.path) == lock for f in open_files)


def _wait_exited(paths: DaemonPaths, pid: int, timeout_s: float) -> bool:
    """Poll until the directory's lock is free and ``pid`` has exited; False on timeout."""
    deadline = time.monotonic() + timeout_s
    while running_pid(paths) is not None or _alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def _alive(pid: int) -> bool:
    """True while ``pid`` runs; an exited child is reaped, and a zombie counts as exited."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not our child
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
