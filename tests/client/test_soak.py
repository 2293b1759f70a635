"""A bounded soak (issue #10): tenants churning over a daemon that is killed, stopped and restarted.

Eight tenant processes (``soak_worker``) allocate, write a pattern, verify and
free at random for about 45 s, on a daemon whose capacity is well below the sum
of their limits. Meanwhile tenants are SIGKILLed and replaced, the daemon is
SIGKILLed and restarted once and stopped gracefully and started once. A monitor
checks the daemon's accounting all along. Passing means: no corrupted block,
the mapped bytes never above the capacity, and every page free once every
tenant has exited. The counts are the test's last line.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvdaemon.client import KVClient
from kvdaemon.errors import Conflict, KVDaemonError, UnknownTenant

from tests.conftest import short_dir, start_daemon, wait_until

NUM_TENANTS = 8
WORK_S = 45.0
CAPACITY = "32MiB"
PAGE = "64KiB"
LIMIT_BYTES = 8 << 20  # eight tenants may want 64 MiB of 32
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Soak:
    root: Path
    daemon: subprocess.Popen[bytes] | None = None
    workers: dict[str, subprocess.Popen[str]] = field(default_factory=dict)
    results: list[dict[str, Any]] = field(default_factory=list)
    kills: int = 0
    restarts: int = 0
    sleeps: int = 0
    violations: list[str] = field(default_factory=list)
    stop_monitor: threading.Event = field(default_factory=threading.Event)

    def start_daemon(self) -> None:
        self.daemon = start_daemon(self.root, CAPACITY, "--page-size", PAGE)

    def spawn(self, name: str, seed: int, seconds: float) -> None:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.client.soak_worker", str(self.root), name, "--seed", str(seed),
             "--seconds", str(seconds), "--max-bytes", str(LIMIT_BYTES)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=open(self.root / f"{name}.err", "w"), text=True,
        )
        self.workers[name] = proc

    def kill(self, name: str) -> None:
        self.workers.pop(name).kill()
        self.kills += 1

    def collect(self) -> None:
        for name, proc in self.workers.items():
            out, _ = proc.communicate(timeout=120)
            lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            done = [line for line in lines if line.get("event") == "done"]
            assert done, f"worker {name} ended without its counts (status {proc.returncode}):\n{self.log_tail(name)}"
            self.results.append(done[-1])

    def log_tail(self, name: str) -> str:
        """The last 3,000 characters a worker wrote to its stderr."""
        return (self.root / f"{name}.err").read_text()[-3000:]

    def sleep(self, name: str, mode: str) -> None:
        """Sleep ``name`` once it is registered and attached (after a restart it re-registers first).

        On a timeout the assertion says what the daemon last answered, how it sees the
        tenant, and the tail of the tenant's log, so a rare failure explains itself."""
        refusals: dict[str, int] = {}  # each distinct refusal, and how often it came
        with KVClient(self.root) as admin:

            def slept() -> bool:
                try:
                    admin.sleep(name, mode)
                except (UnknownTenant, Conflict) as exc:  # not back yet, or not attached yet
                    kind = f"{type(exc).__name__}: {exc}"
                    refusals[kind] = refusals.get(kind, 0) + 1
                    return False
                return True

            try:
                wait_until(slept, 30, f"{name} could not be put to sleep")
            except AssertionError as exc:
                raise AssertionError(self._why_not_asleep(admin, name, refusals)) from exc
        self.sleeps += 1

    def _why_not_asleep(self, admin: KVClient, name: str, refusals: dict[str, int]) -> str:
        seen = [t for t in admin.status()["tenants"] if t["name"] == name]
        return (f"{name} could not be put to sleep in 30 s ({sum(refusals.values())} refusals; kinds: "
                f"{sorted(refusals)}); the daemon sees it as {seen}; its log ends:\n{self.log_tail(name)}")

    def monitor(self) -> None:
        """Check the daemon's accounting every 100 ms while it answers."""
        client = KVClient(self.root, timeout_s=1.0)
        while not self.stop_monitor.wait(0.1):
            try:
                status = client.status()
            except KVDaemonError:
                continue  # between a kill and a restart
            mapped = sum(t["mapped_bytes"] for t in status["tenants"])
            if mapped > status["capacity_bytes"] or mapped + status["free_bytes"] != status["capacity_bytes"]:
                self.violations.append(f"mapped {mapped}, free {status['free_bytes']}")
        client.close()


@pytest.fixture
def soak() -> Iterator[Soak]:
    state = Soak(short_dir())
    yield state
    state.stop_monitor.set()
    for proc in [*state.workers.values(), state.daemon]:
        if proc is not None and proc.poll() is None:
            proc.kill()
    if os.environ.get("KVD_KEEP_SOAK") is None:
        shutil.rmtree(state.root, ignore_errors=True)
    else:
        print("soak dir", state.root)


@pytest.mark.slow
def test_soak_kills_restarts_and_stops_lose_nothing(soak: Soak, capsys: pytest.CaptureFixture[str]) -> None:
    soak.start_daemon()
    started = time.monotonic()
    for i in range(NUM_TENANTS):
        soak.spawn(f"t{i}", seed=i, seconds=WORK_S)
    monitor = threading.Thread(target=soak.monitor, daemon=True)
    monitor.start()

    def at(seconds: float) -> None:
        time.sleep(max(0.0, started + seconds - time.monotonic()))  # the soak's schedule

    at(12)
    for i in (1, 2):  # two tenants die mid-operation; replacements start
        soak.kill(f"t{i}")
        soak.spawn(f"r{i}", seed=100 + i, seconds=WORK_S - 15)
    at(20)
    assert soak.daemon is not None
    os.kill(soak.daemon.pid, signal.SIGKILL)  # the daemon dies under everyone
    soak.daemon.wait(10)
    soak.start_daemon()
    soak.restarts += 1
    at(26)
    soak.sleep("t4", "warm")  # its next operation wakes it with every byte
    at(32)
    with KVClient(soak.root) as admin:
        admin.shutdown()  # a graceful stop in the middle
    soak.daemon.wait(30)
    soak.start_daemon()
    soak.restarts += 1
    at(38)
    soak.kill("t3")
    soak.sleep("t5", "cold")  # its blocks are dropped: a loss it must notice
    soak.collect()
    soak.stop_monitor.set()
    monitor.join(5)
    with KVClient(soak.root) as client:
        wait_until(lambda: client.status()["tenants"] == [], 15, "tenants left behind")
        status = client.status()
        assert status["free_bytes"] == status["capacity_bytes"]
    totals = {key: sum(r[key] for r in soak.results) for key in ("ops", "allocs", "refusals", "corruptions", "losses")}
    assert soak.violations == []
    assert totals["corruptions"] == 0
    assert totals["losses"] >= 1  # the cold sleeper noticed its loss
    assert totals["ops"] > 1000 and totals["allocs"] > 0
    with capsys.disabled():
        print(
            f"\nsoak: {totals['ops']} ops, {totals['allocs']} blocks allocated, {totals['refusals']} refusals, "
            f"{soak.kills} tenant kills, {soak.sleeps} sleeps (warm, cold), "
            f"{soak.restarts} daemon restarts (1 SIGKILL, 1 graceful), "
            f"{totals['losses']} cold losses, {totals['corruptions']} corruptions"
        )
