"""``kvdaemon logs``: the last lines of a daemon's log file, and what it writes next.

The file is the one the daemon at the directory writes: ``--log-file`` (flag,
``KVDAEMON_LOG_FILE`` or the config file: give ``logs`` the same as ``start``),
else ``kvdaemon.log`` in the directory. Only a regular file is read, checked
before it is opened (a FIFO or device is never opened) and opened
``O_NOFOLLOW`` (a symlink planted there is refused, as the daemon refuses it).
``last_lines`` reads backwards from the end in blocks, so a long log costs what
the lines shown take; lines end at ``\n`` only. ``follow`` polls for more every
``FOLLOW_POLL_S``: a file renamed away (logrotate's ``create``) is read to its
end, then the path's new file from its start, so nothing is lost; a file
truncated in place (``copytruncate``) is read again from its start, which loses
what was written between the last poll and the copy, and misses the truncation
when more than was read is written again before the next poll.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from kvdaemon.errors import ConfigError

BLOCK_BYTES = 64 * 1024
FOLLOW_POLL_S = 0.5
MAX_LINES = 1_000_000


def open_log(path: Path) -> int:
    """An fd of the regular file at ``path``; ``ConfigError`` naming why not (missing, a
    symlink, not a regular file, unreadable)."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):  # before opening: a FIFO or device is never opened
            raise ConfigError(f"cannot read the log file {path}: not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError as err:
        raise ConfigError(f"no log file at {path}: no daemon has logged there (one started with "
                          "--foreground logs to its terminal, and to --log-file only if given)") from err
    except OSError as err:
        raise ConfigError(f"cannot read the log file {path}: {err.strerror or err}") from err
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"cannot read the log file {path}: not a regular file")
    return fd


def last_lines(fd: int, num_lines: int) -> tuple[list[str], int]:
    """The last ``num_lines`` whole or partial lines of the file and its size when read.
    O(bytes of those lines), read backwards a block at a time."""
    size = os.fstat(fd).st_size
    if num_lines <= 0:
        return [], size
    chunks: list[bytes] = []
    position, newlines = size, 0
    while position > 0 and newlines <= num_lines:
        start = max(0, position - BLOCK_BYTES)
        chunk = os.pread(fd, position - start, start)
        chunks.append(chunk)
        newlines += chunk.count(b"\n")
        position = start
    lines = b"".join(reversed(chunks)).decode("utf-8", errors="replace").split("\n")
    if lines[-1] == "":
        lines.pop()  # the text ends with a newline: no partial line after it
    return lines[-num_lines:], size


def follow(path: Path, fd: int, position: int, stopped: Callable[[], bool] = lambda: False) -> Iterator[str]:
    """Lines written to ``path`` after ``position`` (of the file ``fd`` is), as they come,
    until ``stopped()``; closes ``fd``. A file renamed away is read to its end, then the
    path's new file from its start; a truncated one from its start."""
    pending = b""
    try:
        while not stopped():
            data = os.pread(fd, BLOCK_BYTES, position)
            if data:
                position += len(data)
                pending += data
                *whole, pending = pending.split(b"\n")
                yield from (line.decode("utf-8", errors="replace") for line in whole)
                continue
            fd, position = _reopened(path, fd, position)
            time.sleep(FOLLOW_POLL_S)
    finally:
        os.close(fd)


def _reopened(path: Path, fd: int, position: int) -> tuple[int, int]:
    """``(fd, position)`` to read on from: the same, or the path's file from its start when
    ours was renamed away or truncated under ``position``."""
    here = os.fstat(fd)
    if here.st_size < position:
        return fd, 0  # truncated in place: what is there now is new
    try:
        there = os.stat(path, follow_symlinks=False)
    except OSError:
        return fd, position  # between a rename and the daemon's next record
    if (there.st_dev, there.st_ino) == (here.st_dev, here.st_ino) or not stat.S_ISREG(there.st_mode):
        return fd, position
    try:
        new = open_log(path)
    except ConfigError:
        return fd, position
    os.close(fd)
    return new, 0
