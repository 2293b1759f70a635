"""Where a daemon's files live, and whether a daemon directory may be trusted.

Shared by the daemon (which creates its directory) and by clients (which must
not talk to a daemon in a directory another user controls).

The default directory, first match wins (the environment is read when called):

1. ``$KVDAEMON_DIR``;
2. ``/run/kvdaemon`` when running as root (the systemd unit in ``deploy/`` sets
   ``KVDAEMON_DIR=/run/kvdaemon`` for its non-root user, so the rule holds there too);
3. ``$XDG_RUNTIME_DIR/kvdaemon`` when ``$XDG_RUNTIME_DIR`` is an absolute path to a
   directory of ours (a login session's private runtime directory);
4. ``/tmp/kvdaemon-$UID``.

A daemon and its clients find each other only if they resolve the same
directory: a system daemon (systemd, a container) and clients in another
session should all be given ``KVDAEMON_DIR`` explicitly.
"""

from __future__ import annotations

import fcntl
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvdaemon.errors import ConfigError, UnsafeDirectory

PRIVATE_DIR_MODE = 0o700
SYSTEM_DIR = Path("/run/kvdaemon")


def default_dir(env: Mapping[str, str] | None = None) -> Path:
    """The daemon directory when none is given (see the module docstring). One stat at most."""
    env = os.environ if env is None else env
    if env.get("KVDAEMON_DIR"):
        return Path(env["KVDAEMON_DIR"])
    if os.geteuid() == 0:
        return SYSTEM_DIR
    xdg = env.get("XDG_RUNTIME_DIR", "")
    if xdg.startswith("/") and _is_own_dir(Path(xdg)):
        return Path(xdg) / "kvdaemon"
    return Path(f"/tmp/kvdaemon-{os.getuid()}")


def _is_own_dir(path: Path) -> bool:
    try:
        info = os.stat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()


def check_private_dir(root: Path) -> None:
    """Raise ``UnsafeDirectory`` unless ``root`` is a real directory (not a symlink),
    owned by this process's effective uid, with mode exactly 0700.

    Costs one ``lstat``. Changes nothing: a directory that fails is never fixed
    here, since it may be someone else's (``/tmp`` itself, a shared 0777 folder).
    """
    try:
        info = os.lstat(root)
    except FileNotFoundError as err:
        raise UnsafeDirectory(f"daemon directory {root} does not exist") from err
    except OSError as err:
        raise UnsafeDirectory(f"cannot use {root} as the daemon directory: {err.strerror}") from err
    if stat.S_ISLNK(info.st_mode):
        raise UnsafeDirectory(
            f"daemon directory {root} is a symlink; give the real path with --dir"
        )
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeDirectory(f"daemon directory {root} exists and is not a directory")
    if info.st_uid != os.geteuid():
        raise UnsafeDirectory(
            f"daemon directory {root} belongs to uid {info.st_uid}, not to you "
            f"(uid {os.geteuid()}); choose another directory with --dir"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & (stat.S_ISVTX | stat.S_IWOTH):
        raise UnsafeDirectory(
            f"daemon directory {root} is shared (mode {mode:04o}); "
            "choose a directory of its own with --dir (it is created 0700)"
        )
    if mode != PRIVATE_DIR_MODE:
        raise UnsafeDirectory(
            f"daemon directory {root} has mode {mode:04o}, not 0700; "
            f"run `chmod 700 {root}` if it is yours alone, or choose another directory with --dir"
        )


@dataclass(frozen=True)
class DaemonPaths:
    """The files of one daemon directory (the directory is 0700, sockets 0600)."""

    root: Path

    @property
    def control_socket(self) -> Path:
        return self.root / "control.sock"

    @property
    def control_endpoint(self) -> str:
        return f"ipc://{self.control_socket}"

    @property
    def handle_socket(self) -> Path:
        return self.root / "handles.sock"

    @property
    def pid_file(self) -> Path:
        return self.root / "kvdaemon.pid"

    @property
    def lock_file(self) -> Path:
        return self.root / "kvdaemon.lock"

    @property
    def log_file(self) -> Path:
        return self.root / "kvdaemon.log"

    def sockets(self) -> list[Path]:
        return [self.control_socket, self.handle_socket]


def running_pid(paths: DaemonPaths) -> int | None:
    """The pid of the daemon holding ``paths``' lock, 0 if it holds it but its pid is
    unknown yet, or ``None`` when no daemon runs there. Costs one open and flock.

    The lock, not the pid file, says whether a daemon runs: the kernel drops it
    when the process dies, even by SIGKILL.
    """
    try:
        fd = os.open(paths.lock_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as err:
        raise ConfigError(f"cannot read {paths.lock_file}: {err.strerror}") from err
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return read_pid(paths) or 0
    finally:
        os.close(fd)
    return None


def read_pid(paths: DaemonPaths) -> int | None:
    """The pid in the directory's pid file, or ``None`` (missing, unreadable, not a number)."""
    try:
        fd = os.open(paths.pid_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd) as stream:
        text = stream.read(32)
    try:
        return int(text.strip())
    except ValueError:
        return None
