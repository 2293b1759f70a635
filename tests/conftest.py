"""Factories shared by every test package: a daemon in a thread, small specs."""

from __future__ import annotations

import shutil
import time
import sys
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvdaemon.client import KVClient, KVSpec
from kvdaemon.daemon.config import DaemonConfig
from kvdaemon.errors import DaemonUnreachable
from kvdaemon.daemon.server import Daemon
from kvdaemon.wire.sizes import parse_size

MiB = 1024 * 1024
PAGE_BYTES = 2 * MiB


def small_spec(num_layers: int = 1) -> KVSpec:
    """A KV spec whose logical page costs ``2 * num_layers`` physical pages."""
    return KVSpec(num_layers=num_layers, num_kv_heads=2, head_dim=64, block_size=16, dtype="float16")


def short_dir() -> Path:
    """A fresh directory with a short path (AF_UNIX paths are limited to 107 bytes)."""
    return Path(tempfile.mkdtemp(prefix="kvd-", dir="/tmp"))


@dataclass
class RunningDaemon:
    """A daemon serving from a background thread of the test process.

    Clients made by ``client()`` are closed when the daemon stops, with every
    pool they registered, however the test ended.
    """

    daemon: Daemon
    thread: threading.Thread
    dir: Path
    clients: list[KVClient] = field(default_factory=list)

    def client(self, timeout_s: float = 5.0) -> KVClient:
        client = KVClient(self.dir, timeout_s=timeout_s)
        self.clients.append(client)
        return client

    def close_clients(self) -> None:
        for client in self.clients:
            client.close_all()

    def as_if_dead(self) -> None:
        """Judge every tenant process as mapping nothing: an in-process tenant whose connection
        closes then stands for a process that died (its pages are freed, not quarantined)."""
        assert self.daemon.service is not None
        self.daemon.service.quarantine.started = lambda _pid: None

    def check_invariants(self) -> None:
        service = self.daemon.service
        assert service is not None
        with service.lock:
            service.check_invariants()


@contextmanager
def running_daemon(capacity: str = "64MiB", **config: object) -> Iterator[RunningDaemon]:
    """Start a host-backend daemon in a thread; stop it and remove its dir afterwards."""
    root = short_dir()
    cfg = DaemonConfig(dir=root, backend="host", capacity=parse_size(capacity), **config)
    daemon = Daemon(cfg)
    daemon.start()
    thread = threading.Thread(target=daemon.serve, name="kvdaemon-test", daemon=True)
    thread.start()
    running = RunningDaemon(daemon, thread, root)
    try:
        yield running
    finally:
        running.close_clients()
        daemon.stop()
        thread.join(10)
        shutil.rmtree(root, ignore_errors=True)
    assert not thread.is_alive(), "daemon thread did not stop"


@pytest.fixture
def kvd() -> Iterator[RunningDaemon]:
    with running_daemon() as running:
        yield running


def start_daemon(root: Path, capacity: str = "64MiB", *flags: str) -> subprocess.Popen[bytes]:
    """A foreground daemon in a child process; returns once it answers."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvdaemon", "start", "--foreground", "--dir", str(root),
         "--backend", "host", "--capacity", capacity, *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    wait_until(lambda: answers(root), 30, "the daemon did not start")
    return proc


def tenant_rows(client: KVClient) -> dict[str, dict[str, Any]] | None:
    """The daemon's tenant rows by name; ``None`` while ``client`` finds its daemon replaced
    (its first request after a restart may have gone to the old one: ``DaemonUnreachable``)."""
    try:
        return {t["name"]: t for t in client.status()["tenants"]}
    except DaemonUnreachable:
        return None


def answers(root: Path) -> bool:
    """True when a daemon answers ``hello`` at ``root`` within 0.5 s."""
    with KVClient(root, timeout_s=0.5) as client:
        try:
            client.hello()
        except DaemonUnreachable:
            return False
    return True


def wait_until(
    predicate: Callable[[], object], timeout_s: float = 5.0, what: str = "condition not reached in time"
) -> float:
    """Poll ``predicate`` every 5 ms until it is true; return the seconds it took.

    The one way tests wait for something another thread or process does:
    AssertionError(``what``) after ``timeout_s``, never a fixed sleep.
    """
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, what
        time.sleep(0.005)
    return time.monotonic() - started
