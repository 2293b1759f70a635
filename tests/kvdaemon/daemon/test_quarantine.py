"""Quarantine: a tenant whose lease ends while its process still maps pages keeps them owned."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdaemon.daemon.quarantine import process_start
from kvdaemon.errors import PoolExhausted

from tests.conftest import RunningDaemon, running_daemon, small_spec, wait_until
from tests.kvdaemon.daemon.test_reclaim_share import tokens
from tests.kvdaemon.daemon.test_service import NUM_PAGES, Harness

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def h() -> Iterator[Harness]:
    harness = Harness()
    yield harness
    harness.backend.close()


def test_a_live_process_keeps_its_pages_until_it_maps_nothing(h: Harness) -> None:
    alive = {1234: 50.0}  # pid -> start time (the harness attaches every tenant as pid 1234)
    h.service.quarantine.started = alive.get
    _, tok = tokens(h, {"a": 3, "b": 1})
    h.service.remove(h.service.tenants.named("a"), "its lease ended without an unregister", clean=False)
    status = h.ok("status")
    page = h.service.pages.page_size_bytes
    assert [t["name"] for t in status["tenants"]] == ["b"]
    assert status["quarantined_bytes"] == 6 * page and status["free_bytes"] == (NUM_PAGES - 8) * page
    h.service.check_invariants()
    assert h.error("grow", **h.auth("b", tok["b"], logical_pages=list(range(1, 8)), wait_s=0)) == "NO_MEMORY"
    assert h.register("a")["token"], "the name is free again"
    h.tick(0.2)
    assert h.ok("status")["quarantined_bytes"] == 6 * page, "freed while the process still maps"
    del alive[1234]  # it exited
    h.tick(0.2)
    assert h.ok("status")["quarantined_bytes"] == 0
    assert h.ok("status")["free_bytes"] == (NUM_PAGES - 2) * page


def test_a_pid_taken_by_a_new_process_frees_the_pages(h: Harness) -> None:
    alive = {1234: 50.0}
    h.service.quarantine.started = alive.get
    tokens(h, {"a": 2})
    h.service.remove(h.service.tenants.named("a"), "lease ended", clean=False)
    alive[1234] = 99.0  # the pid now names another process
    h.tick(0.2)
    assert h.ok("status")["quarantined_bytes"] == 0


def test_a_clean_unregister_and_a_dead_process_free_at_once(h: Harness) -> None:
    h.service.quarantine.started = lambda _pid: 50.0  # every process alive
    _, tok = tokens(h, {"a": 2, "b": 2})
    h.ok("unregister", **h.auth("a", tok["a"]))
    h.service.quarantine.started = lambda _pid: None  # b's process died
    h.service.remove(h.service.tenants.named("b"), "lease ended", clean=False)
    status = h.ok("status")
    assert status["quarantined_bytes"] == 0 and status["free_bytes"] == status["capacity_bytes"]


def test_the_liveness_check_reads_real_processes() -> None:
    assert process_start(os.getpid()) not in (None, 0.0), "this process maps memory"
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_start(child.pid) is None, "an exited (reaped) process maps nothing"
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_until(lambda: process_start(zombie.pid) is None, 10, "a zombie counted as mapping memory")
    zombie.wait()


HOSTILE = textwrap.dedent("""
    import sys, torch
    from kvdaemon.client import KVClient, KVSpec
    from kvdaemon.wire.handles import send_frame
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, dtype="float16")
    client = KVClient(sys.argv[1])
    lease = client.lease("hostile", spec, num_virtual_pages=4)
    backend = lease.backend
    granted = lease.grow([0, 1])
    views = []
    for lp, pages in granted.items():
        for page in pages:
            addr = backend.reserve(lease.page_size_bytes)
            backend.map_page(addr, page)
            view = backend.tensor(addr, lease.page_size_bytes, torch.uint8)
            view.fill_(7)
            views.append(view)
    send_frame(lease._sock, {"unexpected": True})  # a violation: the daemon ends the lease
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "check":
            print("intact" if all(bool((v == 7).all()) for v in views) else "changed", flush=True)
        else:
            break
""")


@pytest.fixture
def kvd() -> Iterator[RunningDaemon]:
    with running_daemon("32MiB") as running:
        yield running


def test_a_hostile_live_tenant_never_sees_its_pages_freed_or_regranted(kvd: RunningDaemon) -> None:
    client = kvd.client()
    proc = subprocess.Popen([sys.executable, "-c", HOSTILE, str(kvd.dir)], cwd=REPO_ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        held = 2 * small_spec().num_segments * kvd.daemon.service.pages.page_size_bytes  # two logical pages
        wait_until(lambda: client.status()["quarantined_bytes"] == held, 10, "nothing quarantined")
        status = client.status()
        assert status["tenants"] == [] and status["free_bytes"] == status["capacity_bytes"] - held
        pool = client.register("victim", small_spec(), num_spare_pages=0, num_prefetch_pages=0)
        blocks = pool.alloc(pool.num_free_blocks or 1)
        while True:  # take every page the daemon will give
            try:
                blocks += pool.alloc(pool.blocks_per_page)
            except PoolExhausted:  # the daemon has no more
                break
        pool.key_cache(0)[blocks] = 1.0
        kvd.check_invariants()
        proc.stdin.write("check\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "intact", "the hostile tenant's pages were reused"
        proc.stdin.write("exit\n")
        proc.stdin.flush()
        proc.wait(30)
        wait_until(lambda: client.status()["quarantined_bytes"] == 0, 10, "the pages stayed quarantined")
        kvd.check_invariants()
        pool.free(blocks)
        pool.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
