"""The systemd notify protocol: READY=1 once clients can connect, STOPPING=1 on the way out,
spoken by the daemon itself over ``$NOTIFY_SOCKET``."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdaemon.cli.notify import notify, notify_ready, notify_stopping
from tests.kvdaemon.cli import test_cli_lifecycle as lifecycle_tests
from tests.kvdaemon.cli.test_cli_lifecycle import HOST_FLAGS, Cli

cli = lifecycle_tests.cli


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket standing in for systemd's, and its ``$NOTIFY_SOCKET`` value."""
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(60)  # a bound on a missing message, not a pace
    yield sock, str(path)
    sock.close()


def fields(datagram: bytes) -> dict[str, str]:
    return dict(line.split("=", 1) for line in datagram.decode().splitlines())


def test_ready_and_stopping_messages(listener: tuple[socket.socket, str]) -> None:
    sock, address = listener
    assert notify_ready("up", {"NOTIFY_SOCKET": address})
    assert fields(sock.recv(4096)) == {"READY": "1", "MAINPID": str(os.getpid()), "STATUS": "up"}
    assert notify_stopping({"NOTIFY_SOCKET": address})
    assert fields(sock.recv(4096)) == {"STOPPING": "1", "STATUS": "stopping"}


def test_abstract_socket_address() -> None:
    name = f"kvdaemon-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(60)
        assert notify({"READY": "1"}, {"NOTIFY_SOCKET": "@" + name})
        assert sock.recv(4096) == b"READY=1"


def test_without_a_socket_nothing_is_sent(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert notify({"READY": "1"}, {}) is False
    with caplog.at_level(logging.WARNING, logger="kvdaemon"):
        assert notify({"READY": "1"}, {"NOTIFY_SOCKET": str(tmp_path / "absent.sock")}) is False
    assert "could not notify the service manager" in caplog.text


def test_a_foreground_daemon_speaks_the_protocol(
    cli: Cli, listener: tuple[socket.socket, str]
) -> None:
    sock, address = listener
    child = subprocess.Popen(
        [sys.executable, "-m", "kvdaemon", "start", "--foreground", "--dir", str(cli.dir),
         *HOST_FLAGS],
        env={**os.environ, "NOTIFY_SOCKET": address},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    cli.pids.add(child.pid)
    ready = fields(sock.recv(4096))
    assert (ready["READY"], ready["MAINPID"]) == ("1", str(child.pid))
    assert ready["STATUS"].startswith(f"kvdaemon 0.1.0 ready at {cli.dir} (pid {child.pid})")
    assert cli.run("status").returncode == 0  # READY=1 came once clients can connect
    assert cli.run("stop").returncode == 0
    assert fields(sock.recv(4096)) == {"STOPPING": "1", "STATUS": "stopping"}
    assert child.wait(timeout=30) == 0
