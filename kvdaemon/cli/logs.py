"""Where a daemon's log goes: stderr, and a log file when one is given.

The log file is opened ``O_APPEND | O_NOFOLLOW`` (a planted symlink is refused,
never followed) and created 0600. It works with logrotate either way:

- ``create`` mode (the file is renamed and a new one made): each record checks
  the file's identity first (``WatchedFileHandler``) and reopens the path when
  it changed, so nothing needs signalling;
- ``SIGHUP`` makes the next record reopen the file by name (for a
  ``postrotate`` that sends it); the signal handler itself only sets a flag.

``copytruncate`` works too, since the file is opened for appending.
"""

from __future__ import annotations

import errno
import logging
import logging.handlers
import os
import signal
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
    """An fd appending to ``path`` (created 0600, symlinks refused); ``OSError`` as the OS says."""
    return os.open(path, APPEND_FLAGS, FILE_MODE)


class PrivateLogFile(logging.handlers.WatchedFileHandler):
    """A ``WatchedFileHandler`` that opens with :func:`open_append` and reopens on request."""

    reopen_requested = False

    def _open(self) -> IO[str]:
        return os.fdopen(open_append(Path(self.baseFilename)), "a", encoding="utf-8")

    def emit(self, record: logging.LogRecord) -> None:
        if self.reopen_requested:  # under the handler's lock, before the stream is used
            self.reopen_requested = False
            if self.stream is not None:
                self.stream.close()
            self.stream = self._open()
            self._statstream()
        super().emit(record)


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
        try:
            file_handler = PrivateLogFile(log_file, encoding="utf-8")
        except OSError as err:
            raise log_file_error(log_file, err) from err
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
