"""The CLI contract scripts rely on: ``--json`` on every printing command (one object on
stdout, errors too), the exit statuses, and idempotent stop, sleep and wake."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from typing import Any

import pytest

from kvdaemon.client import KVSpec
from tests.kvdaemon.cli import test_cli_lifecycle as lifecycle_tests
from tests.conftest import wait_until
from tests.kvdaemon.cli.test_cli_lifecycle import HOST_FLAGS, Cli

MiB = 1024 * 1024
cli = lifecycle_tests.cli  # the fixture: a detached daemon's directory, cleaned up after
SPEC = KVSpec(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, dtype="float16")
STATUS_KEYS = {"dir", "backend", "device", "pid", "version", "uptime_seconds", "page_size",
               "capacity_bytes", "free_bytes", "device_free_bytes", "quarantined_bytes", "retired_bytes",
               "host_bytes", "counters", "settings", "tenants", "policies", "warnings"}  # fmt: skip


def json_of(done: subprocess.CompletedProcess[str], code: int = 0) -> dict[str, Any]:
    """The one JSON object ``done`` printed, after checking its exit status and quiet stderr."""
    assert (done.returncode, done.stderr) == (code, ""), (done.stdout, done.stderr)
    result = json.loads(done.stdout)  # exactly one object: anything else fails to parse
    assert isinstance(result, dict)
    return result


def error_of(done: subprocess.CompletedProcess[str], code: int, error_code: str) -> str:
    result = json_of(done, code)
    assert set(result) == {"error"} and set(result["error"]) == {"code", "message"}
    assert result["error"]["code"] == error_code
    return str(result["error"]["message"])


def test_start_status_stop_json(cli: Cli) -> None:
    started = json_of(cli.start(*HOST_FLAGS, "--json"))
    assert started == {
        "dir": str(cli.dir), "pid": cli.daemon_pid(), "version": "0.1.0", "backend": "host",
        "device": 0, "capacity_bytes": 64 * MiB, "capacity_asked_bytes": 64 * MiB, "page_size": 2 * MiB,
        "log_file": str(cli.paths.log_file), "metrics_address": None, "metrics_url": None, "warnings": [],
    }  # fmt: skip

    status = json_of(cli.run("status", "--json"))
    assert set(status) == STATUS_KEYS
    assert (status["dir"], status["free_bytes"], status["tenants"]) == (str(cli.dir), 64 * MiB, [])

    stopped = json_of(cli.run("stop", "--json"))
    assert stopped == {"dir": str(cli.dir), "pid": started["pid"], "stopped": True,
                       "signalled": False, "dropped_warm": []}  # fmt: skip


def test_stop_of_a_stopped_daemon_succeeds_and_says_so(cli: Cli) -> None:
    text = cli.run("stop")
    assert (text.returncode, text.stdout.strip()) == (0, f"no kvdaemon running at {cli.dir}; nothing to stop")
    assert json_of(cli.run("stop", "--json")) == {
        "dir": str(cli.dir), "pid": None, "stopped": False, "signalled": False, "dropped_warm": [],
    }  # fmt: skip


def test_tenant_commands_json_and_idempotence(cli: Cli) -> None:
    cli.started_pid()
    client = cli.client()
    pool = client.register("llama-a", SPEC, num_prefetch_pages=0)
    other = client.register("qwen-b", SPEC, num_prefetch_pages=0)
    pool.quiesce_hook = lambda: None  # nothing steps over it: the CLI may sleep it
    try:
        pool.alloc(4)  # one logical page: 2 segments x 2 MiB
        waited = json_of(cli.run("wait", "llama-a", "qwen-b", "--json"))
        assert [row["name"] for row in waited["tenants"]] == ["llama-a", "qwen-b"]
        assert waited["waited_s"] >= 0

        only = json_of(cli.run("status", "qwen-b", "--json"))
        assert set(only) == STATUS_KEYS and [t["name"] for t in only["tenants"]] == ["qwen-b"]

        limited = json_of(cli.run("limit", "llama-a", "--max", "50%", "--weight", "2", "--json"))
        assert limited == {
            "name": "llama-a", "registered": True, "revision": 1, "changed": True, "max_bytes": 32 * MiB,
            "min_bytes": 0, "weight": 2.0, "over_limit_bytes": 0,
            "policy": {"max": "50%", "min": None, "weight": 2.0}, "clamped": [], "warnings": [],
            "logical_page_bytes": 4 * MiB,
        }  # fmt: skip
        again = json_of(cli.run("limit", "llama-a", "--max", "50%", "--json"))  # what it has: no revision spent
        assert again == {**limited, "changed": False}
        assert "(revision 1, unchanged; policy" in cli.run("limit", "llama-a", "--weight", "2").stdout

        slept = json_of(cli.run("sleep", "llama-a", "--json"))
        assert slept == {"name": "llama-a", "state": "sleeping-warm", "changed": True,
                         "host_bytes": 4 * MiB}  # fmt: skip
        again = json_of(cli.run("sleep", "llama-a", "--json"))
        assert again == {**slept, "changed": False}
        text = cli.run("sleep", "llama-a")
        assert (text.returncode, text.stdout.strip()) == (0, "llama-a: already sleeping-warm; nothing to do")

        woke = json_of(cli.run("wake", "llama-a", "--json"))
        assert woke == {"name": "llama-a", "state": "active", "changed": True,
                        "mapped_bytes": 4 * MiB, "cancelled_sleep": False}  # fmt: skip
        assert pool.wait_state(lambda state: state.value == "active", 5)
        awake = json_of(cli.run("wake", "llama-a", "--json"))
        assert awake == {**woke, "changed": False}
        text = cli.run("wake", "qwen-b")
        assert (text.returncode, text.stdout.strip()) == (0, "qwen-b: already active; nothing to do")
    finally:
        pool.close()
        other.close()
        client.close()


def background_sleep(cli: Cli) -> subprocess.Popen[str]:
    """``kvdaemon sleep llama-a --json`` running in the background."""
    return subprocess.Popen([sys.executable, "-m", "kvdaemon", "sleep", "llama-a", "--json", "--dir", str(cli.dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def test_a_wake_cancels_a_sleep_still_waiting_for_its_engine(cli: Cli) -> None:
    cli.started_pid()
    client = cli.client()
    pool = client.register("llama-a", SPEC, num_prefetch_pages=0)
    stepping = threading.Event()
    pool.quiesce_hook = lambda: stepping.wait(10)  # its engine is mid-step until told
    try:
        pool.alloc(4)
        sleep = background_sleep(cli)
        wait_until(lambda: json_of(cli.run("status", "llama-a", "--json"))["tenants"][0]["sleep_pending"] == "warm",
                   10, "the sleep was never pending")  # fmt: skip
        woke = json_of(cli.run("wake", "llama-a", "--json"))
        assert woke == {"name": "llama-a", "state": "active", "changed": True, "mapped_bytes": 4 * MiB,
                        "cancelled_sleep": True}  # fmt: skip
        out, _ = sleep.communicate(timeout=30)
        assert sleep.returncode == 3 and json.loads(out)["error"]["code"] == "CONFLICT"
        stepping.set()  # the step ends: the pool, told of the cancel, keeps its pages
        wait_until(lambda: pool.state.value == "active", 5, "the pool did not stay awake")
        row = json_of(cli.run("status", "llama-a", "--json"))["tenants"][0]
        assert (row["state"], row["mapped_bytes"], row["sleep_pending"]) == ("active", 4 * MiB, None)
        assert pool.mapped_bytes == 4 * MiB
    finally:
        stepping.set()
        pool.close()
        client.close()


def test_a_sleep_waiting_when_the_daemon_stops_is_told_so(cli: Cli) -> None:
    cli.started_pid()
    client = cli.client()
    pool = client.register("llama-a", SPEC, num_prefetch_pages=0)
    stepping = threading.Event()
    pool.quiesce_hook = lambda: stepping.wait(10)
    try:
        pool.alloc(4)
        sleep = background_sleep(cli)
        wait_until(lambda: json_of(cli.run("status", "llama-a", "--json"))["tenants"][0]["sleep_pending"] == "warm",
                   10, "the sleep was never pending")  # fmt: skip
        assert cli.run("stop").returncode == 0
        out, _ = sleep.communicate(timeout=30)
        assert sleep.returncode == 1, out  # the daemon's own word, not "running but not answering" (4)
        assert json.loads(out)["error"] == {"code": "UNREACHABLE",
                                            "message": "the daemon stopped before the tenant slept"}  # fmt: skip
    finally:
        stepping.set()
        pool.close()
        client.close()


def test_top_json_is_one_status_object(cli: Cli) -> None:
    cli.started_pid()
    frame = json_of(cli.run("top", "--json"))
    assert set(frame) == STATUS_KEYS and frame["tenants"] == []


def test_version_json(cli: Cli) -> None:
    alone = json_of(cli.run("version", "--json"))
    assert set(alone) == {"kvdaemon", "python", "torch", "cuda_bindings", "cuda_driver", "driver",
                          "backend", "daemon"}  # fmt: skip
    assert alone["kvdaemon"] == "0.1.0"
    assert alone["python"] == ".".join(map(str, sys.version_info[:3]))
    assert alone["daemon"] is None
    pid = cli.started_pid()
    running = json_of(cli.run("version", "--json"))
    assert running["daemon"] == {"version": "0.1.0", "pid": pid, "backend": "host"}
    assert running["backend"] == "host"
    text = cli.run("version")
    assert text.returncode == 0 and text.stdout.splitlines()[0] == "kvdaemon       0.1.0"
    flag = subprocess.run([sys.executable, "-m", "kvdaemon", "--version"], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert flag.returncode == 0 and flag.stdout.splitlines() == text.stdout.splitlines()[:-1]


def test_errors_are_json_too(cli: Cli) -> None:
    message = error_of(cli.run("status", "--json"), 1, "UNREACHABLE")
    assert message == f"no kvdaemon running at {cli.dir} — start it with `kvdaemon start`"
    for args in (("limit", "x", "--max", "1MiB"), ("sleep", "x"), ("wake", "x"), ("wait", "x")):
        assert error_of(cli.run(*args, "--json"), 1, "UNREACHABLE") == message, args

    cli.started_pid()
    for args in (("status", "nobody"), ("sleep", "nobody"), ("wake", "nobody")):
        assert "'nobody'" in error_of(cli.run(*args, "--json"), 3, "UNKNOWN_TENANT"), args
    assert error_of(cli.start(*HOST_FLAGS, "--json"), 3, "CONFLICT").startswith(
        "a kvdaemon is already running"
    )
    timeout = error_of(cli.run("wait", "nobody", "--timeout", "0.3", "--json"), 5, "TIMEOUT")
    assert timeout == "after 0.3 s: nobody has not registered"


@pytest.mark.parametrize(
    ("args", "code", "fragment"),
    [
        (("limit", "x"), "USAGE", "give at least one of --max, --min, --weight"),
        (("limit", "x", "--max", "eight gigs"), "USAGE", "'eight gigs'"),
        (("limit", "x", "--weight", "0"), "USAGE", "--weight"),
        (("status", "--colour"), "USAGE", "No such option '--colour'"),
        (("wait", "x", "--timeout", "soon"), "USAGE", "'soon'"),
        (("sleep", "bad name!"), "USAGE", "tenant name 'bad name!' must be 1-128 characters"),
        (("wake", "_x"), "USAGE", "tenant name '_x' must be"),
        (("limit", "a/b", "--max", "1MiB"), "USAGE", "tenant name 'a/b' must be"),
        (("status", "ok", "x" * 129), "USAGE", "(129 characters) must be"),
        (("wait", ""), "USAGE", "tenant name '' must be"),
        (("start", "--capacity", "12XB"), "CONFIG", "--capacity: invalid size '12XB'"),
        (("start", "--metrics-address", "nowhere"), "CONFIG", "--metrics-address: "),
        (("start", "--backend", "host", "--capacity", "1000TiB"), "CONFIG", "exceeds the device"),
        (("start", "--config", "/nonexistent.toml"), "CONFIG", "cannot read config file"),
        (("start", "--backend", "host", "--device", "3"), "CONFIG", "device 3 with backend host"),
    ],
)
def test_every_usage_error_exits_2(cli: Cli, args: tuple[str, ...], code: str, fragment: str) -> None:
    assert fragment in error_of(cli.run(*args, "--json"), 2, code)
    text = cli.run(*args)
    assert text.returncode == 2 and fragment in text.stderr and text.stdout == ""
    assert "Traceback" not in text.stderr


def test_config_is_read_by_every_command(cli: Cli, tmp_path: Any) -> None:
    config = tmp_path / "kvdaemon.toml"
    config.write_text(f'dir = "{cli.dir}"\nbackend = "host"\ncapacity = "32MiB"\n')

    def run(*args: str) -> subprocess.CompletedProcess[str]:  # no --dir: it comes from the file
        return subprocess.run([sys.executable, "-m", "kvdaemon", *args, "--config", str(config)],
                              capture_output=True, text=True, timeout=60)  # fmt: skip

    assert json_of(run("start", "--json"))["capacity_bytes"] == 32 * MiB
    cli.pids.add(cli.daemon_pid())
    assert json_of(run("status", "--json"))["dir"] == str(cli.dir)
    assert json_of(run("version", "--json"))["daemon"]["pid"] == cli.daemon_pid()
    assert json_of(run("stop", "--json"))["stopped"] is True


@pytest.mark.parametrize("command", ["start", "status", "stop"])
def test_an_empty_dir_is_a_usage_error_not_the_working_directory(tmp_path: Any, command: str) -> None:
    done = subprocess.run([sys.executable, "-m", "kvdaemon", command, "--dir", "", "--json"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)  # fmt: skip
    assert "the directory must be a non-empty path" in error_of(done, 2, "USAGE")
    assert list(tmp_path.iterdir()) == []  # nothing was made in the working directory


def test_json_before_the_command_is_the_commands_flag(cli: Cli) -> None:
    assert error_of(cli.run("--json", "status"), 1, "UNREACHABLE")
    assert cli.start().returncode == 0
    assert set(json_of(cli.run("--json", "status"))) == STATUS_KEYS
    assert error_of(cli.run("--json", "status", "nobody"), 3, "UNKNOWN_TENANT")
    done = cli.run("--json")  # no command: click's usage error, as before
    assert done.returncode == 2 and done.stdout == ""


@pytest.mark.parametrize("args", [("frobnicate", "--json"), ("--json", "frobnicate")])
def test_an_unknown_command_with_json_is_a_json_usage_error(cli: Cli, args: tuple[str, ...]) -> None:
    assert error_of(cli.run(*args), 2, "USAGE") == "No such command 'frobnicate'."
    done = cli.run("frobnicate")  # without the flag: click's usage text on stderr
    assert done.returncode == 2 and done.stdout == "" and "No such command 'frobnicate'" in done.stderr
