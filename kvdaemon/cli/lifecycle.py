"""Starting a daemon process around one directory.

The directory (0700, ours) holds an exclusive ``flock`` on ``kvdaemon.lock``
for as long as a daemon lives there; the kernel drops it when the process
dies, even by SIGKILL, so the lock — not the pid file — says whether a daemon
runs. Whoever holds it may therefore delete sockets and pid files left by a
dead predecessor. Every file in it is opened ``O_NOFOLLOW`` (``O_EXCL`` where
it must be fresh), and a directory the daemon did not create is never
chmodded: it must already be ours and 0700.

:func:`run_foreground` runs a daemon in this process until it stops;
``kvdaemon.cli.detach`` runs one in a new session, ``kvdaemon.cli.reach``
reaches and stops a running one. The
daemon's server module is imported only by ``run_foreground``, so the commands
that merely talk to a daemon stay light.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from kvdaemon import __version__
from kvdaemon.cli.logs import FILE_MODE, logging_to
from kvdaemon.cli.notify import notify_ready, notify_stopping
from kvdaemon.daemon.config import DaemonConfig
from kvdaemon.errors import ConfigError, Conflict
from kvdaemon.heap import freeze_heap
from kvdaemon.wire.paths import read_pid as _read_pid
from kvdaemon.wire.paths import PRIVATE_DIR_MODE as DIR_MODE
from kvdaemon.wire.paths import DaemonPaths, check_private_dir
from kvdaemon.wire.sizes import format_bytes

if TYPE_CHECKING:
    from kvdaemon.daemon.server import Daemon

log = logging.getLogger("kvdaemon")

LOCK_RETRY_S = 0.2


def run_foreground(config: DaemonConfig, ready_json: bool = False) -> int:
    """Run a daemon in this process until ``stop()``, SIGTERM/SIGINT or a ``shutdown`` op.

    Logs to stderr, and to ``config.log_file`` when set; ``ready_json``: prints one
    JSON object on stdout once clients can connect (``ready_object``); tells systemd
    ``READY=1`` once clients can connect and ``STOPPING=1`` when it begins to
    stop (``kvdaemon.cli.notify``). Raises ``Conflict`` when a daemon already
    runs at ``config.dir``, ``UnsafeDirectory``/``ConfigError`` for a directory
    it must not or cannot use. On return the pid file and sockets are gone and
    the lock is released. Returns 0.
    """
    from kvdaemon.daemon.server import Daemon  # imported here: `kvdaemon status` never needs it

    paths = config.paths
    prepare_dir(paths.root)
    with _exclusive_lock(paths), logging_to(config.log_file, config.log_level), _pid_file(paths):
        _remove_sockets(paths)
        daemon = Daemon(config)
        daemon.on_stopping = notify_stopping
        with _stop_on_signals(daemon.stop):
            try:
                daemon.start()
                freeze_heap()  # full collections walk only what serving creates
                line = startup_line(daemon)
                log.info("%s", line)
                if ready_json:
                    print(json.dumps(ready_object(daemon)), flush=True)
                notify_ready(line)
                daemon.serve()
            finally:
                _remove_sockets(paths)
        log.info("kvdaemon %d stopped", os.getpid())
    return 0


def ready_object(daemon: Daemon) -> dict[str, object]:
    """What ``start --foreground --json`` prints once ready: where, which process, backend,
    device, capacity, page size and the metrics URL (``null``: off)."""
    assert daemon.service is not None, "start() first"
    status = daemon.service.status()
    return {
        "dir": str(daemon.paths.root), "pid": os.getpid(), "version": __version__, "ready": True,
        "backend": status["backend"], "device": daemon.config.device,
        "capacity_bytes": status["capacity_bytes"], "page_size": status["page_size"],
        "metrics_address": daemon.config.metrics_address,
        "metrics_url": daemon.metrics.url if daemon.metrics is not None else None,
    }  # fmt: skip


def startup_line(daemon: Daemon) -> str:
    """``kvdaemon 0.1.0 ready at DIR (pid N): backend cuda, device 0, capacity ..., metrics URL``."""
    assert daemon.service is not None, "start() first"
    status = daemon.service.status()
    metrics = daemon.metrics.url if daemon.metrics is not None else None
    num_pages = status["capacity_bytes"] // status["page_size"]
    return (
        f"kvdaemon {__version__} ready at {daemon.paths.root} (pid {os.getpid()}): "
        f"backend {status['backend']}, device {daemon.config.device}, "
        f"capacity {format_bytes(status['capacity_bytes'])} "
        f"({num_pages} pages of {format_bytes(status['page_size'])}), "
        f"metrics {metrics or 'off'}"
    )


def prepare_dir(root: Path) -> None:
    """Create ``root`` 0700 where it is missing (missing parents 0700 too), then check it.

    An existing directory is used only if it is ours with mode 0700
    (``check_private_dir``); it is never chmodded or chowned. Raises
    ``UnsafeDirectory`` for one that is not, ``ConfigError`` (one line, the
    OS's reason) for a path that cannot be a directory: under a regular file,
    on a read-only file system, in ``/proc``.
    """
    try:
        _make_private_dir(root)
    except OSError as err:
        raise ConfigError(
            f"cannot create daemon directory {root}: {err.strerror or err}; "
            "choose another directory with --dir"
        ) from err
    check_private_dir(root)


def _make_private_dir(path: Path) -> None:
    """``mkdir -p`` with mode 0700 for every directory it creates, and only for those."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        return
    except FileNotFoundError:
        if path.parent == path:
            raise
        _make_private_dir(path.parent)
        os.mkdir(path, DIR_MODE)
    # Ours: give it exactly 0700 whatever the umask, through an fd that cannot be a symlink.
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(fd, DIR_MODE)
    finally:
        os.close(fd)


@contextmanager
def _exclusive_lock(paths: DaemonPaths) -> Iterator[None]:
    """Hold the directory's lock while inside; ``Conflict`` when a daemon holds it.

    ``running_pid`` probes with a brief shared lock, so a refusal is retried
    for ``LOCK_RETRY_S`` before it counts: a daemon holds the lock for good.
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(paths.lock_file, flags, FILE_MODE)
    except OSError as err:
        raise ConfigError(f"cannot open {paths.lock_file}: {err.strerror}") from err
    try:
        deadline = time.monotonic() + LOCK_RETRY_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError as err:
                if time.monotonic() >= deadline:
                    raise already_running(paths, _read_pid(paths)) from err
                time.sleep(LOCK_RETRY_S / 10)
        yield
    finally:
        os.close(fd)  # closing the only descriptor releases the lock


def already_running(paths: DaemonPaths, pid: int | None) -> Conflict:
    shown = f"pid {pid}" if pid else "pid not written yet"
    return Conflict(f"a kvdaemon is already running at {paths.root} ({shown})")


@contextmanager
def _pid_file(paths: DaemonPaths) -> Iterator[None]:
    """Write our pid to the pid file (atomically, through a fresh private temporary file)."""
    partial = paths.pid_file.with_suffix(".pid.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        partial.unlink(missing_ok=True)  # a leftover of a killed start; we hold the lock
        with os.fdopen(os.open(partial, flags, FILE_MODE), "w") as stream:
            stream.write(f"{os.getpid()}\n")
        os.replace(partial, paths.pid_file)
    except OSError as err:
        raise ConfigError(f"cannot write {paths.pid_file}: {err.strerror}") from err
    try:
        yield
    finally:
        paths.pid_file.unlink(missing_ok=True)


def _remove_sockets(paths: DaemonPaths) -> None:
    for socket_path in paths.sockets():
        socket_path.unlink(missing_ok=True)


@contextmanager
def _stop_on_signals(stop: Callable[[], None]) -> Iterator[None]:
    """Call ``stop`` on SIGTERM and SIGINT while inside; only possible in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, _frame: FrameType | None) -> None:
        log.info("received %s, stopping", signal.Signals(signum).name)
        stop()

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
