"""A daemon killed and restarted: engines keep their KV and move to the new daemon."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from kvdaemon.client import KVClient, KVPool, KVSpec, pool_reconnect
from kvdaemon.client.lease import Lease
from kvdaemon.daemon.policies import parse_policy
from kvdaemon.daemon.policy_file import policy_path, write_policies
from kvdaemon.errors import DaemonUnreachable, KVDaemonError
from kvdaemon.wire.messages import LimitNotice, Notice
from kvdaemon.wire.sizes import format_bytes

from tests.conftest import PAGE_BYTES, short_dir, start_daemon, tenant_rows, wait_until

SPEC = KVSpec(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)
BLOCKS_PER_PAGE = PAGE_BYTES // SPEC.block_bytes


@pytest.fixture
def root() -> Iterator[Path]:
    path = short_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def written(pool: KVPool, blocks: list[int], value: float) -> None:
    pool.key_cache(0)[blocks] = value
    pool.value_cache(0)[blocks] = -value


def holds(pool: KVPool, blocks: list[int], value: float) -> bool:
    return bool(
        (pool.key_cache(0)[blocks] == value).all() and (pool.value_cache(0)[blocks] == -value).all()
    )


def test_engines_keep_their_kv_across_a_daemon_restart(root: Path) -> None:
    first = start_daemon(root)
    client = KVClient(root)
    pools = {name: client.register(name, SPEC, num_prefetch_pages=0) for name in ("a", "b")}
    blocks = {name: pool.alloc(BLOCKS_PER_PAGE + 3) for name, pool in pools.items()}
    for i, (name, pool) in enumerate(pools.items()):
        written(pool, blocks[name], float(i + 1))
    before = {t["name"]: t["mapped_bytes"] for t in client.status()["tenants"]}
    moves: list[str] = []  # an engine is held between steps while its pages move
    pools["a"].quiesce_hook = lambda: moves.append("quiesce")
    pools["a"].resume_hook = lambda: moves.append("resume")

    os.kill(first.pid, signal.SIGKILL)
    first.wait(10)
    wait_until(lambda: all(p.lease.lost.is_set() for p in pools.values()), 5, "lease not lost")
    for i, (name, pool) in enumerate(pools.items()):  # the engines keep serving their KV
        assert holds(pool, blocks[name], float(i + 1))
        pool.key_cache(0)[blocks[name][0]] = 7.0  # and writing it
        pool.key_cache(0)[blocks[name][0]] = float(i + 1)
    with pytest.raises(DaemonUnreachable, match="the daemon is gone"):
        pools["a"].alloc(2 * BLOCKS_PER_PAGE)  # refused at once, nothing allocated

    second = start_daemon(root)
    try:
        def back() -> bool:  # the daemon granted the pages, and each pool swapped them in
            rows = tenant_rows(client)
            mapped = None if rows is None else {name: row["mapped_bytes"] for name, row in rows.items()}
            return mapped == before and not any(p.lease.lost.is_set() for p in pools.values())

        wait_until(back, 15, "the tenants did not re-register with the same bytes")
        # the new lease is in place a moment before the agent resumes the engine
        wait_until(lambda: len(moves) >= 2, 5, "the engine was not resumed after the move")
        assert moves == ["quiesce", "resume"]
        for i, (name, pool) in enumerate(pools.items()):
            assert holds(pool, blocks[name], float(i + 1))
        more = pools["a"].alloc(2 * BLOCKS_PER_PAGE)  # a later grow works
        assert not set(more) & set(blocks["a"])
        for pool in pools.values():
            pool.close()
        status = client.status()
        assert status["tenants"] == [] and status["free_bytes"] == status["capacity_bytes"]
        client.shutdown()
        second.wait(30)
    finally:
        for proc in (first, second):
            if proc.poll() is None:
                proc.kill()
        client.close()


@contextmanager
def detached_pool(
    root: Path, name: str, num_blocks: int, value: float, asleep: bool = False,
) -> Iterator[tuple[KVClient, KVPool, list[int], list[subprocess.Popen[bytes]]]]:
    """A pool holding ``num_blocks`` blocks written with ``value`` (``asleep``: then put to sleep
    warm), its daemon SIGKILLed and its lease lost; yields the client, the pool, the blocks, and
    the daemons to kill afterwards (a test appends the one it starts)."""
    first = start_daemon(root)
    daemons = [first]
    client = KVClient(root)
    try:
        pool = client.register(name, SPEC, num_prefetch_pages=0)
        blocks = pool.alloc(num_blocks)
        written(pool, blocks, value)
        if asleep:
            pool.sleep("warm")
            assert pool.sleep_mode == "warm"
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        wait_until(lambda: pool.lease.lost.is_set(), 5, "lease not lost")
        yield client, pool, blocks, daemons
        pool.close()
    finally:
        for proc in daemons:
            if proc.poll() is None:
                proc.kill()
        client.close()


def test_a_pool_over_the_new_daemons_limit_joins_it_empty(root: Path) -> None:
    with detached_pool(root, "big", 2 * BLOCKS_PER_PAGE, 5.0) as (client, pool, _, daemons):
        page = 2 * PAGE_BYTES  # one logical page: two segments of one page
        write_policies(policy_path(root), {"big": parse_policy({"max": page}, "test")})
        daemons.append(start_daemon(root))  # it reads the policy: 'big' may hold one of its two pages
        wait_until(lambda: not pool.lease.lost.is_set(), 15, "the pool never joined the new daemon")
        assert pool.num_block_losses == 1 and pool.num_used_blocks == 0 and pool.mapped_bytes == 0
        rows = tenant_rows(client)
        assert rows is not None and rows["big"]["mapped_bytes"] == 0 and rows["big"]["max_bytes"] == page
        again = pool.alloc(BLOCKS_PER_PAGE)  # what the limit allows is granted from the new daemon
        written(pool, again, 6.0)
        assert holds(pool, again, 6.0)


def test_a_pool_never_joins_a_daemon_of_another_page_size(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvdaemon.client.pool")
    with detached_pool(root, "a", BLOCKS_PER_PAGE, 3.0) as (client, pool, blocks, daemons):
        daemons.append(start_daemon(root, "64MiB", "--page-size", str(PAGE_BYTES // 2)))
        wait_until(lambda: any("--page-size" in r.getMessage() for r in caplog.records), 10, "never said why")
        time.sleep(2.5)  # two more agent ticks: still not registered, said once
        assert tenant_rows(client) == {} and pool.lease.lost.is_set()
        assert len([r for r in caplog.records if "--page-size" in r.getMessage()]) == 1
        assert holds(pool, blocks, 3.0)  # it serves from what it maps
        with pytest.raises(DaemonUnreachable, match="--page-size"):
            pool.alloc(2 * BLOCKS_PER_PAGE)


def test_a_dead_daemons_limit_notices_are_dropped_once_the_pool_moved(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    logical_page = SPEC.num_segments * PAGE_BYTES
    first = start_daemon(root)
    procs = [first]
    client, admin = KVClient(root), KVClient(root)  # the pool hears of the admin's limits only by notice
    try:
        pool = client.register("a", SPEC, num_spare_pages=0, num_prefetch_pages=0)
        held, seen = threading.Event(), []
        handle = pool.agent._handle

        def busy_with_the_first(notice: Notice) -> None:  # the agent is slow on one notice
            if isinstance(notice, LimitNotice) and not seen:
                seen.append(notice)
                held.wait(10)
            handle(notice)

        monkeypatch.setattr(pool.agent, "_handle", busy_with_the_first)
        for num_pages in (10, 9, 2):  # the dead daemon's revisions 1-3: 2 and 3 wait in the agent's inbox
            admin.set_limit("a", max_bytes=num_pages * logical_page)
        wait_until(lambda: seen, 5, "the first notice never reached the agent")
        first.kill()
        first.wait(10)
        procs.append(start_daemon(root))
        held.set()  # the agent moves the pool, then finds the old daemon's two notices
        wait_until(lambda: pool.state.name == "ACTIVE" and not pool.lease.lost.is_set(), 15, "no move")
        admin.close()
        admin = KVClient(root)
        wait_until(lambda: tenant_rows(admin) is not None, 5, "the new daemon did not answer")
        admin.set_limit("a", max_bytes=8 * logical_page)  # the new daemon's own revision
        wait_until(lambda: pool.max_bytes == 8 * logical_page, 5, "an old daemon's revision hid the new one's")
        assert len(pool.alloc(4 * BLOCKS_PER_PAGE)) == 4 * BLOCKS_PER_PAGE
        pool.close()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        client.close()
        admin.close()


def counting_refusals(pool: KVPool, gate: threading.Event | None = None) -> list[str]:
    """Have ``pool``'s re-registrations counted: the wire code of each refusal a daemon answered
    (the list returned). While ``gate`` is given and not set, none is made (as if none ran)."""
    codes: list[str] = []
    relink = pool.agent.relink
    assert relink is not None

    def counted() -> Lease:
        if gate is not None and not gate.is_set():
            raise DaemonUnreachable("held back by the test")
        try:
            return relink()
        except KVDaemonError as exc:
            if exc.from_daemon:
                codes.append(exc.code)
            raise

    pool.agent.relink = counted
    return codes


@pytest.mark.parametrize(("flags", "code", "said"), [
    (("64MiB", "--page-size", str(PAGE_BYTES // 2)), "CONFLICT",
     [f"its pages are of {format_bytes(PAGE_BYTES // 2)}", f"pages of {format_bytes(PAGE_BYTES)}:",
      f"--page-size {PAGE_BYTES})"]),
    (("2MiB",), "BAD_REQUEST", ["more than the 2097152 bytes it could ever hold here"]),
])
def test_a_daemon_that_refuses_a_pool_for_good_is_asked_once_and_its_successor_joined(
    root: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
    flags: tuple[str, ...], code: str, said: list[str],
) -> None:
    caplog.set_level(logging.WARNING, logger="kvdaemon.client.pool")
    looks: list[object] = []  # each agent tick, while detached, looks which daemon is bound first
    bound = pool_reconnect.bound_daemon
    monkeypatch.setattr(pool_reconnect, "bound_daemon", lambda paths: looks.append(paths) or bound(paths))
    with detached_pool(root, "a", BLOCKS_PER_PAGE + 3, 4.0) as (client, pool, blocks, daemons):
        refusals = counting_refusals(pool)
        daemons.append(start_daemon(root, *flags))  # a daemon that can never take 'a'
        warned = lambda: [r for r in caplog.records if "cannot take it" in r.getMessage()]  # noqa: E731
        wait_until(warned, 20, "the pool never said it cannot join")
        asked, seen = len(refusals), len(looks)
        wait_until(lambda: len(looks) >= seen + 5, 30, "the agent stopped ticking")  # five ticks later...
        assert refusals == [code] * asked and 1 <= asked <= 2  # ...the daemon was asked no more (2: a start raced)
        assert pool.state.name == "DETACHED" and tenant_rows(client) == {}
        assert holds(pool, blocks, 4.0)  # it serves from what it maps, and writes it
        written(pool, blocks, 5.0)
        with pytest.raises(DaemonUnreachable) as refused:
            pool.alloc(2 * BLOCKS_PER_PAGE)
        assert refused.value.code == "UNREACHABLE"
        [warning] = warned()
        assert warning.levelno == logging.WARNING and all(part in warning.getMessage() for part in said)
        assert not [r for r in caplog.records if "retrying" in r.getMessage()]

        daemons[-1].kill()  # the operator starts the daemon right: the pool joins it, no engine restart
        daemons[-1].wait(10)
        daemons.append(start_daemon(root))
        wait_until(lambda: pool.state.name == "ACTIVE" and not pool.lease.lost.is_set(), 20, "never joined")
        assert holds(pool, blocks, 5.0) and len(refusals) == asked and len(warned()) == 1
        rows = tenant_rows(client)
        assert rows is not None and rows["a"]["mapped_bytes"] == pool.mapped_bytes > 0
        assert len(pool.alloc(2 * BLOCKS_PER_PAGE)) == 2 * BLOCKS_PER_PAGE


def test_a_pool_whose_name_is_taken_keeps_asking_and_joins_once_it_is_freed(
    root: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvdaemon.client.pool")
    with detached_pool(root, "a", BLOCKS_PER_PAGE, 2.0) as (client, pool, blocks, daemons):
        gate = threading.Event()
        refusals = counting_refusals(pool, gate)
        daemons.append(start_daemon(root))
        other = KVClient(root)
        try:
            squatter = other.register("a", SPEC, num_prefetch_pages=0)  # before the pool asks
            gate.set()
            wait_until(lambda: len(refusals) >= 3, 30, "the pool stopped asking while the name was taken")
            assert set(refusals) == {"CONFLICT"} and pool.state.name == "DETACHED"
            assert not [r for r in caplog.records if "cannot take it" in r.getMessage()]
            squatter.close()
            wait_until(lambda: pool.state.name == "ACTIVE" and not pool.lease.lost.is_set(), 20, "never joined")
            assert holds(pool, blocks, 2.0)
        finally:
            other.close_all()


@contextmanager
def asleep_pool_after_restart(root: Path) -> Iterator[tuple[KVClient, KVPool, threading.Event, list[str]]]:
    """A pool put to sleep warm, its daemon SIGKILLed and another started; its re-join held
    back until the yielded gate is set. Also yields the engine hook calls seen."""
    with detached_pool(root, "sleepy", BLOCKS_PER_PAGE, 3.0, asleep=True) as (client, pool, _, daemons):
        hooks: list[str] = []
        pool.quiesce_hook = lambda: hooks.append("quiesce")
        pool.resume_hook = lambda: hooks.append("resume")
        gate = threading.Event()
        counting_refusals(pool, gate)
        daemons.append(start_daemon(root))
        yield client, pool, gate, hooks


def test_a_pool_asleep_when_its_daemon_restarted_wakes_empty_on_a_wake(root: Path) -> None:
    with asleep_pool_after_restart(root) as (client, pool, gate, hooks):
        asking = pool.lease.wake

        def wake_then_let_it_rejoin() -> dict[str, object]:
            try:
                return asking()  # the new daemon never registered it
            finally:
                gate.set()

        pool.lease.wake = wake_then_let_it_rejoin  # type: ignore[method-assign]
        pool.wake()  # re-joined within the call: awake, empty
        assert pool.sleep_mode is None and pool.state.name == "ACTIVE"
        assert pool.num_block_losses == 1 and pool.num_used_blocks == 0
        assert hooks == []  # an asleep pool's engine holds no KV: it is not held for the move
        rows = tenant_rows(client)
        assert rows is not None and rows["sleepy"]["state"] == "active"
        again = pool.alloc(BLOCKS_PER_PAGE)
        written(pool, again, 4.0)
        assert holds(pool, again, 4.0)


def test_a_wake_says_the_daemon_is_unreachable_while_the_pool_cannot_rejoin(
    root: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("kvdaemon.client.pool.REJOIN_WAIT_S", 0.3)
    with asleep_pool_after_restart(root) as (_, pool, gate, _):
        with pytest.raises(DaemonUnreachable, match="the daemon that put it to sleep is gone"):
            pool.wake()  # the engines' wakes take this as "not yet" and step on
        assert pool.sleep_mode == "warm"
        gate.set()
        wait_until(lambda: pool.sleep_mode is None, 15, "the pool never re-joined")
        pool.wake()  # a no-op now
        assert pool.num_block_losses == 1


def test_a_pool_tells_the_daemon_it_rejoined_that_it_can_sleep_at_once(
    root: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("kvdaemon.client.pool_agent.HEARTBEAT_S", 60.0)  # no tick comes meanwhile
    with detached_pool(root, "a", BLOCKS_PER_PAGE, 2.0) as (client, pool, _, daemons):
        pool.quiesce_hook = lambda: None  # an engine that can be held: sleepable
        daemons.append(start_daemon(root))
        pool.agent.nudge()  # the re-join, and the report with it

        def told() -> bool:
            rows = tenant_rows(client)
            return rows is not None and "a" in rows and rows["a"]["sleepable"] is True

        wait_until(told, 15, "the new daemon heard whether it can sleep only at the next heartbeat")
