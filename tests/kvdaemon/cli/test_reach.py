"""Telling "no daemon" (exit 1) from "a daemon runs but does not answer" (exit 4), stopping
one that does not answer, and ``kvdaemon wait``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import small_spec
from tests.kvdaemon.cli import test_cli_lifecycle as lifecycle_tests
from tests.kvdaemon.cli.test_cli_lifecycle import Cli, alive

cli = lifecycle_tests.cli

# A process that holds a daemon directory's lock and writes its pid, as a daemon does,
# but never opens its sockets: a daemon stuck before (or instead of) answering.
LOCK_HOLDER = """
import fcntl, os, sys, time
root = sys.argv[1]
fd = os.open(os.path.join(root, "kvdaemon.lock"), os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
with open(os.path.join(root, "kvdaemon.pid"), "w") as f:
    f.write(f"{os.getpid()}\\n")
print("locked", flush=True)
while True:
    time.sleep(3600)
"""


@pytest.fixture
def stuck(cli: Cli) -> Iterator[subprocess.Popen[str]]:
    child = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(cli.dir)],
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    cli.pids.add(child.pid)
    assert child.stdout is not None and child.stdout.readline() == "locked\n"
    yield child
    child.kill()
    child.wait()


def not_answering(cli: Cli, pid: int) -> str:
    return (
        f"kvdaemon at {cli.dir} is running (pid {pid}) but not answering; it may be busy, "
        "starting or hung: see its log, or `kvdaemon stop` signals it"
    )


def test_a_daemon_that_holds_the_lock_but_does_not_answer_exits_4(
    cli: Cli, stuck: subprocess.Popen[str]
) -> None:
    for args in (("status",), ("limit", "x", "--max", "1MiB"), ("wait", "x"), ("top", "--once")):
        done = cli.run(*args)
        assert (done.returncode, done.stderr.strip()) == (4, not_answering(cli, stuck.pid)), args
    as_json = cli.run("status", "--json")
    assert as_json.returncode == 4
    assert json.loads(as_json.stdout)["error"] == {
        "code": "NOT_ANSWERING", "message": not_answering(cli, stuck.pid),
    }  # fmt: skip


def test_stop_signals_a_daemon_that_does_not_answer(cli: Cli, stuck: subprocess.Popen[str]) -> None:
    done = cli.run("stop")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        f"kvdaemon at {cli.dir} did not answer; stopped it with SIGTERM (pid {stuck.pid})"
    )
    assert stuck.wait(timeout=10) == -signal.SIGTERM
    assert cli.run("status").returncode == 1


def test_a_stopped_daemon_process_is_running_but_not_answering(cli: Cli) -> None:
    pid = cli.started_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        done = cli.run("status")
        assert (done.returncode, done.stderr.strip()) == (4, not_answering(cli, pid))
    finally:
        os.kill(pid, signal.SIGCONT)
    assert cli.run("status").returncode == 0
    assert alive(pid)


def test_wait_on_a_stopped_daemon_times_out_at_its_own_timeout(cli: Cli) -> None:
    pid = cli.started_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        done = cli.run("wait", "someone", "--timeout", "1")
    finally:
        os.kill(pid, signal.SIGCONT)
    assert done.returncode == 5  # its timeout, not the status call's (which would say 4: not answering)
    assert "after 1 s: the daemon did not answer" in done.stderr


def test_stop_leaves_a_stale_pid_alone(cli: Cli) -> None:
    """A lock holder whose pid file names another process: that process is never signalled."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER.replace('f.write(f"{os.getpid()}\\n")',
                                                   f'f.write("{bystander.pid}\\n")'), str(cli.dir)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    cli.pids.update({bystander.pid, holder.pid})
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        done = cli.run("stop")
        assert done.returncode == 4
        assert f"is running (pid {bystander.pid}) but not answering" in done.stderr
        assert bystander.poll() is None and holder.poll() is None
    finally:
        for child in (bystander, holder):
            child.kill()
            child.wait()


def test_wait_returns_once_the_tenant_registers(cli: Cli) -> None:
    cli.started_pid()
    waiter = subprocess.Popen(
        [sys.executable, "-m", "kvdaemon", "wait", "late", "--timeout", "60", "--json",
         "--dir", str(cli.dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    with cli.client() as client:
        lease = client.lease("late", small_spec(), num_virtual_pages=1)
        try:
            stdout, stderr = waiter.communicate(timeout=60)
        finally:
            lease.close()
    assert (waiter.returncode, stderr) == (0, "")
    (row,) = json.loads(stdout)["tenants"]
    assert row["name"] == "late"


def test_wait_idle_waits_for_blocks_to_stop_changing(cli: Cli) -> None:
    cli.started_pid()
    with cli.client() as client:
        lease = client.lease("busy", small_spec(), num_virtual_pages=4)
        try:
            lease.grow([0])
            done = cli.run("wait", "busy", "--idle", "0.5", "--json")
            assert done.returncode == 0, done.stderr
            (row,) = json.loads(done.stdout)["tenants"]
            assert row["idle_seconds"] >= 0.5
            late = cli.run("wait", "busy", "--idle", "3600", "--timeout", "0.2")
            assert late.returncode == 5
            assert late.stderr.startswith("error TIMEOUT: after 0.2 s: busy has been idle ")
            assert late.stderr.strip().endswith(", not 3600 s")
        finally:
            lease.close()


def test_wait_sleepable_waits_for_the_engine_to_be_quiescable(cli: Cli) -> None:
    cli.started_pid()
    with cli.client() as client:
        lease = client.lease("loading", small_spec(), num_virtual_pages=4)
        try:
            early = cli.run("wait", "loading", "--sleepable", "--idle", "0.1", "--timeout", "0.5")
            assert early.returncode == 5  # idle since registration, but nothing could quiesce it
            assert "loading's engine cannot be quiesced yet" in early.stderr
            lease.heartbeat(sleepable=True)  # what a pool says once its engine set its hook
            done = cli.run("wait", "loading", "--sleepable", "--idle", "0.1", "--json")
            assert done.returncode == 0, done.stderr
            (row,) = json.loads(done.stdout)["tenants"]
            assert row["sleepable"] is True
        finally:
            lease.close()


def test_unsafe_directories_are_refused_by_every_command(cli: Cli, tmp_path: Path) -> None:
    os.chmod(cli.dir, 0o755)
    for args in (("status",), ("stop",), ("wait", "x"), ("sleep", "x")):
        done = cli.run(*args)
        assert done.returncode == 2, args
        assert done.stderr.startswith(f"error UNSAFE_DIR: daemon directory {cli.dir} has mode 0755")


def test_wait_state_returns_once_the_tenant_is_in_it(cli: Cli) -> None:
    cli.started_pid()
    with cli.client() as client:
        pool = client.register("sleepy", small_spec(), num_prefetch_pages=0)
        pool.quiesce_hook = lambda: None  # nothing steps over it: the CLI may sleep it
        try:
            assert cli.run("wait", "sleepy", "--state", "active").returncode == 0
            late = cli.run("wait", "sleepy", "--state", "sleeping-warm", "--timeout", "0.2")
            assert late.returncode == 5
            assert late.stderr.strip() == (
                "error TIMEOUT: after 0.2 s: sleepy is active, not sleeping-warm"
            )
            assert cli.run("sleep", "sleepy").returncode == 0
            done = cli.run("wait", "sleepy", "--state", "sleeping-warm", "--json")
            assert done.returncode == 0, done.stderr
            assert json.loads(done.stdout)["tenants"][0]["state"] == "sleeping-warm"
        finally:
            pool.close()
