"""Faults between a pool and its daemon: stops, slow replies, outages, pools that cannot quiesce.

Each test is the regression test of one item of issue #10; each failed before its fix.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvdaemon.client import KVClient, KVPool, KVSpec, PoolExhausted
from kvdaemon.client.grant_channel import GrantChannel
from kvdaemon.client.pool_state import PoolState
from kvdaemon.daemon import swap
from kvdaemon.errors import Conflict, DaemonUnreachable, NoReply

from tests.conftest import (
    PAGE_BYTES, RunningDaemon, running_daemon, short_dir, start_daemon, tenant_rows, wait_until,
)

SPEC = KVSpec(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)
BLOCKS_PER_PAGE = PAGE_BYTES // SPEC.block_bytes
LOGICAL = SPEC.num_segments * PAGE_BYTES


def pattern(pool: KVPool, blocks: list[int], seed: int) -> None:
    """Write a pattern unique to (block, seed) into K and V of every block."""
    for block in blocks:
        pool.key_cache(0)[block] = float((block * 7 + seed) % 1000)
        pool.value_cache(0)[block] = -float((block * 7 + seed) % 1000)


def intact(pool: KVPool, blocks: list[int], seed: int) -> bool:
    return all(
        bool((pool.key_cache(0)[b] == float((b * 7 + seed) % 1000)).all())
        and bool((pool.value_cache(0)[b] == -float((b * 7 + seed) % 1000)).all())
        for b in blocks
    )


def row(client: KVClient, name: str) -> dict[str, Any]:
    return next(t for t in client.status()["tenants"] if t["name"] == name)


@pytest.fixture
def root() -> Iterator[Path]:
    path = short_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemons(root: Path) -> Iterator[Callable[[], subprocess.Popen[bytes]]]:
    """Start daemon processes on ``root``; any left running are killed afterwards."""
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        procs.append(start_daemon(root))
        return procs[-1]

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()


def wait_reregistered(client: KVClient, pool: KVPool) -> None:
    """Wait until ``pool`` moved to the daemon now running and both sides count the same pages."""
    wait_until(lambda: pool.state is PoolState.ACTIVE and pool.name in (tenant_rows(client) or {}),
               15, "no re-registration")
    pool.agent.nudge()
    wait_until(lambda: row(client, pool.name)["mapped_bytes"] == pool.mapped_bytes, 5, "counts differ")


# -- item 1: a stop never zeroes a live tenant's KV -------------------------------------


def test_a_graceful_stop_keeps_every_byte_and_the_next_daemon_takes_them_back(
    root: Path, daemons: Callable[[], subprocess.Popen[bytes]]
) -> None:
    first = daemons()
    with KVClient(root) as client:
        pool = client.register("a", SPEC, num_prefetch_pages=0)
        blocks = pool.alloc(2 * BLOCKS_PER_PAGE + 3)
        pattern(pool, blocks, seed=1)
        client.shutdown()
        first.wait(30)
        wait_until(lambda: pool.state is PoolState.DETACHED, 5, "the pool did not notice the stop")
        assert intact(pool, blocks, seed=1), "the stop zeroed the tenant's KV"
        second = daemons()
        wait_reregistered(client, pool)
        assert intact(pool, blocks, seed=1) and pool.num_block_losses == 0
        pool.close()
        client.shutdown()
        second.wait(30)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the bug we plant
def test_a_loop_that_dies_releases_no_page_a_tenant_maps(monkeypatch: pytest.MonkeyPatch) -> None:
    with running_daemon("64MiB") as kvd:
        client = kvd.client()
        pool = client.register("a", SPEC, num_prefetch_pages=0)
        blocks = pool.alloc(BLOCKS_PER_PAGE + 1)
        pattern(pool, blocks, seed=2)

        def broken() -> None:
            raise RuntimeError("a bug in the loop")

        monkeypatch.setattr(kvd.daemon.leases, "close_dead", broken)
        kvd.thread.join(10)  # the loop ends on the exception, through its shutdown path
        assert not kvd.thread.is_alive()
        wait_until(lambda: pool.lease.lost.is_set(), 5, "the lease did not end")
        assert intact(pool, blocks, seed=2)
        pool.close()
        client.close()


# -- item 2: a slow sleep is decided by the daemon alone ----------------------------------


def test_a_sleep_slower_than_the_clients_timeout_ends_in_one_state(monkeypatch: pytest.MonkeyPatch) -> None:
    real_save = swap.save

    def slow_save(*args: Any) -> Any:
        time.sleep(1.5)  # a large warm save: three times the client's control timeout
        return real_save(*args)

    monkeypatch.setattr(swap, "save", slow_save)
    with running_daemon("64MiB") as kvd:
        client = KVClient(kvd.dir, timeout_s=0.5)
        pool = client.register("a", SPEC, num_prefetch_pages=0)
        blocks = pool.alloc(BLOCKS_PER_PAGE + 1)
        pattern(pool, blocks, seed=3)
        result = client.sleep("a", "warm")
        assert result["state"] == "sleeping-warm"
        assert pool.state is PoolState.ASLEEP_WARM and pool.mapped_bytes == 0
        other = kvd.client().register("b", SPEC, num_prefetch_pages=0)
        taken = other.alloc(4 * BLOCKS_PER_PAGE)  # the freed pages go to another tenant
        pattern(other, taken, seed=4)
        other.close()
        client.wake("a")
        assert intact(pool, blocks, seed=3), "the sleeper lost its KV"
        kvd.check_invariants()
        pool.close()
        client.close()


def test_a_close_whose_reply_comes_after_the_lease_closed_ends_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unregister closes the handle channel, then replies: a client that sees the close first
    (a large tenant's release, a busy core) is done, not told the daemon went away."""
    with running_daemon("64MiB") as kvd:
        leases = kvd.daemon.leases
        real_drop = leases.drop_lease

        def slow_drop(tenant_id: int) -> None:
            real_drop(tenant_id)
            time.sleep(0.5)  # the channel is closed; the reply waits (5 of the client's alive polls)

        monkeypatch.setattr(leases, "drop_lease", slow_drop)
        client = kvd.client()
        pool = client.register("a", SPEC, num_prefetch_pages=0)
        pool.alloc(BLOCKS_PER_PAGE)
        pool.close()  # raised DaemonUnreachable before
        assert [t["name"] for t in client.status()["tenants"]] == []
        kvd.check_invariants()


# -- item 3: a grow answered after its caller gave up is adopted -------------------------


def test_a_late_grant_is_adopted_and_alloc_raises_only_exhaustion_or_unreachable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with running_daemon("64MiB") as kvd:
        client = KVClient(kvd.dir, timeout_s=0.5)
        pool = client.register("a", SPEC, num_prefetch_pages=0, grow_wait_s=0)
        grants = kvd.daemon.service.grants
        real_grow = grants.grow
        stalls = [1.5]

        def stalled_grow(*args: Any) -> Any:
            if stalls:
                time.sleep(stalls.pop())  # the daemon stalls mid-grow (as under SIGSTOP)
            return real_grow(*args)

        monkeypatch.setattr(grants, "grow", stalled_grow)
        with pytest.raises(NoReply):
            pool.alloc(BLOCKS_PER_PAGE)
        observer = kvd.client()
        wait_until(lambda: row(observer, "a")["mapped_bytes"] == LOGICAL, 10, "the late grant never came")
        blocks = pool.alloc(BLOCKS_PER_PAGE)  # the late grant is adopted, not "already mapped"
        more = pool.alloc(BLOCKS_PER_PAGE)
        assert not set(blocks) & set(more)
        pool.agent.nudge()  # a late reply still in flight is adopted by the agent
        wait_until(lambda: not pool.lease.outstanding_grows, 5, "the late grant was never collected")
        with pool.core.lock:
            assert row(observer, "a")["mapped_bytes"] == pool.mapped_bytes
        kvd.check_invariants()
        pool.close()
        assert observer.status()["free_bytes"] == observer.status()["capacity_bytes"]
        observer.close()
        client.close()


@pytest.mark.parametrize("mode", ["warm", "cold"])
def test_a_grow_outstanding_at_a_sleep_is_never_mapped_after_it(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    with running_daemon("64MiB") as kvd:
        client = KVClient(kvd.dir, timeout_s=0.5)
        pool = client.register("a", SPEC, num_spare_pages=0, num_prefetch_pages=0, grow_wait_s=0)
        pool.quiesce_hook, pool.resume_hook = (lambda: None), (lambda: None)
        blocks = pool.alloc(BLOCKS_PER_PAGE)
        pattern(pool, blocks, seed=3)
        grants = kvd.daemon.service.grants
        real_grow, stalls = grants.grow, [1.5]

        def stalled_grow(*args: Any) -> Any:
            if stalls:
                time.sleep(stalls.pop())  # the daemon stalls mid-grow (as under SIGSTOP)
            return real_grow(*args)

        monkeypatch.setattr(grants, "grow", stalled_grow)
        admin = kvd.client()
        slept: list[dict[str, Any]] = []
        sleeper = threading.Thread(target=lambda: slept.append(admin.sleep("a", mode=mode)))
        with pytest.raises(NoReply):  # the sleep is asked meanwhile: the daemon answers it after the grow
            threading.Timer(0.2, sleeper.start).start()
            pool.alloc(3 * BLOCKS_PER_PAGE)
        sleeper.join(10)
        assert slept and slept[0]["state"] == f"sleeping-{mode}"
        admin.wake("a")
        time.sleep(0.3)
        pool.agent.nudge()  # a late reply, had it been kept, would be mapped now
        wait_until(lambda: not pool.lease.outstanding_grows, 5, "the outstanding grow was kept")
        with pool.core.lock:
            assert row(admin, "a")["mapped_bytes"] == pool.mapped_bytes  # one view of what it holds
        if mode == "warm":
            assert intact(pool, blocks, seed=3)
        other = admin.register("b", SPEC, num_spare_pages=0, num_prefetch_pages=0)
        with pytest.raises(PoolExhausted):  # b takes every free page, writing its own bytes there
            while True:
                pattern(other, other.alloc(BLOCKS_PER_PAGE), seed=9)
        more = pool.alloc(BLOCKS_PER_PAGE) if pool.num_free_blocks >= BLOCKS_PER_PAGE else []
        with pool.core.lock:
            assert row(admin, "a")["mapped_bytes"] == pool.mapped_bytes
        if mode == "warm":
            assert intact(pool, blocks, seed=3)  # nothing of b's came through a page a holds
        pool.free(more)
        kvd.check_invariants()
        other.close()
        pool.close()
        admin.close()
        client.close()


# -- items 4 and 5: frees during an outage, reconciled after the restart ----------------


def test_frees_during_an_outage_are_local_and_reconciled_after_the_restart(
    root: Path, daemons: Callable[[], subprocess.Popen[bytes]]
) -> None:
    first = daemons()
    with KVClient(root) as client:
        pool = client.register("a", SPEC, num_spare_pages=0, num_prefetch_pages=0)
        blocks = pool.alloc(4 * BLOCKS_PER_PAGE)
        pattern(pool, blocks[:BLOCKS_PER_PAGE], seed=5)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        wait_until(lambda: pool.lease.lost.is_set(), 5, "lease not lost")
        pool.free(blocks[BLOCKS_PER_PAGE:])  # no daemon: local, no error, no wait
        second = daemons()
        wait_reregistered(client, pool)
        wait_until(lambda: row(client, "a")["mapped_bytes"] == LOGICAL, 5, "the empty pages stayed charged")
        assert intact(pool, blocks[:BLOCKS_PER_PAGE], seed=5)
        again = pool.alloc(3 * BLOCKS_PER_PAGE)  # no PoolExhausted, no "not mapped"
        pool.free(again)
        pool.close()
        status = client.status()
        assert status["tenants"] == [] and status["free_bytes"] == status["capacity_bytes"]
        client.shutdown()
        second.wait(30)


# -- item 6: a pool that cannot quiesce is never unmapped under its user ------------------


def test_reclaim_and_operators_never_sleep_a_pool_without_a_quiesce_hook() -> None:
    with running_daemon("64MiB", reclaim_escalate_s=0.02, reclaim_wait_s=0.5) as kvd:
        client = kvd.client()
        raw = client.register("raw", SPEC, num_spare_pages=0, num_prefetch_pages=0)
        held = raw.alloc(16 * BLOCKS_PER_PAGE)  # everything, all live
        pattern(raw, held, seed=6)
        grower = client.register("grower", SPEC, num_prefetch_pages=0)
        with pytest.raises(PoolExhausted):
            grower.alloc(BLOCKS_PER_PAGE)
        admin = kvd.client()
        with pytest.raises(Conflict, match="quiesce hook"):
            admin.sleep("raw")
        assert raw.state is PoolState.ACTIVE and row(admin, "raw")["state"] == "active"
        assert intact(raw, held, seed=6)
        assert admin.status()["counters"]["victims_slept"] == 0
        for pool in (raw, grower):
            pool.close()
        admin.close()
        client.close()


# -- item 15: a closed pool, a closed client, and a hook that raises ----------------------


def test_a_closed_pool_and_client_say_so_on_every_method(kvd: RunningDaemon) -> None:
    from kvdaemon.errors import BadRequest, PoolClosed

    client = kvd.client()
    pool = client.register("a", SPEC)
    with pytest.raises(BadRequest, match=r"0\.\.0"):
        pool.key_cache(99)
    with pytest.raises(BadRequest, match="list of block ids, got int"):
        pool.free(3)  # type: ignore[arg-type]
    pool.close()
    pool.close()  # idempotent
    for call in (lambda: pool.alloc(1), lambda: pool.alloc(0), lambda: pool.key_cache(0),
                 lambda: pool.value_cache(0), lambda: pool.free([0]), lambda: pool.copy_blocks([0], [1]),
                 lambda: pool.keep_free(5), lambda: pool.note_activity()):  # fmt: skip
        with pytest.raises(PoolClosed):
            call()
    client.close()
    with pytest.raises(PoolClosed):
        client.register("b", SPEC)
    with pytest.raises(PoolClosed):
        client.status()


def test_the_agent_survives_a_hook_that_raises(kvd: RunningDaemon, caplog: pytest.LogCaptureFixture) -> None:
    client = kvd.client()
    pool = client.register("a", SPEC, num_spare_pages=0, num_prefetch_pages=0)
    blocks = pool.alloc(2 * BLOCKS_PER_PAGE)

    def broken_hook(_num_blocks: int) -> int:
        raise ValueError("the engine's eviction failed")

    pool.reclaim_hook = broken_hook
    with caplog.at_level(logging.ERROR, logger="kvdaemon.client.pool"):
        client.set_limit("a", max_bytes=LOGICAL)  # asks a page back: the hook runs and raises
        wait_until(lambda: "carries on" in caplog.text, 5, "the hook's failure was not logged")
    pool.quiesce_hook = lambda: None
    assert client.sleep("a", "warm")["state"] == "sleeping-warm"  # the agent still answers
    client.wake("a")
    pool.free(blocks)
    pool.close()
    client.close()


@pytest.fixture
def kvd() -> Iterator[RunningDaemon]:
    with running_daemon("64MiB") as running:
        yield running


def test_a_request_to_a_daemon_that_dies_ends_at_once_not_at_its_timeout(
    root: Path, daemons: Callable[[], subprocess.Popen[bytes]]
) -> None:
    """A `kvdaemon sleep` whose daemon is killed (and another started) used to wait its full
    60 s, then blame the new daemon for not answering."""
    first = daemons()
    with KVClient(root) as owner, KVClient(root) as admin:
        pool = owner.register("a", SPEC, num_prefetch_pages=0)
        pool.alloc(1)
        slow_step, asked = threading.Event(), threading.Event()

        def never_between_steps() -> None:  # the daemon's sleep has reached the pool
            asked.set()
            slow_step.wait()

        pool.quiesce_hook = never_between_steps
        outcome: list[BaseException | dict[str, Any]] = []
        asking = threading.Thread(target=lambda: outcome.append(_call(lambda: admin.sleep("a", timeout_s=120))))
        asking.start()
        assert asked.wait(10), "the sleep never reached the pool"
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        daemons()
        asking.join(30)
        slow_step.set()
        assert not asking.is_alive(), "the sleep waited on a daemon that is gone"
        assert isinstance(outcome[0], DaemonUnreachable) and "went away before it answered" in outcome[0].message
        pool.close()


def test_every_call_after_the_daemon_was_killed_says_none_runs_at_once(
    root: Path, daemons: Callable[[], subprocess.Popen[bytes]]
) -> None:
    """The first call after a SIGKILL found the daemon gone; the next ones waited their whole
    timeout on the socket it left behind, then blamed a slow daemon (``NoReply``)."""
    first = daemons()
    with KVClient(root, timeout_s=5.0) as admin:
        admin.status()
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        for _ in range(2):
            started = time.monotonic()
            with pytest.raises(DaemonUnreachable) as err:
                admin.status()
            assert not isinstance(err.value, NoReply) and time.monotonic() - started < 2.0
        assert "no kvdaemon running" in err.value.message
        daemons()
        assert admin.status()["tenants"] == []  # a new daemon on the directory is reached again


def _call(fn: Callable[[], Any]) -> BaseException | Any:
    try:
        return fn()
    except BaseException as exc:  # noqa: BLE001 - handed to the test thread to assert on
        return exc


def test_a_pool_whose_daemon_died_after_refusing_it_does_not_spin(
    root: Path, daemons: Callable[[], subprocess.Popen[bytes]]
) -> None:
    """An agent backing off a full daemon, then detached, used to retry re-registering
    without a pause (its next grow-ahead try was overdue, so it never waited)."""
    first = daemons()
    with KVClient(root) as client:
        hog = client.register("hog", SPEC, num_prefetch_pages=0, grow_wait_s=0.0)
        with pytest.raises(PoolExhausted):
            while True:
                hog.alloc(BLOCKS_PER_PAGE)  # the whole device
        pool = client.register("a", SPEC, num_spare_pages=0, num_prefetch_pages=0, grow_wait_s=0.0)
        pool.keep_free(2 * BLOCKS_PER_PAGE)  # refused: the agent backs off
        wait_until(lambda: pool.agent.reserve_backoff.at > 0, 5, "the agent never backed off")
        attempts: list[float] = []
        relink = pool.agent.relink
        assert relink is not None

        def counted() -> Any:
            attempts.append(time.monotonic())
            return relink()

        pool.agent.relink = counted
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        wait_until(lambda: pool.state is PoolState.DETACHED, 10, "the pool never noticed")
        time.sleep(2.0)  # a spinning agent tries hundreds of times here
        assert len(attempts) <= 3, f"{len(attempts)} re-registration attempts in 2 s"
        pool.close()
        hog.close()


def test_a_grant_request_on_a_channel_the_daemon_closed_raises_unreachable() -> None:
    """A daemon that stops between two grows closes the grant socket: the next send hits a
    broken pipe, which must reach the engine as ``DaemonUnreachable`` (it serves from what
    is mapped), never as a bare ``OSError`` that ends the tenant's process (the soak's t5)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    theirs.close()
    channel = GrantChannel(ours, alive=lambda: True)
    with pytest.raises(DaemonUnreachable, match="grant channel closed"):
        channel.call("grow", {"logical_pages": [1]}, timeout_s=1.0)
    channel.close()
