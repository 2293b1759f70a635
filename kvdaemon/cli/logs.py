"""Where a daemon's log goes: stderr, and a log file when one is given.

The log file is opened ``O_APPEND | O_NOFOLLOW | O_NONBLOCK`` and created 0600; only a
regular file that can be appended to is used. A symlink (planted, or ``/dev/stderr``), a
FIFO, a directory, a device or a file that does not seek (``/proc/version``) is refused
with a one-line ``ConfigError``, never followed, blocked on or written. It works with
logrotate either way:

- ``create`` mode (the file is renamed and a new one made): each record checks
  the file's identity first (``WatchedFileHandler``) and reopens the path when
  it changed, so nothing needs signalling;
- ``SIGHUP`` makes the next record reopen the file by name (for a
  ``postrotate`` that sends it); the signal handler itself only sets a flag.

``copytruncate`` works too, since the file is opened for appending. Records the file
cannot take (a FIFO put at its path, a full disk) are lost with one line on stderr when
the losses start and one when a record lands again, not a traceback each.
"""

from __future__ import annotations

import errno
import logging
import logging.handlers
import os
import signal
import stat
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import IO

from kvdaemon.errors import ConfigError

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"
FILE_MODE = 0o600
APPEND_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC

log = logging.getLogger("kvdaemon")


def open_append(path: Path) -> int:
    """A blocking fd appending to the regular file ``path`` (created 0600 where missing).

    Never blocks or follows a symlink: ``path`` is checked with ``lstat`` first (so a device
    or FIFO found there is not even opened), opened ``O_NONBLOCK | O_NOFOLLOW``, checked again
    with ``fstat`` (what was opened, whatever replaced the path meanwhile) and seeked to its
    end. Raises ``ConfigError`` (one line, the fix named) for anything else; nothing is left
    open then. Costs six system calls.
    """
    try:
        _refuse_unusable(path, os.lstat(path))  # before opening: opening a device may act on it
    except OSError:
        pass  # missing (created below), or the open says why
    try:
        fd = os.open(path, APPEND_FLAGS | os.O_NONBLOCK, FILE_MODE)
    except OSError as err:  # ELOOP: a symlink, ENXIO: a FIFO nobody reads, swapped in since the lstat
        try:
            _refuse_unusable(path, os.lstat(path))
        except OSError:
            pass
        raise log_file_error(path, err) from err
    try:
        _refuse_unusable(path, os.fstat(fd))
        try:
            os.lseek(fd, 0, os.SEEK_END)
        except OSError as err:
            raise ConfigError(
                f"cannot use log file {path}: it cannot be appended to ({err.strerror}); "
                "name a regular file with --log-file"
            ) from err
        os.set_blocking(fd, True)
    except (ConfigError, OSError):
        os.close(fd)
        raise
    return fd


def _kernel_devices() -> set[int]:
    """The devices of ``KERNEL_FILE_SYSTEMS`` here (those mounted)."""
    devices = set()
    for root in KERNEL_FILE_SYSTEMS:
        try:
            devices.add(os.stat(root).st_dev)
        except OSError:
            pass
    return devices


_KINDS = (
    (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
)  # fmt: skip


KERNEL_FILE_SYSTEMS = ("/proc", "/sys")  # their files look regular, but a write there tunes the kernel


def _refuse_unusable(path: Path, info: os.stat_result) -> None:
    """Raise ``ConfigError`` unless ``info`` (``path``'s) is a regular file's, and not one of the
    kernel's (procfs, sysfs: ``KERNEL_FILE_SYSTEMS``, told apart by device)."""
    if stat.S_ISREG(info.st_mode):
        if info.st_dev in _kernel_devices():
            raise ConfigError(
                f"cannot use log file {path}: a kernel file (procfs or sysfs), not a log; "
                "name a regular file with --log-file"
            )
        return
    if stat.S_ISLNK(info.st_mode):
        try:
            target = f" (to {os.readlink(path)})"
        except OSError:
            target = ""
        raise ConfigError(
            f"cannot use log file {path}: it is a symbolic link{target}, never followed; "
            "give the file itself with --log-file"
        )
    kind = next((name for test, name in _KINDS if test(info.st_mode)), "another kind of file")
    raise ConfigError(
        f"cannot use log file {path}: not a regular file ({kind}); name a regular file with --log-file"
    )


class PrivateLogFile(logging.handlers.WatchedFileHandler):
    """A ``WatchedFileHandler`` that opens with :func:`open_append` and reopens on request.

    A reopen refused by :func:`open_append` (something other than a regular file put at the
    path) fails only that record, as a handler's error: the caller never sees it, and the next
    record tries again.
    """

    reopen_requested = False
    losing = False  # records are being lost: told once on stderr, and again when one lands
    record_lost = False

    def _open(self) -> IO[str]:
        return os.fdopen(open_append(Path(self.baseFilename)), "a", encoding="utf-8")

    def emit(self, record: logging.LogRecord) -> None:
        if self.reopen_requested:  # under the handler's lock, before the stream is used
            self.reopen_requested = False
            if self.stream is not None:
                self.stream.close()
                self.stream = None  # a refused reopen leaves none: the next record opens again
            self.stream = self._open()
            self._statstream()
        self.record_lost = False
        super().emit(record)  # a failure calls ``handleError``
        if self.losing and not self.record_lost:
            self.losing = False
            self._tell(f"log file {self.baseFilename} is written again")

    def handle(self, record: logging.LogRecord) -> bool:
        try:
            return super().handle(record)
        except ConfigError:  # raised by a reopen, outside logging's own error handling
            self.handleError(record)
            return True

    def handleError(self, record: logging.LogRecord) -> None:
        """One line on stderr for the first record of a run the file loses, not logging's
        traceback for every record (stderr of a detached daemon is its first log file, which
        logrotate has renamed by then)."""
        self.record_lost = True
        if self.losing:
            return
        self.losing = True
        error = sys.exc_info()[1]
        why = error.message if isinstance(error, ConfigError) else f"log file {self.baseFilename}: {error}"
        self._tell(f"{why}; records are lost until it can be written")

    @staticmethod
    def _tell(line: str) -> None:
        try:
            sys.stderr.write(f"kvdaemon: {line}\n")
            sys.stderr.flush()
        except (OSError, ValueError, AttributeError):  # stderr closed or gone: nowhere left to say it
            pass


def log_file_error(log_file: Path, err: OSError) -> ConfigError:
    """Why ``log_file`` cannot be opened, with the fix where the cause names one."""
    hint = ""
    if err.errno == errno.ENOENT:
        hint = f"; create its directory {log_file.parent} first, or name another --log-file"
    elif err.errno == errno.EACCES:
        hint = "; this user may not write there: name another --log-file"
    return ConfigError(f"cannot open log file {log_file}: {err.strerror}{hint}")


@contextmanager
def logging_to(log_file: Path | None, level: str) -> Iterator[None]:
    """Log the ``kvdaemon`` logger at ``level`` to stderr and, when given, to ``log_file``
    (once only where stderr already is that file). After a SIGHUP the next record
    reopens the file.

    Raises ``ConfigError`` when the file cannot be opened. Handlers, level and
    the SIGHUP handler are restored on exit.
    """
    handlers: list[logging.Handler] = []
    file_handler: PrivateLogFile | None = None
    if log_file is not None:
        file_handler = PrivateLogFile(log_file, encoding="utf-8")
        handlers.append(file_handler)
    if log_file is None or not _stderr_is(log_file):
        handlers.append(logging.StreamHandler(sys.stderr))
    formatter = logging.Formatter(LOG_FORMAT)
    previous_level = log.level
    for handler in handlers:
        handler.setFormatter(formatter)
        log.addHandler(handler)
    log.setLevel(level)
    try:
        with _reopen_on_sighup(file_handler):
            yield
    finally:
        for handler in handlers:
            log.removeHandler(handler)
            handler.close()
        log.setLevel(previous_level)


@contextmanager
def _reopen_on_sighup(handler: PrivateLogFile | None) -> Iterator[None]:
    """SIGHUP flags ``handler``'s file for reopening (or is ignored without one) while inside;
    only in the main thread, where signal handlers can be set."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def reopen(_signum: int, _frame: FrameType | None) -> None:
        if handler is not None:
            handler.reopen_requested = True

    previous = signal.signal(signal.SIGHUP, reopen)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, previous)


def _stderr_is(path: Path) -> bool:
    try:
        ours, theirs = os.fstat(sys.stderr.fileno()), os.stat(path)
    except (OSError, ValueError, AttributeError):
        return False
    return (ours.st_dev, ours.st_ino) == (theirs.st_dev, theirs.st_ino)
