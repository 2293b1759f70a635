"""Where a daemon's files live inside its directory."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from kvdaemon.errors import Forbidden


def default_dir() -> Path:
    """``$KVDAEMON_DIR`` if set, else ``/tmp/kvdaemon-$UID``. Reads the environment when called."""
    env = os.environ.get("KVDAEMON_DIR")
    return Path(env) if env else Path(f"/tmp/kvdaemon-{os.getuid()}")


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


def check_private_dir(root: Path) -> None:
    """Raise ``Forbidden`` unless ``root`` is a real directory (not a symlink) owned by
    this process's uid with no access for group or others.

    What a client checks before it speaks to a daemon: only its own uid can
    have put sockets there. Costs one ``lstat``.
    """
    try:
        info = os.lstat(root)
    except FileNotFoundError:
        return  # nothing there: connecting fails as unreachable
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise Forbidden(f"{root} is not a directory (a symlink or a file): refusing to use it")
    if info.st_uid != os.getuid():
        raise Forbidden(
            f"{root} belongs to uid {info.st_uid}, not to you (uid {os.getuid()}): "
            "refusing to talk to a daemon another user runs"
        )
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise Forbidden(
            f"{root} has mode {stat.S_IMODE(info.st_mode):04o}; a daemon directory must be 0700"
        )
