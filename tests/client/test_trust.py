"""What a client checks before it trusts a daemon (issue #10, item 13).

A directory another user owns, a loose one, or a symlink is refused before
anything is sent; a handle socket served by another uid is refused before the
token goes out.
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdaemon.client import KVClient
from kvdaemon.client.lease import Lease
from kvdaemon.cuda_vmm import HostBackend
from kvdaemon.errors import DaemonUnreachable, Forbidden, UnsafeDirectory
from kvdaemon.wire.paths import DaemonPaths

from tests.conftest import RunningDaemon, running_daemon, short_dir, wait_until

AS_ROOT = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another uid")
NOBODY = 65534


@pytest.fixture
def kvd() -> Iterator[RunningDaemon]:
    with running_daemon() as running:
        yield running


def test_a_loose_directory_is_refused_before_anything_is_sent(kvd: RunningDaemon) -> None:
    os.chmod(kvd.dir, 0o755)
    try:
        with pytest.raises(UnsafeDirectory, match="0700"):
            KVClient(kvd.dir).status()
    finally:
        os.chmod(kvd.dir, 0o700)
    assert KVClient(kvd.dir).status()["tenants"] == []


def test_a_symlinked_directory_is_refused(kvd: RunningDaemon) -> None:
    link = Path(short_dir()) / "d"
    link.symlink_to(kvd.dir)
    try:
        with pytest.raises(UnsafeDirectory, match="symlink"):
            KVClient(link).status()
    finally:
        shutil.rmtree(link.parent)


@AS_ROOT
def test_a_directory_of_another_user_is_refused(kvd: RunningDaemon) -> None:
    os.chown(kvd.dir, NOBODY, -1)
    try:
        with pytest.raises(UnsafeDirectory, match="uid"):
            KVClient(kvd.dir).status()
    finally:
        os.chown(kvd.dir, 0, -1)


@AS_ROOT
def test_a_handle_socket_served_by_another_uid_gets_no_token() -> None:
    root = short_dir()
    paths = DaemonPaths(root)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(paths.handle_socket))
    child = os.fork()
    if child == 0:  # the impostor: listens as another uid, records what it is sent
        try:
            os.setuid(NOBODY)
            listener.listen(1)
            conn, _ = listener.accept()
            conn.settimeout(2)
            try:
                got = conn.recv(4096)
            except OSError:
                got = b""
            os._exit(3 if b"secret-token" in got else 0)
        finally:
            os._exit(1)
    listener.close()
    backend = HostBackend()
    backend.start()
    lease = Lease(paths, 2.0, backend, "a", {"token": "secret-token", "tenant_id": 1,
                                            "page_size": 1 << 21, "num_segments": 2})  # fmt: skip
    refusals: list[Forbidden] = []

    def refused() -> bool:  # the impostor may not listen yet: connecting is refused until then
        try:
            lease.attach()
        except Forbidden as exc:
            refusals.append(exc)
            return True
        except DaemonUnreachable:
            return False
        raise AssertionError("attached to a handle socket of another uid")

    try:
        wait_until(refused, 5, "the impostor never listened")
        assert "uid 65534" in refusals[0].message
        _, status = os.waitpid(child, 0)
        assert os.WEXITSTATUS(status) == 0, "the token reached another uid"
    finally:
        lease.close()
        backend.close()
        shutil.rmtree(root, ignore_errors=True)
