"""The systemd readiness protocol (``sd_notify``), spoken without libsystemd.

Under a ``Type=notify`` unit, systemd sets ``$NOTIFY_SOCKET`` to an AF_UNIX
datagram socket (a path, or an abstract name written with a leading ``@``)
and waits for ``READY=1`` before it counts the service as started;
``STOPPING=1`` says a shutdown has begun. Each message is one datagram of
newline-separated ``KEY=VALUE`` lines. Without ``$NOTIFY_SOCKET`` every call
is a no-op, so the daemon calls these unconditionally.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger("kvdaemon")


def notify(state: Mapping[str, str], env: Mapping[str, str] | None = None) -> bool:
    """Send ``state`` (e.g. ``{"READY": "1"}``) to ``$NOTIFY_SOCKET``.

    Returns True when it was sent, False when there is no socket to send to or
    sending failed (logged as a warning: the service manager then times out on
    its own). Costs one datagram; never blocks.
    """
    address = (os.environ if env is None else env).get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    payload = "\n".join(f"{key}={value}" for key, value in state.items()).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.setblocking(False)
            sock.sendto(payload, address)
    except OSError as err:
        log.warning("could not notify the service manager at %s: %s", address, err)
        return False
    return True


def notify_ready(status: str, env: Mapping[str, str] | None = None) -> bool:
    """``READY=1`` with this process as the main pid and a one-line ``STATUS``."""
    return notify({"READY": "1", "MAINPID": str(os.getpid()), "STATUS": status}, env)


def notify_stopping(env: Mapping[str, str] | None = None) -> bool:
    """``STOPPING=1``: the daemon has begun to shut down."""
    return notify({"STOPPING": "1", "STATUS": "stopping"}, env)
