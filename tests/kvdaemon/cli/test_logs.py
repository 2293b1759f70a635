"""Where the daemon logs: stderr in the foreground, a private log file when asked (or when
detached), the startup line, rotation by rename (with or without SIGHUP), planted symlinks,
and a log path that is no regular file (a FIFO, a directory, a device, /proc, a symlink)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvdaemon.cli.logs import open_append
from kvdaemon.errors import ConfigError

from tests.conftest import small_spec
from tests.kvdaemon.cli import test_cli_lifecycle as lifecycle_tests
from tests.kvdaemon.cli.test_cli_lifecycle import HOST_FLAGS, Cli, alive, wait_until

cli = lifecycle_tests.cli


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def foreground(cli: Cli, *flags: str) -> subprocess.Popen[str]:
    """``start --foreground`` with stderr (the log) piped; returns once it answers."""
    child = subprocess.Popen(
        [sys.executable, "-m", "kvdaemon", "start", "--foreground", "--dir", str(cli.dir),
         *HOST_FLAGS, *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    cli.pids.add(child.pid)
    wait_until(lambda: cli.run("status").returncode == 0 or child.poll() is not None, 60)
    assert child.poll() is None, child.communicate()
    return child


def stop(cli: Cli, child: subprocess.Popen[str]) -> str:
    """Stop it; its stderr."""
    assert cli.run("stop").returncode == 0
    _, stderr = child.communicate(timeout=30)
    assert child.returncode == 0
    return stderr


def test_foreground_logs_the_startup_line_to_stderr_only(cli: Cli) -> None:
    port = free_port()
    child = foreground(cli, "--metrics-address", f"127.0.0.1:{port}")
    stderr = stop(cli, child)
    assert (
        f"kvdaemon 0.1.0 ready at {cli.dir} (pid {child.pid}): backend host, device 0, "
        f"capacity 64.0 MiB (32 pages of 2.00 MiB), metrics http://127.0.0.1:{port}/metrics"
    ) in stderr
    assert f"kvdaemon {child.pid} stopped" in stderr
    assert not cli.paths.log_file.exists()  # no file unless asked


def test_foreground_with_a_log_file_logs_to_both(cli: Cli, tmp_path: Path) -> None:
    log_file = tmp_path / "kvd.log"
    child = foreground(cli, "--log-file", str(log_file))
    stderr = stop(cli, child)
    text = log_file.read_text()
    assert "metrics off" in text and "metrics off" in stderr
    assert f"kvdaemon {child.pid} stopped" in text
    assert oct(log_file.stat().st_mode & 0o777) == oct(0o600)


def test_a_detached_daemon_logs_to_its_file_and_follows_a_rename(cli: Cli) -> None:
    pid = cli.started_pid()
    log_file = cli.paths.log_file
    assert f"kvdaemon 0.1.0 ready at {cli.dir} (pid {pid})" in log_file.read_text()
    rotated = log_file.with_name("kvdaemon.log.1")
    log_file.rename(rotated)  # what logrotate does (create mode), without any signal
    with cli.client() as client:
        client.lease("after-rename", small_spec(), num_virtual_pages=1).close()
    wait_until(lambda: log_file.exists() and "after-rename" in log_file.read_text())
    assert "after-rename" not in rotated.read_text()

    log_file.rename(log_file.with_name("kvdaemon.log.2"))
    os.kill(pid, signal.SIGHUP)  # what a postrotate script may send: reopen, not die
    with cli.client() as client:
        client.lease("after-hup", small_spec(), num_virtual_pages=1).close()
    wait_until(lambda: log_file.exists() and "after-hup" in log_file.read_text())
    assert alive(pid) and cli.run("status").returncode == 0


def test_planted_symlinks_are_not_followed(cli: Cli, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    cli.paths.log_file.symlink_to(victim)
    done = cli.start()
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"error CONFIG: cannot use log file {cli.paths.log_file}: it is a symbolic link (to {victim}), "
        "never followed; give the file itself with --log-file"
    )
    cli.paths.log_file.unlink()

    partial = cli.paths.pid_file.with_suffix(".pid.tmp")
    partial.symlink_to(victim)  # a leftover name pointing elsewhere: removed, never written through
    cli.started_pid()
    assert victim.read_text() == "precious\n"
    assert not partial.is_symlink()


def test_a_log_file_in_a_missing_directory_names_the_fix(cli: Cli, tmp_path: Path) -> None:
    log_file = tmp_path / "logs" / "kvd.log"
    for done in (cli.start("--log-file", str(log_file)), cli.start("--foreground", "--log-file", str(log_file))):
        assert done.returncode == 2
        assert done.stderr.strip() == (f"error CONFIG: cannot open log file {log_file}: No such file or directory; "
                                       f"create its directory {log_file.parent} first, or name another --log-file")


def _fifo(tmp_path: Path) -> tuple[Path, str]:
    os.mkfifo(tmp_path / "fifo")
    return tmp_path / "fifo", "not a regular file (a FIFO); name a regular file with --log-file"


def _directory(tmp_path: Path) -> tuple[Path, str]:
    (tmp_path / "logs").mkdir()
    return tmp_path / "logs", "not a regular file (a directory); name a regular file with --log-file"


def _char_device(_tmp_path: Path) -> tuple[Path, str]:
    return Path("/dev/null"), "not a regular file (a character device); name a regular file with --log-file"


def _symlink(tmp_path: Path) -> tuple[Path, str]:
    (tmp_path / "real.log").write_text("")
    (tmp_path / "link.log").symlink_to(tmp_path / "real.log")
    return tmp_path / "link.log", (
        f"it is a symbolic link (to {tmp_path / 'real.log'}), never followed; give the file itself with --log-file"
    )


def _kernel_file(_tmp_path: Path) -> tuple[Path, str]:
    """A regular file by ``stat``, the kernel's: refused before it is opened, whoever asks."""
    return Path("/proc/version"), "a kernel file (procfs or sysfs), not a log; name a regular file with --log-file"


UNUSABLE = [_fifo, _directory, _char_device, _symlink, _kernel_file]


@pytest.mark.parametrize("unusable", UNUSABLE, ids=lambda make: make.__name__.strip("_"))
@pytest.mark.parametrize("mode", [(), ("--foreground",)], ids=["detached", "foreground"])
def test_a_log_file_that_is_no_regular_file_is_refused_in_one_line(
    cli: Cli, tmp_path: Path, unusable: Callable[[Path], tuple[Path, str]], mode: tuple[str, ...]
) -> None:
    path, why = unusable(tmp_path)
    done = cli.run("start", *mode, *HOST_FLAGS, "--log-file", str(path), timeout_s=30)  # a FIFO hung here
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"error CONFIG: cannot use log file {path}: {why}\n"  # one line, no traceback
    assert not cli.paths.control_socket.exists() and not cli.paths.pid_file.exists()
    assert cli.run("status").returncode == 1  # no daemon left running
    if path.name == "link.log":
        assert (tmp_path / "real.log").read_text() == ""  # never written through


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_open_append_refuses_a_fifo_someone_reads_without_blocking_or_leaking(tmp_path: Path) -> None:
    fifo, why = _fifo(tmp_path)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # the open for writing would succeed now
    try:
        before = open_fds()
        with pytest.raises(ConfigError) as refused:
            open_append(fifo)
        assert str(refused.value) == f"cannot use log file {fifo}: {why}"
        assert refused.value.code == "CONFIG"
        assert open_fds() == before
        assert os.read(reader, 100) == b""  # nothing written
    finally:
        os.close(reader)


def test_open_append_creates_0600_appends_to_an_existing_file_and_blocks(tmp_path: Path) -> None:
    created = tmp_path / "new.log"
    fd = open_append(created)
    try:
        assert oct(created.stat().st_mode & 0o777) == oct(0o600)
        assert os.get_blocking(fd)  # O_NONBLOCK was for the open only
    finally:
        os.close(fd)
    existing = tmp_path / "old.log"
    existing.write_text("kept\n")
    existing.chmod(0o640)
    fd = open_append(existing)
    try:
        os.write(fd, b"added\n")
    finally:
        os.close(fd)
    assert existing.read_text() == "kept\nadded\n"
    assert oct(existing.stat().st_mode & 0o777) == oct(0o640)  # an existing file keeps its mode


def test_a_fifo_put_where_the_log_was_rotated_fails_only_its_records(cli: Cli) -> None:
    pid = cli.started_pid()
    log_file = cli.paths.log_file
    log_file.rename(log_file.with_name("kvdaemon.log.1"))
    os.mkfifo(log_file)  # the daemon's reopen used to block on it for ever, with every request
    with cli.client() as client:
        client.lease("after-fifo", small_spec(), num_virtual_pages=1).close()
    assert alive(pid) and cli.run("status").returncode == 0
    log_file.unlink()  # a regular file again: the next record opens it
    with cli.client() as client:
        client.lease("after-unlink", small_spec(), num_virtual_pages=1).close()
    wait_until(lambda: log_file.exists() and "after-unlink" in log_file.read_text())
    rotated = log_file.with_name("kvdaemon.log.1").read_text()  # the detached daemon's stderr
    assert "Logging error" not in rotated and "Traceback" not in rotated, "a traceback per lost record"
    assert rotated.count("records are lost") == 1 and rotated.count("is written again") == 1
