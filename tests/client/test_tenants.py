"""Tenant processes against one daemon: concurrent churn, isolation, SIGKILL leases.

The daemon serves from a thread of the test process (so the test can assert its
invariants while tenants run); every tenant is a separate process running
``tests.client.tenant_worker``, talking JSON lines over its stdin/stdout.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import pytest

from kvdaemon.client import KVClient

from tests.conftest import RunningDaemon, running_daemon

REPO_ROOT = Path(__file__).resolve().parents[2]
PAGE = 64 * 1024  # small pages keep pattern writes and checks cheap
SEGMENTS = 2  # the workers' spec has one layer: K and V
LOGICAL_PAGE = SEGMENTS * PAGE
EVENT_TIMEOUT_S = 30.0  # generous: three workers import torch at once on two cores


@dataclass
class Worker:
    """One tenant process; its stdout events arrive on ``events`` (None at EOF)."""

    name: str
    proc: subprocess.Popen[str]
    stderr_path: Path
    events: queue.Queue[dict[str, Any] | None] = field(default_factory=queue.Queue)

    def _fail(self, why: str) -> NoReturn:
        pytest.fail(f"worker {self.name}: {why}\n--- stderr ---\n{self.stderr_path.read_text()}")

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def next_event(self, timeout_s: float) -> dict[str, Any] | None:
        """The next event, or None if none came within ``timeout_s``; fails on EOF or mismatch."""
        try:
            event = self.events.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if event is None:
            self._fail(f"exited early with status {self.proc.wait()}")
        if event["event"] == "mismatch":
            self._fail(f"pattern mismatch: {event['message']}")
        return event

    def expect(self, kind: str, timeout_s: float = EVENT_TIMEOUT_S) -> dict[str, Any]:
        event = self.next_event(timeout_s)
        if event is None:
            self._fail(f"no {kind!r} event within {timeout_s} s")
        assert event["event"] == kind, event
        return event

    def exit_status(self, timeout_s: float = EVENT_TIMEOUT_S) -> int:
        return self.proc.wait(timeout_s)


def _pump(proc: subprocess.Popen[str], events: queue.Queue[dict[str, Any] | None]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        events.put(json.loads(line))
    events.put(None)


Spawn = Callable[..., Worker]


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawn]:
    """Start tenant workers; every one still running at teardown is killed and reaped."""
    started: list[tuple[Worker, threading.Thread]] = []

    def start(running: RunningDaemon, name: str, tag: int, *args: str) -> Worker:
        stderr_path = tmp_path / f"{name}.stderr"
        argv = [
            sys.executable, "-m", "tests.client.tenant_worker", str(running.dir), name,
            "--tag", str(tag), *args,
        ]
        with stderr_path.open("w") as stderr:
            proc = subprocess.Popen(
                argv, cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
        worker = Worker(name, proc, stderr_path)
        pump = threading.Thread(target=_pump, args=(proc, worker.events), daemon=True)
        pump.start()
        started.append((worker, pump))
        return worker

    yield start
    for worker, pump in started:
        if worker.proc.poll() is None:
            worker.proc.kill()
        worker.proc.wait(10)
        pump.join(10)
        for stream in (worker.proc.stdin, worker.proc.stdout):
            if stream is not None:
                stream.close()


def rows(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in status["tenants"]}


def check_status(status: dict[str, Any]) -> None:
    """DESIGN.md §4 invariants 2 and 3 as ``status`` reports them."""
    mapped = sum(row["mapped_bytes"] for row in status["tenants"])
    assert mapped + status["free_bytes"] == status["capacity_bytes"], status
    for row in status["tenants"]:
        assert row["mapped_bytes"] <= row["max_bytes"], row


def assert_all_back(running: RunningDaemon, client: KVClient) -> None:
    running.check_invariants()
    status = client.status()
    assert status["tenants"] == []
    assert status["free_bytes"] == status["capacity_bytes"]


@contextmanager
def daemon_with_pages(num_pages: int) -> Iterator[RunningDaemon]:
    """A daemon over ``num_pages`` pages of ``PAGE`` bytes.

    The workers are raw leases without a pool agent: they never answer reclaim
    or sleep notices, so a grow short of pages fails fast and no one is slept.
    """
    with running_daemon(
        capacity=f"{num_pages * PAGE // 1024}KiB", page_size_bytes=PAGE, reclaim_sleep=False,
        reclaim_wait_s=0.0,
    ) as kvd:
        yield kvd


# -- concurrent churn ------------------------------------------------------------------

POOL_PAGES = 24  # 12 logical pages: far fewer than the three tenants reach for
ROUNDS = 120


def start_churners(spawn: Spawn, running: RunningDaemon) -> list[Worker]:
    rounds = ["--rounds", str(ROUNDS)]
    return [
        # t0 is capped at 3 logical pages (and probes the cap first); t1, t2 may take the pool
        spawn(running, "t0", 0, "--virtual-pages", "8", "--max-pages", "3", "churn",
              "--seed", "10", *rounds),
        spawn(running, "t1", 1, "--virtual-pages", "16", "churn", "--seed", "11", *rounds),
        spawn(running, "t2", 2, "--virtual-pages", "16", "churn", "--seed", "12", *rounds),
    ]


def watch_until_done(
    running: RunningDaemon, client: KVClient, workers: list[Worker]
) -> tuple[dict[str, dict[str, Any]], int]:
    """Assert the invariants over and over until every worker reports ``done``.

    Returns the ``done`` events by worker name and how many snapshots were checked.
    """
    done: dict[str, dict[str, Any]] = {}
    snapshots = 0
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while len(done) < len(workers):
        assert time.monotonic() < deadline, f"only {sorted(done)} finished in time"
        running.check_invariants()
        check_status(client.status())
        snapshots += 1
        for worker in workers:
            if worker.name not in done:
                event = worker.next_event(0.005)
                if event is not None:
                    assert event["event"] == "done", event
                    done[worker.name] = event
    return done, snapshots


def test_three_tenants_contend_and_never_see_each_others_bytes(spawn: Spawn) -> None:
    with daemon_with_pages(POOL_PAGES) as running, closing(running.client()) as client:
        workers = start_churners(spawn, running)
        for worker in workers:
            worker.expect("ready")
        assert sorted(rows(client.status())) == ["t0", "t1", "t2"]
        for worker in workers:
            worker.send("go")
        done, snapshots = watch_until_done(running, client, workers)
        assert snapshots >= 3

        # every tenant still holds what it says it holds, side by side
        status = client.status()
        check_status(status)
        for name, row in rows(status).items():
            assert row["mapped_bytes"] == done[name]["mapped_pages"] * LOGICAL_PAGE
        for event in done.values():
            assert event["rounds"] == ROUNDS and event["verified_pages"] > 0, event
            assert event["grows"] > 0 and event["shrinks"] > 0, event
        assert done["t0"]["over_limit"] >= 1 and done["t0"]["mapped_pages"] <= 3
        assert sum(event["no_memory"] for event in done.values()) >= 1, done

        for worker in workers:
            worker.send("close")
        for worker in workers:
            worker.expect("closed")
            assert worker.exit_status() == 0
        assert_all_back(running, client)


# -- SIGKILL ---------------------------------------------------------------------------


def wait_for_status(
    client: KVClient, done: Callable[[dict[str, Any]], bool], since: float, timeout_s: float
) -> tuple[float, dict[str, Any]]:
    """Poll ``status`` until ``done(status)``; return the seconds since ``since`` and the status."""
    while True:
        status = client.status()
        elapsed = time.perf_counter() - since
        if done(status):
            return elapsed, status
        assert elapsed < timeout_s, f"status never settled: {status}"


def test_sigkilled_tenant_gives_its_pages_back_when_its_lease_closes(spawn: Spawn) -> None:
    """Nothing but the closed handle socket tells the daemon (no timeout is near); how fast
    is measured by ``bench/lease_expiry.py`` (DESIGN.md §9: within 100 ms)."""
    with daemon_with_pages(32) as running, closing(running.client()) as client:
        victim = spawn(running, "victim", 1, "hold", "--pages", "4")
        survivor = spawn(running, "survivor", 2, "hold", "--pages", "3")
        victim.expect("ready")
        survivor.expect("ready")
        before = client.status()
        assert rows(before)["victim"]["mapped_bytes"] == 4 * LOGICAL_PAGE
        kept = rows(before)["survivor"]["mapped_bytes"]
        assert kept == 3 * LOGICAL_PAGE

        os.kill(victim.proc.pid, signal.SIGKILL)
        killed_at = time.perf_counter()
        _, after = wait_for_status(
            client,
            lambda s: "victim" not in rows(s) and s["free_bytes"] == s["capacity_bytes"] - kept,
            killed_at,
            timeout_s=5.0,
        )
        assert victim.exit_status() == -signal.SIGKILL
        running.check_invariants()

        assert sorted(rows(after)) == ["survivor"]
        assert rows(after)["survivor"]["mapped_bytes"] == kept
        survivor.send("verify")
        assert survivor.expect("verified")["pages"] == 3 * SEGMENTS
        survivor.send("close")
        survivor.expect("closed")
        assert survivor.exit_status() == 0
        assert_all_back(running, client)
