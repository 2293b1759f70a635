"""kvdaemon.cli.lifecycle in-process: the directory, the lock, run_foreground, start failures."""

from __future__ import annotations

import fcntl
import gc
import logging
import os
import shutil
import signal
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdaemon.cli import detach, lifecycle, reach
from kvdaemon.client import KVClient
from kvdaemon.daemon.config import DaemonConfig
from kvdaemon.errors import ConfigError, Conflict, DaemonUnreachable, LifecycleError, UnsafeDirectory
from kvdaemon.wire.paths import DaemonPaths, running_pid
from kvdaemon.wire.sizes import parse_size
from tests.conftest import short_dir


def make_config(root: Path, capacity: str = "16MiB", **settings: object) -> DaemonConfig:
    return DaemonConfig(dir=root, backend="host", capacity=parse_size(capacity), **settings)


@pytest.fixture
def root() -> Iterator[Path]:
    path = short_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def hold_lock(paths: DaemonPaths) -> int:
    """Take the directory's lock the way a running daemon does; returns the fd to close."""
    fd = os.open(paths.lock_file, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_prepare_dir_creates_0700_with_parents(root: Path) -> None:
    target = root / "a" / "kvd"
    old_umask = os.umask(0)
    try:
        lifecycle.prepare_dir(target)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o755, 0o777, 0o1777])
def test_prepare_dir_refuses_an_existing_loose_dir_and_leaves_it_alone(root: Path, mode: int) -> None:
    target = root / "loose"
    target.mkdir()
    os.chmod(target, mode)
    with pytest.raises(UnsafeDirectory) as caught:
        lifecycle.prepare_dir(target)
    assert caught.value.code == "UNSAFE_DIR"
    assert f"{target}" in caught.value.message and f"{mode:04o}" in caught.value.message
    assert stat.S_IMODE(target.stat().st_mode) == mode  # never chmodded
    assert list(target.iterdir()) == []  # nothing created in it


def test_prepare_dir_refuses_a_file(root: Path) -> None:
    target = root / "file"
    target.write_text("")
    with pytest.raises(UnsafeDirectory, match="not a directory"):
        lifecycle.prepare_dir(target)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to hand a directory to another uid")
def test_prepare_dir_refuses_another_users_dir(root: Path) -> None:
    target = root / "theirs"
    target.mkdir()
    os.chmod(target, 0o777)
    os.chown(target, 12345, 12345)
    with pytest.raises(UnsafeDirectory, match="belongs to uid 12345") as caught:
        lifecycle.prepare_dir(target)
    assert caught.value.code == "UNSAFE_DIR"
    assert stat.S_IMODE(target.stat().st_mode) == 0o777  # left alone


def test_running_pid_reads_the_lock(root: Path) -> None:
    paths = DaemonPaths(root)
    assert running_pid(paths) is None  # no lock file
    paths.pid_file.write_text("4242\n")
    paths.lock_file.touch()
    assert running_pid(paths) is None  # stale pid file, nobody holds the lock
    fd = hold_lock(paths)
    try:
        assert running_pid(paths) == 4242
        paths.pid_file.unlink()
        assert running_pid(paths) == 0  # held, pid not written yet
    finally:
        os.close(fd)
    assert running_pid(paths) is None


def test_connect_fails_fast_without_a_daemon(root: Path) -> None:
    DaemonPaths(root).control_socket.touch()  # a dead daemon's leftover
    started = time.monotonic()
    with pytest.raises(DaemonUnreachable) as caught:
        reach.connect(root)
    assert time.monotonic() - started < 1.0
    assert caught.value.message == (
        f"no kvdaemon running at {root} — start it with `kvdaemon start`"
    )


def test_run_foreground_refuses_a_held_lock(root: Path) -> None:
    paths = DaemonPaths(root)
    paths.pid_file.write_text("4242\n")
    fd = hold_lock(paths)
    try:
        with pytest.raises(Conflict) as caught:
            lifecycle.run_foreground(make_config(root))
    finally:
        os.close(fd)
    assert caught.value.message == f"a kvdaemon is already running at {root} (pid 4242)"
    assert paths.pid_file.read_text() == "4242\n"  # the running daemon's file is untouched


def test_run_foreground_serves_until_shutdown_and_cleans_up(root: Path) -> None:
    paths = DaemonPaths(root)
    paths.control_socket.touch()  # stale, from a dead daemon
    paths.pid_file.write_text("4242\n")
    seen: dict[str, object] = {}

    def shut_down_once_up() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if paths.handle_socket.exists():
                client = KVClient(root, timeout_s=5)
                try:
                    seen["pid"] = client.hello()["pid"]
                    seen["pid_file"] = paths.pid_file.read_text()
                    seen["running"] = running_pid(paths)
                    seen["heap_frozen"] = gc.get_freeze_count() > 0
                    client.shutdown()
                finally:
                    client.close()
                return
            time.sleep(0.02)

    handlers_before = list(logging.getLogger("kvdaemon").handlers)
    sigterm_before = signal.getsignal(signal.SIGTERM)
    helper = threading.Thread(target=shut_down_once_up)
    gc.unfreeze()  # whatever froze before: the daemon must freeze its own heap once it serves
    helper.start()
    try:
        assert lifecycle.run_foreground(make_config(root, log_file=paths.log_file)) == 0
    finally:
        gc.unfreeze()
    helper.join()

    assert seen == {"pid": os.getpid(), "pid_file": f"{os.getpid()}\n", "running": os.getpid(),
                    "heap_frozen": True}
    assert not paths.pid_file.exists()
    assert not any(path.exists() for path in paths.sockets())
    assert running_pid(paths) is None
    assert logging.getLogger("kvdaemon").handlers == handlers_before
    assert signal.getsignal(signal.SIGTERM) is sigterm_before
    assert f"kvdaemon {os.getpid()} stopped" in paths.log_file.read_text()


def test_start_detached_reports_a_refused_config_as_the_childs_own_error(root: Path) -> None:
    config = make_config(root, capacity="1000TiB")  # more than this machine has
    with pytest.raises(ConfigError) as caught:
        detach.start_detached(config, timeout_s=30)
    assert caught.value.code == "CONFIG"
    assert caught.value.message.startswith("capacity 1099511627776000 (1000.0 TiB) exceeds the device")
    assert "\n" not in caught.value.message
    assert running_pid(DaemonPaths(root)) is None


def test_start_detached_names_an_interpreter_it_cannot_run(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(detach.sys, "executable", str(root / "no-such-python"))
    with pytest.raises(LifecycleError, match=r"cannot start the daemon's process with .*no-such-python: "
                                             r"No such file or directory; run kvdaemon from"):
        detach.start_detached(make_config(root))
    assert running_pid(DaemonPaths(root)) is None


def test_start_detached_refuses_a_running_daemon(root: Path) -> None:
    paths = DaemonPaths(root)
    paths.pid_file.write_text("4242\n")
    fd = hold_lock(paths)
    try:
        with pytest.raises(Conflict, match=r"already running .* \(pid 4242\)"):
            detach.start_detached(make_config(root))
    finally:
        os.close(fd)
