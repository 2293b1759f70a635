"""Starting and stopping a daemon process around one directory.

The directory (0700, ours) holds an exclusive ``flock`` on ``kvdaemon.lock``
for as long as a daemon lives there; the kernel drops it when the process
dies, even by SIGKILL, so the lock — not the pid file — says whether a daemon
runs. Whoever holds it may therefore delete sockets and pid files left by a
dead predecessor.

- :func:`run_foreground` runs a daemon in this process until it stops.
- :func:`start_detached` runs one in a new session and returns once it answers.
- :func:`stop` asks a running daemon to shut down and waits for it to exit.

The daemon's server module is imported only by ``run_foreground``, so the
commands that merely talk to a daemon (status, stop) stay light.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import IO

import psutil

from kvdaemon.client import KVClient
from kvdaemon.daemon.config import DaemonConfig
from kvdaemon.errors import Conflict, DaemonUnreachable, Forbidden, LifecycleError
from kvdaemon.wire.paths import DaemonPaths

log = logging.getLogger("kvdaemon")

DIR_MODE = 0o700
FILE_MODE = 0o600
POLL_S = 0.05
LOCK_RETRY_S = 0.2
LOG_TAIL_BYTES = 4000
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"


def run_foreground(config: DaemonConfig) -> int:
    """Run a daemon in this process until ``stop()``, SIGTERM/SIGINT or a ``shutdown`` op.

    Raises ``Conflict`` when a daemon already runs at ``config.dir`` and
    ``Forbidden`` when the directory belongs to another user. On return the
    pid file and sockets are gone and the lock is released. Returns 0.
    """
    from kvdaemon.daemon.server import Daemon  # imported here: `kvdaemon status` never needs it

    paths = config.paths
    prepare_dir(paths.root)
    with _exclusive_lock(paths), _pid_file(paths), _logging_to(paths, config.log_level):
        _remove_sockets(paths)
        daemon = Daemon(config)
        with _stop_on_signals(daemon.stop):
            try:
                daemon.start()
                daemon.serve()
            finally:
                _remove_sockets(paths)
        log.info("kvdaemon %d stopped", os.getpid())
    return 0


def prepare_dir(root: Path) -> None:
    """Create ``root`` 0700 (parents as needed), or tighten an existing one of ours to 0700.

    Raises ``Forbidden`` when ``root`` is not a directory or is owned by another uid.
    """
    try:
        os.mkdir(root, DIR_MODE)
    except FileExistsError:
        pass
    except FileNotFoundError:
        root.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(root, DIR_MODE)
    info = os.lstat(root)
    if not stat.S_ISDIR(info.st_mode):
        raise Forbidden(f"{root} exists and is not a directory")
    if info.st_uid != os.getuid():
        raise Forbidden(
            f"{root} belongs to uid {info.st_uid}, not to you (uid {os.getuid()}); "
            "choose another directory with --dir"
        )
    if stat.S_IMODE(info.st_mode) != DIR_MODE:
        os.chmod(root, DIR_MODE)


def running_pid(paths: DaemonPaths) -> int | None:
    """The pid of the daemon holding ``paths``' lock, 0 if it holds it but its pid is
    unknown yet, or ``None`` when no daemon runs there. Costs one open and flock."""
    try:
        fd = os.open(paths.lock_file, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read_pid(paths) or 0
    finally:
        os.close(fd)
    return None


@contextmanager
def _exclusive_lock(paths: DaemonPaths) -> Iterator[None]:
    """Hold the directory's lock while inside; ``Conflict`` when a daemon holds it.

    ``running_pid`` probes with a brief shared lock, so a refusal is retried
    for ``LOCK_RETRY_S`` before it counts: a daemon holds the lock for good.
    """
    fd = os.open(paths.lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    try:
        deadline = time.monotonic() + LOCK_RETRY_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError as err:
                if time.monotonic() >= deadline:
                    raise _already_running(paths, _read_pid(paths)) from err
                time.sleep(LOCK_RETRY_S / 10)
        yield
    finally:
        os.close(fd)  # closing the only descriptor releases the lock


def _already_running(paths: DaemonPaths, pid: int | None) -> Conflict:
    shown = f"pid {pid}" if pid else "pid not written yet"
    return Conflict(f"a kvdaemon is already running at {paths.root} ({shown})")


def _read_pid(paths: DaemonPaths) -> int | None:
    try:
        text = paths.pid_file.read_text()
    except FileNotFoundError:
        return None
    try:
        return int(text.strip())
    except ValueError:
        return None


@contextmanager
def _pid_file(paths: DaemonPaths) -> Iterator[None]:
    partial = paths.pid_file.with_suffix(".pid.tmp")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
    with os.fdopen(fd, "w") as stream:
        stream.write(f"{os.getpid()}\n")
    os.replace(partial, paths.pid_file)
    try:
        yield
    finally:
        paths.pid_file.unlink(missing_ok=True)


def _remove_sockets(paths: DaemonPaths) -> None:
    for socket_path in paths.sockets():
        socket_path.unlink(missing_ok=True)


@contextmanager
def _logging_to(paths: DaemonPaths, level: str) -> Iterator[None]:
    """Log to the directory's log file, and to stderr unless stderr already is that file."""
    handlers: list[logging.Handler] = [_file_handler(paths.log_file)]
    if not _stderr_is(paths.log_file):
        handlers.append(logging.StreamHandler(sys.stderr))
    formatter = logging.Formatter(LOG_FORMAT)
    previous_level = log.level
    for handler in handlers:
        handler.setFormatter(formatter)
        log.addHandler(handler)
    log.setLevel(level)
    try:
        yield
    finally:
        for handler in handlers:
            log.removeHandler(handler)
            handler.close()
        log.setLevel(previous_level)


def _file_handler(log_file: Path) -> logging.FileHandler:
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, FILE_MODE)
    os.close(fd)  # created with our mode; FileHandler reopens it for appending
    return logging.FileHandler(log_file, mode="a", encoding="utf-8")


def _stderr_is(path: Path) -> bool:
    try:
        ours, theirs = os.fstat(sys.stderr.fileno()), os.stat(path)
    except (OSError, ValueError, AttributeError):
        return False
    return (ours.st_dev, ours.st_ino) == (theirs.st_dev, theirs.st_ino)


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


def start_detached(config: DaemonConfig, timeout_s: float = 30.0) -> int:
    """Start a daemon in a new session and return its pid once it answers ``hello``.

    The child runs ``python -m kvdaemon start --foreground`` with the resolved
    config as flags; its output goes to the log file. Raises ``Conflict`` when
    a daemon already runs there, ``LifecycleError`` (with the tail of the log)
    when the child exits first or does not answer within ``timeout_s`` (then
    it is killed). Costs one process start plus a ``hello`` every 50 ms.
    """
    paths = config.paths
    prepare_dir(paths.root)
    pid = running_pid(paths)
    if pid is not None:
        raise _already_running(paths, pid)
    log_offset = _log_size(paths)
    with _open_log(paths) as log_stream:
        child = subprocess.Popen(
            [sys.executable, "-m", "kvdaemon", "start", "--foreground", *config.to_argv()],
            stdin=subprocess.DEVNULL,
            stdout=log_stream,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            cwd="/",
            env=_child_env(os.environ),
        )
    return _await_hello(child, paths, log_offset, timeout_s)


def _child_env(env: Mapping[str, str]) -> dict[str, str]:
    # The child gets its whole config as flags; stray KVDAEMON_* must not leak into it.
    return {key: value for key, value in env.items() if not key.startswith("KVDAEMON_")}


def _open_log(paths: DaemonPaths) -> IO[bytes]:
    fd = os.open(paths.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, FILE_MODE)
    return os.fdopen(fd, "ab")


def _log_size(paths: DaemonPaths) -> int:
    try:
        return paths.log_file.stat().st_size
    except FileNotFoundError:
        return 0


def _log_tail(paths: DaemonPaths, offset: int) -> str:
    """What the log gained since ``offset``, at most its last ``LOG_TAIL_BYTES``."""
    try:
        with open(paths.log_file, "rb") as stream:
            end = stream.seek(0, os.SEEK_END)
            stream.seek(max(offset, end - LOG_TAIL_BYTES))
            return stream.read().decode("utf-8", "replace").strip()
    except FileNotFoundError:
        return ""


def _await_hello(
    child: subprocess.Popen[bytes], paths: DaemonPaths, log_offset: int, timeout_s: float
) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        code = child.poll()
        if code is not None:
            raise LifecycleError(
                f"kvdaemon exited with status {code} before accepting clients "
                f"(log: {paths.log_file}):\n{_log_tail(paths, log_offset)}"
            )
        if _answers(paths.root, child.pid):
            return child.pid
        if time.monotonic() >= deadline:
            _kill(child)
            raise LifecycleError(
                f"kvdaemon did not accept clients within {timeout_s:g} s and was killed "
                f"(log: {paths.log_file}):\n{_log_tail(paths, log_offset)}"
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


def connect(dir: Path, timeout_s: float = 5.0) -> KVClient:
    """A client for the daemon at ``dir``; raises ``DaemonUnreachable`` at once when none runs.

    Whether a daemon runs is read from the directory's lock (one open and
    flock), so a dead daemon's leftover socket costs no timeout.
    """
    if running_pid(DaemonPaths(dir)) is None:
        raise DaemonUnreachable(f"no kvdaemon running at {dir} — start it with `kvdaemon start`")
    return KVClient(dir=dir, timeout_s=timeout_s)


def stop(dir: Path, timeout_s: float = 30.0) -> int:
    """Ask the daemon at ``dir`` to shut down; return its pid once it has exited.

    Raises ``DaemonUnreachable`` when no daemon answers there, and
    ``LifecycleError`` when it has not exited within ``timeout_s``.
    """
    with connect(dir, timeout_s=min(timeout_s, 5.0)) as client:
        pid = int(client.hello()["pid"])
        client.shutdown()
    if not _wait_exited(DaemonPaths(dir), pid, timeout_s):
        raise LifecycleError(f"kvdaemon (pid {pid}) at {dir} did not exit within {timeout_s:g} s")
    return pid


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
