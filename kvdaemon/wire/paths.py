"""Where a daemon's files live inside its directory."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


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
