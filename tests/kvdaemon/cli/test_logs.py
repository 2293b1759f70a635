"""Where the daemon logs: stderr in the foreground, a private log file when asked (or when
detached), the startup line, rotation by rename (with or without SIGHUP), planted symlinks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

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
        f"error CONFIG: cannot open log file {cli.paths.log_file}: Too many levels of symbolic links"
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
