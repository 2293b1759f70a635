"""The real ``kvdaemon`` command line in subprocesses: start, status, limit, stop, crashes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvdaemon.client import KVClient, KVSpec
from kvdaemon.wire.paths import DaemonPaths
from tests.conftest import short_dir, small_spec

MiB = 1024 * 1024
STATUS_KEYS = {"backend", "page_size", "capacity_bytes", "free_bytes", "tenants"}
TENANT_KEYS = {
    "name", "pid", "state", "mapped_bytes", "used_bytes", "max_bytes", "min_bytes", "weight",
    "idle_seconds",
}  # fmt: skip
HOST_FLAGS = ("--backend", "host", "--capacity", "64MiB")


@dataclass
class Cli:
    """Runs ``python -m kvdaemon`` against one daemon directory; remembers daemon pids."""

    dir: Path
    pids: set[int] = field(default_factory=set)

    @property
    def paths(self) -> DaemonPaths:
        return DaemonPaths(self.dir)

    def run(self, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, "-m", "kvdaemon", *args, "--dir", str(self.dir)],
            capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
        self._remember_pid()
        return done

    def start(self, *flags: str) -> subprocess.CompletedProcess[str]:
        return self.run("start", *(flags or HOST_FLAGS))

    def started_pid(self) -> int:
        done = self.start()
        assert done.returncode == 0, done.stderr
        return self.daemon_pid()

    def foreground(self, *flags: str) -> subprocess.Popen[str]:
        """``start --foreground`` as a child of the test; returns once it answers."""
        child = subprocess.Popen(
            [sys.executable, "-m", "kvdaemon", "start", "--foreground", "--dir", str(self.dir),
             *(flags or HOST_FLAGS)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self.pids.add(child.pid)
        wait_until(lambda: self.paths.handle_socket.exists() or child.poll() is not None)
        assert child.poll() is None, child.stdout.read() if child.stdout else ""
        return child

    def daemon_pid(self) -> int:
        return int(self.paths.pid_file.read_text())

    def _remember_pid(self) -> None:
        try:
            self.pids.add(self.daemon_pid())
        except (FileNotFoundError, ValueError):
            pass

    def client(self) -> KVClient:
        return KVClient(self.dir, timeout_s=5.0)


def wait_until(condition: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (exited, not yet reaped by its parent) is not alive."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_all(pids: set[int]) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda pid=pid: not alive(pid))


@pytest.fixture
def cli() -> Iterator[Cli]:
    runner = Cli(short_dir())
    try:
        yield runner
    finally:
        if runner.paths.control_socket.exists():
            runner.run("stop", timeout_s=30)
        kill_all(runner.pids)
        shutil.rmtree(runner.dir, ignore_errors=True)


def test_a_capacity_off_whole_pages_is_rounded_down_and_says_so(cli: Cli) -> None:
    done = cli.start("--backend", "host", "--capacity", "3MiB", "--page-size", "2MiB")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        f"kvdaemon running at {cli.dir} (pid {cli.daemon_pid()}, backend host, capacity 2.00 MiB; "
        "the 3.00 MiB asked, rounded down to whole 2.00 MiB pages)"
    )
    cli.run("stop", timeout_s=30)
    done = cli.start("--backend", "host", "--capacity", "64MiB", "--page-size", "48KiB")  # 63.98 MiB: shows 64.0
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        f"kvdaemon running at {cli.dir} (pid {cli.daemon_pid()}, backend host, capacity 64.0 MiB (67092480 B); "
        "the 67108864 B asked, rounded down to whole 48.0 KiB pages)"
    )
    cli.run("stop", timeout_s=30)
    started = json.loads(cli.start("--backend", "host", "--capacity", "3MiB", "--page-size", "2MiB", "--json").stdout)
    assert (started["capacity_bytes"], started["capacity_asked_bytes"]) == (2 * MiB, 3 * MiB)


def test_start_status_stop(cli: Cli) -> None:
    done = cli.start()
    assert done.returncode == 0, done.stderr
    pid = cli.daemon_pid()
    assert done.stdout.strip() == (
        f"kvdaemon running at {cli.dir} (pid {pid}, backend host, capacity 64.0 MiB)"
    )
    assert alive(pid)

    status = cli.run("status")
    assert status.returncode == 0, status.stderr
    assert "backend host" in status.stdout and "capacity 64.0 MiB" in status.stdout
    assert "free 64.0 MiB" in status.stdout

    stopped = cli.run("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.strip() == f"kvdaemon at {cli.dir} stopped (pid {pid})"
    assert not alive(pid)
    assert not any(path.exists() for path in cli.paths.sockets())
    assert not cli.paths.pid_file.exists()

    after = cli.run("status")
    assert after.returncode == 1
    assert after.stderr.strip() == (
        f"no kvdaemon running at {cli.dir} — start it with `kvdaemon start`"
    )


def test_dir_is_0700_and_sockets_0600(cli: Cli) -> None:
    cli.started_pid()
    assert stat.S_IMODE(cli.dir.stat().st_mode) == 0o700
    for path in cli.paths.sockets():
        info = path.stat()
        assert stat.S_ISSOCK(info.st_mode)
        assert stat.S_IMODE(info.st_mode) == 0o600
    for path in (cli.paths.pid_file, cli.paths.lock_file, cli.paths.log_file):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_loose_dir_is_refused_with_exit_2_and_left_alone(cli: Cli) -> None:
    os.chmod(cli.dir, 0o755)
    done = cli.start()
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"error UNSAFE_DIR: daemon directory {cli.dir} has mode 0755, not 0700; run "
        f"`chmod 700 {cli.dir}` if it is yours alone, or choose another directory with --dir"
    )
    assert stat.S_IMODE(cli.dir.stat().st_mode) == 0o755
    assert list(cli.dir.iterdir()) == []


def test_second_start_is_refused(cli: Cli) -> None:
    pid = cli.started_pid()
    for again in (cli.start(), cli.run("start", "--foreground", *HOST_FLAGS)):
        assert again.returncode == 3
        assert again.stderr.strip() == (
            f"error CONFLICT: a kvdaemon is already running at {cli.dir} (pid {pid})"
        )
    assert cli.daemon_pid() == pid
    assert cli.run("status").returncode == 0


def test_starts_racing_leave_one_daemon_and_each_loser_one_conflict_line(cli: Cli) -> None:
    command = [sys.executable, "-m", "kvdaemon", "start", *HOST_FLAGS, "--dir", str(cli.dir)]
    starts = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(3)]
    done = [(child.wait(60), *child.communicate()) for child in starts]
    cli.pids.add(cli.daemon_pid())
    assert sorted(code for code, _, _ in done) == [0, 3, 3], done
    for code, _, err in done:
        if code:
            assert err.splitlines() == [f"error CONFLICT: a kvdaemon is already running at {cli.dir} "
                                        f"(pid {cli.daemon_pid()})"], err
    assert cli.run("status").returncode == 0


def test_status_json_is_the_status_object(cli: Cli) -> None:
    cli.started_pid()
    done = cli.run("status", "--json")
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert set(status) == STATUS_KEYS | {
        "dir", "host_bytes", "quarantined_bytes", "retired_bytes", "counters", "device", "pid", "version",
        "uptime_seconds", "policies", "device_free_bytes", "settings", "warnings"}
    assert status["dir"] == str(cli.dir)
    assert {key: status[key] for key in STATUS_KEYS} == {
        "backend": "host", "page_size": 2 * MiB, "capacity_bytes": 64 * MiB,
        "free_bytes": 64 * MiB, "tenants": [],
    }  # fmt: skip
    assert status["host_bytes"] == 0
    assert status["counters"] == {
        "parked_grows": 0, "reclaim_requests": 0, "victims_slept": 0, "sleeps": 0, "wakes": 0,
        "never_attached": 0,
    }


def test_status_and_limit_with_a_tenant(cli: Cli) -> None:
    cli.started_pid()
    client = cli.client()
    lease = client.lease("llama-a", small_spec(), num_virtual_pages=8)
    try:
        lease.grow([0, 1])  # 2 logical pages x 2 segments x 2 MiB
        limited = cli.run("limit", "llama-a", "--max", "50%", "--min", "4MiB", "--weight", "2")
        assert limited.returncode == 0, limited.stderr
        assert limited.stdout.strip() == (
            "llama-a: limit 32.0 MiB, min 4.00 MiB, weight 2 "
            "(revision 1; policy max 50%, min 4.00 MiB, weight 2)"
        )

        status = json.loads(cli.run("status", "--json").stdout)
        (tenant,) = status["tenants"]
        assert TENANT_KEYS <= set(tenant)
        assert tenant["name"] == "llama-a"
        assert (tenant["pid"], tenant["state"]) == (os.getpid(), "active")
        assert (tenant["mapped_bytes"], tenant["max_bytes"], tenant["min_bytes"]) == (
            8 * MiB, 32 * MiB, 4 * MiB,
        )  # fmt: skip
        assert tenant["weight"] == 2
        assert status["free_bytes"] == 56 * MiB

        table = cli.run("status")
        assert table.returncode == 0, table.stderr
        (row,) = [line for line in table.stdout.splitlines() if line.startswith("llama-a ")]
        assert row.split() == ["llama-a", str(os.getpid()), "active", "8.00M", "0", "32.0M",
                               "4.00M", "2", row.split()[-1]]  # fmt: skip
        assert table.stdout.splitlines()[-3:] == [
            "llama-a: cannot be slept (no quiesce hook)",  # a raw lease has no quiesce hook
            "operator policies (kvdaemon limit; [tenants] of the config file):",
            "  llama-a: max 50% (limit), min 4.00 MiB (limit), weight 2 (limit)",
        ]
    finally:
        lease.close()
        client.close()


def test_limit_errors(cli: Cli) -> None:
    cli.started_pid()
    conflicting = cli.run("limit", "nobody", "--max", "8MiB", "--min", "16MiB")
    assert conflicting.returncode == 3
    assert conflicting.stderr.startswith("error BAD_REQUEST: min 16777216 (16.0 MiB) of 'nobody'")

    nothing = cli.run("limit", "nobody")
    assert nothing.returncode == 2
    assert "at least one of --max, --min, --weight" in nothing.stderr

    bad_size = cli.run("limit", "nobody", "--max", "eight gigs")
    assert bad_size.returncode == 2
    assert "'eight gigs'" in bad_size.stderr

    bad_weight = cli.run("limit", "nobody", "--weight", "0")
    assert bad_weight.returncode == 2


def test_commands_without_a_daemon_exit_1(cli: Cli) -> None:
    message = f"no kvdaemon running at {cli.dir} — start it with `kvdaemon start`"
    for args in (("status",), ("limit", "x", "--max", "1MiB"), ("sleep", "x"), ("wake", "x"),
                 ("wait", "x"), ("top", "--once")):
        done = cli.run(*args)
        assert (done.returncode, done.stderr.strip(), done.stdout) == (1, message, ""), args


def test_bad_config_exits_2_and_starts_nothing(cli: Cli) -> None:
    done = cli.start("--backend", "host", "--capacity", "12 parsecs")
    assert done.returncode == 2
    assert done.stderr.startswith("error CONFIG: --capacity: invalid size '12 parsecs'")
    assert not cli.paths.pid_file.exists()


def test_start_after_sigkill_cleans_stale_files(cli: Cli) -> None:
    pid = cli.started_pid()
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not alive(pid))
    assert cli.paths.pid_file.exists() and cli.paths.control_socket.exists()  # stale

    down = cli.run("status")
    assert down.returncode == 1

    new_pid = cli.started_pid()
    assert new_pid != pid
    assert cli.run("status").returncode == 0
    assert cli.run("stop").returncode == 0
    assert not alive(new_pid)


def test_sigterm_stops_gracefully(cli: Cli) -> None:
    pid = cli.started_pid()
    os.kill(pid, signal.SIGTERM)
    wait_until(lambda: not alive(pid))
    assert not any(path.exists() for path in cli.paths.sockets())
    assert not cli.paths.pid_file.exists()
    log = cli.paths.log_file.read_text()
    assert "received SIGTERM" in log and f"kvdaemon {pid} stopped" in log
    assert cli.run("status").returncode == 1


def test_foreground_runs_until_sigint(cli: Cli) -> None:
    child = cli.foreground()
    wait_until(lambda: cli.run("status").returncode == 0)
    assert cli.daemon_pid() == child.pid
    child.send_signal(signal.SIGINT)
    assert child.wait(timeout=30) == 0
    output = child.stdout.read() if child.stdout else ""
    assert "received SIGINT" in output
    assert not any(path.exists() for path in cli.paths.sockets())


def test_foreground_json_prints_one_object_once_ready(cli: Cli) -> None:
    child = subprocess.Popen(
        [sys.executable, "-m", "kvdaemon", "start", "--foreground", "--json", "--dir", str(cli.dir), *HOST_FLAGS],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    cli.pids.add(child.pid)
    assert child.stdout is not None
    ready = json.loads(child.stdout.readline())  # the log goes to stderr: stdout is this line
    assert ready == {"dir": str(cli.dir), "pid": child.pid, "version": ready["version"], "ready": True,
                     "backend": "host", "device": 0, "capacity_bytes": 64 * MiB, "page_size": 2 * MiB,
                     "metrics_address": None, "metrics_url": None}  # fmt: skip
    assert cli.run("status").returncode == 0  # ready means clients can connect
    assert cli.run("stop").returncode == 0 and child.wait(timeout=10) == 0
    assert child.stdout.read() == ""


def test_stop_of_a_foreground_daemon(cli: Cli) -> None:
    child = cli.foreground()
    stopped = cli.run("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert child.wait(timeout=5) == 0


def test_metrics_port_serves_prometheus(cli: Cli) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = cli.start(*HOST_FLAGS, "--metrics-port", str(port))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(f", metrics http://127.0.0.1:{port}/metrics)")  # where to scrape
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert samples["kvdaemon_capacity_bytes"] == 64 * MiB
    assert samples["kvdaemon_free_bytes"] == 64 * MiB
    assert samples["kvdaemon_grant_latency_seconds_count"] == 0


def test_a_capacity_larger_than_the_device_is_a_usage_error(cli: Cli) -> None:
    for flags in ((), ("--foreground",)):
        done = cli.start("--backend", "host", "--capacity", "1000TiB", *flags)  # > this machine
        assert done.returncode == 2, done.stderr
        (line,) = done.stderr.splitlines()
        assert line.startswith("error CONFIG: capacity 1099511627776000 (1000.0 TiB) exceeds the device")
        assert cli.run("status").returncode == 1


def test_daemon_process_does_not_load_torch(cli: Cli) -> None:
    pid = cli.started_pid()
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert "libtorch" not in maps


def test_busy_metrics_port_fails_the_start_with_a_clear_error(cli: Cli) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = cli.start(*HOST_FLAGS, "--metrics-port", str(port))
    assert done.returncode == 2
    assert done.stderr.startswith(f"error CONFIG: cannot serve metrics on 127.0.0.1:{port}: ")
    assert not any(path.exists() for path in cli.paths.sockets())
    assert cli.run("status").returncode == 1


def test_sleep_and_wake_from_the_cli(cli: Cli) -> None:
    cli.started_pid()
    client = cli.client()
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, dtype="float16")
    pool = client.register("llama-a", spec, num_prefetch_pages=0)
    pool.quiesce_hook = lambda: None  # no engine step to wait for: the CLI may sleep it
    try:
        blocks = pool.alloc(4)
        pool.key_cache(0)[blocks] = 5
        slept = cli.run("sleep", "llama-a")
        assert slept.returncode == 0, slept.stderr
        assert slept.stdout.strip() == "llama-a: sleeping-warm, 4.00 MiB kept in host memory"
        (row,) = json.loads(cli.run("status", "--json").stdout)["tenants"]
        assert (row["state"], row["mapped_bytes"], row["host_bytes"]) == ("sleeping-warm", 0, 4 << 20)
        again = cli.run("sleep", "llama-a")
        assert again.returncode == 0, again.stderr  # asleep already: said so
        woke = cli.run("wake", "llama-a")
        assert woke.returncode == 0, woke.stderr
        assert woke.stdout.strip() == "llama-a: active, 4.00 MiB mapped"
        assert pool.wait_state(lambda state: state.value == "active", 5)
        assert float(pool.key_cache(0)[blocks].float().mean()) == 5.0
        cold = cli.run("sleep", "llama-a", "--cold")
        assert cold.stdout.strip() == "llama-a: sleeping-cold"
        assert cli.run("wake", "nobody").returncode == 3
    finally:
        pool.close()
        client.close()


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_stop_says_whose_warm_kv_dies_with_the_daemon(cli: Cli, as_json: bool) -> None:
    pid = cli.started_pid()
    client = cli.client()
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, dtype="float16")
    pool = client.register("llama-a", spec, num_prefetch_pages=0)
    pool.quiesce_hook = lambda: None
    try:
        pool.alloc(4)
        assert cli.run("sleep", "llama-a").returncode == 0
        stopped = cli.run("stop", *(["--json"] if as_json else []))
        assert stopped.returncode == 0, stopped.stderr
        if as_json:
            assert json.loads(stopped.stdout)["dropped_warm"] == [{"name": "llama-a", "host_bytes": 4 << 20}]
        else:
            assert stopped.stdout.strip() == (f"kvdaemon at {cli.dir} stopped (pid {pid}); the warm KV of "
                                              "llama-a (4.00 MiB) died with it: it wakes with an empty cache")
    finally:
        pool.close()
        client.close()


def test_bad_paths_are_one_line_usage_errors(cli: Cli) -> None:
    a_file = cli.dir / "file"
    a_file.write_text("")
    for target, reason in ((Path("/proc/kvd-test/x"), "No such file or directory"),
                           (a_file / "kvd", "Not a directory"),
                           (a_file / "deeper" / "kvd", "Not a directory")):  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-m", "kvdaemon", "start", "--dir", str(target), *HOST_FLAGS],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert done.stderr.splitlines() == [
            f"error CONFIG: cannot create daemon directory {target}: {reason}; "
            "choose another directory with --dir"
        ]


@pytest.mark.parametrize("args", [
    ("wait", "w", "--timeout", "nan"), ("wait", "w", "--idle", "nan", "--timeout", "1"),
    ("stop", "--timeout", "inf"), ("top", "--interval", "nan"),
])
def test_durations_that_are_not_finite_are_usage_errors(cli: Cli, args: tuple[str, ...]) -> None:
    done = cli.run(*args, timeout_s=20)
    assert done.returncode == 2 and "is not a finite number of seconds" in done.stderr, done
