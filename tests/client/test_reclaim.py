"""Reclaim between tenants: spare pages first, then warm-sleeping an idle tenant."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
import torch

from kvdaemon.client import KVClient, KVSpec, PoolExhausted
from kvdaemon.client.pool_state import PoolState
from kvdaemon.daemon.reclaim_debt import LAPSE_S
from kvdaemon.errors import BadRequest

from tests.conftest import PAGE_BYTES, RunningDaemon, running_daemon, wait_until

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)
BLOCKS_PER_PAGE = PAGE_BYTES // SPEC.block_bytes
LOGICAL = SPEC.num_segments * PAGE_BYTES  # 8 MiB: the pool holds 8 logical pages


@pytest.fixture
def kvd(request: pytest.FixtureRequest) -> Iterator[RunningDaemon]:
    """A 64 MiB daemon; ``indirect`` parametrization passes config fields."""
    with running_daemon("64MiB", **getattr(request, "param", {})) as running:
        yield running


SPARE_PAGES_ALONE = pytest.mark.parametrize("kvd", [{"reclaim_escalate_s": 5.0}], indirect=True)


def rows(client: KVClient) -> dict[str, dict]:
    return {t["name"]: t for t in client.status()["tenants"]}


@SPARE_PAGES_ALONE
def test_a_busy_grow_takes_an_idle_tenants_spare_pages(kvd: RunningDaemon) -> None:
    client = kvd.client()
    idle = client.register("idle", SPEC, num_spare_pages=8, num_prefetch_pages=0)
    idle.free(idle.alloc(4 * BLOCKS_PER_PAGE))  # four spare logical pages stay mapped
    busy = client.register("busy", SPEC, num_prefetch_pages=0)
    blocks = busy.alloc(6 * BLOCKS_PER_PAGE)  # 4 free, 2 must come from the idle tenant
    assert len(blocks) == 6 * BLOCKS_PER_PAGE
    now = rows(client)
    assert now["busy"]["mapped_bytes"] == 6 * LOGICAL
    assert now["idle"]["state"] == "active" and now["idle"]["mapped_bytes"] <= 2 * LOGICAL
    assert client.status()["counters"]["reclaim_requests"] >= 1
    kvd.check_invariants()
    idle.close()
    busy.close()


@pytest.mark.parametrize("kvd", [{"reclaim_escalate_s": 0.05, "reclaim_wait_s": 10.0, "victim_idle_s": 0.5}],
                         indirect=True)
def test_an_idle_tenant_is_warm_slept_when_spare_pages_are_not_enough(kvd: RunningDaemon) -> None:
    client = kvd.client()
    idle = client.register("idle", SPEC, num_spare_pages=0, num_prefetch_pages=0)
    idle.quiesce_hook = lambda: None  # idle: nothing to wait for; the daemon may sleep it
    wait_until(lambda: rows(client)["idle"]["sleepable"])
    held = idle.alloc(6 * BLOCKS_PER_PAGE)  # live blocks: nothing spare to give
    idle.key_cache(1)[held[-1]] = 9
    wait_until(lambda: rows(client)["idle"]["idle_seconds"] >= 0.5)  # idle long enough to be slept
    busy = client.register("busy", SPEC, num_spare_pages=0, num_prefetch_pages=0)
    busy_blocks = busy.alloc(4 * BLOCKS_PER_PAGE)
    now = rows(client)
    assert now["idle"]["state"] == "sleeping-warm" and now["idle"]["host_bytes"] == 6 * LOGICAL
    assert now["busy"]["mapped_bytes"] == 4 * LOGICAL
    assert client.status()["counters"]["victims_slept"] == 1
    busy.free(busy_blocks)  # room again (once busy's agent gives its spare pages back) ...
    wait_until(lambda: rows(client)["busy"]["mapped_bytes"] == LOGICAL)  # page 0 stays
    client.wake("idle")  # ... the sleeper wakes with its bytes
    assert idle.wait_state(lambda state: state is PoolState.ACTIVE, 5)
    assert float(idle.key_cache(1)[held[-1]].float().mean()) == 9.0
    kvd.check_invariants()
    idle.close()
    busy.close()


def test_min_bytes_is_never_reclaimed(kvd: RunningDaemon) -> None:
    client = kvd.client()
    guarded = client.register("guarded", SPEC, min_bytes=6 * LOGICAL, num_spare_pages=8,
                              num_prefetch_pages=0)  # fmt: skip
    guarded.free(guarded.alloc(6 * BLOCKS_PER_PAGE))  # six spare pages, all guaranteed
    busy = client.register("busy", SPEC, num_prefetch_pages=0)
    with pytest.raises(PoolExhausted):
        busy.alloc(4 * BLOCKS_PER_PAGE)
    now = rows(client)
    assert now["guarded"]["mapped_bytes"] == 6 * LOGICAL and now["guarded"]["state"] == "active"
    assert now["busy"]["mapped_bytes"] == 0
    kvd.check_invariants()
    guarded.close()
    busy.close()


@SPARE_PAGES_ALONE
def test_cache_only_pages_are_reclaimed_before_anyone_sleeps(kvd: RunningDaemon) -> None:
    from kvdaemon.client.block_manager import BlockManager

    client = kvd.client()
    cached = client.register("cached", SPEC, num_spare_pages=0, num_prefetch_pages=0)
    manager = BlockManager(cached, salt=b"model-a")
    manager.serve_reclaim_for(cached)
    prompt = list(range(6 * BLOCKS_PER_PAGE * SPEC.block_size + 1))
    manager.add_sequence("req-1", prompt)
    manager.free_sequence("req-1")  # its full blocks stay cached: six pages hold only cache
    # the partial block's page goes back at the agent's next tick
    wait_until(lambda: rows(client)["cached"]["mapped_bytes"] == 6 * LOGICAL)
    assert manager.num_evictable_blocks >= 6 * BLOCKS_PER_PAGE
    busy = client.register("busy", SPEC, num_prefetch_pages=0)
    busy.alloc(4 * BLOCKS_PER_PAGE)
    now = rows(client)
    assert now["cached"]["state"] == "active" and now["busy"]["mapped_bytes"] == 4 * LOGICAL
    assert now["cached"]["mapped_bytes"] <= 4 * LOGICAL
    assert client.status()["counters"]["victims_slept"] == 0
    kvd.check_invariants()
    busy.close()
    cached.close()


@SPARE_PAGES_ALONE
def test_the_lighter_tenant_gives_first(kvd: RunningDaemon) -> None:
    client = kvd.client()
    light = client.register("light", SPEC, weight=1.0, num_spare_pages=8, num_prefetch_pages=0)
    heavy = client.register("heavy", SPEC, weight=4.0, num_spare_pages=8, num_prefetch_pages=0)
    for pool in (light, heavy):
        pool.free(pool.alloc(3 * BLOCKS_PER_PAGE))  # three spare pages each; two pages free
    busy = client.register("busy", SPEC, num_prefetch_pages=0)
    busy.alloc(3 * BLOCKS_PER_PAGE)  # one page short
    now = rows(client)
    assert now["light"]["mapped_bytes"] == 2 * LOGICAL
    assert now["heavy"]["mapped_bytes"] == 3 * LOGICAL
    kvd.check_invariants()
    for pool in (light, heavy, busy):
        pool.close()


@SPARE_PAGES_ALONE
def test_a_grow_that_may_not_wait_fails_at_once_and_still_asks_the_others(kvd: RunningDaemon) -> None:
    client = kvd.client()
    idle = client.register("idle", SPEC, num_spare_pages=8, num_prefetch_pages=0)
    idle.free(idle.alloc(6 * BLOCKS_PER_PAGE))  # six spare logical pages stay mapped
    eager = client.register("eager", SPEC, num_prefetch_pages=0, grow_wait_s=0.0)
    with pytest.raises(PoolExhausted, match="daemon refused"):
        eager.alloc(4 * BLOCKS_PER_PAGE)  # 2 free: the rest must come back first
    assert kvd.daemon.service.reclaimer.parked == []
    assert client.status()["counters"]["reclaim_requests"] >= 1
    # the idle pool's agent gives its spare pages back
    wait_until(lambda: rows(client)["idle"]["mapped_bytes"] <= 4 * LOGICAL)
    blocks = eager.alloc(4 * BLOCKS_PER_PAGE)
    assert len(blocks) == 4 * BLOCKS_PER_PAGE
    kvd.check_invariants()
    idle.close()
    eager.close()


@SPARE_PAGES_ALONE
def test_an_ask_read_after_it_lapsed_is_let_go(kvd: RunningDaemon, caplog: pytest.LogCaptureFixture) -> None:
    """A tenant stalled past an ask's lapse (stopped, starved) keeps its pages when it reads the ask:
    nobody waits on it any more. The asks after it are answered as ever."""
    caplog.set_level(logging.INFO, logger="kvdaemon.client.pool")
    client = kvd.client()
    idle = client.register("idle", SPEC, num_spare_pages=8, num_prefetch_pages=0)
    idle.free(idle.alloc(6 * BLOCKS_PER_PAGE))  # six spare logical pages stay mapped
    wait_until(lambda: idle.agent.daemon_clock_offset_s is not None)  # its first heartbeat placed the clock
    eager = client.register("eager", SPEC, num_prefetch_pages=0, grow_wait_s=0.0)
    with idle.agent._inbox_lock:  # the agent and its reader stall, as a stopped process's would
        with pytest.raises(PoolExhausted, match="daemon refused"):
            eager.alloc(4 * BLOCKS_PER_PAGE)  # the idle pool is asked for two pages
        eager.close()  # and nobody needs them any more
        time.sleep(LAPSE_S + 0.3)
    wait_until(lambda: "let go of a reclaim ask of 2 page(s)" in caplog.text)
    time.sleep(0.2)
    assert rows(client)["idle"]["mapped_bytes"] == 6 * LOGICAL  # nothing shed for the lapsed ask
    again = client.register("again", SPEC, num_prefetch_pages=0, grow_wait_s=0.0)
    with pytest.raises(PoolExhausted, match="daemon refused"):
        again.alloc(4 * BLOCKS_PER_PAGE)  # a fresh ask ...
    wait_until(lambda: rows(client)["idle"]["mapped_bytes"] <= 4 * LOGICAL)  # ... is answered
    kvd.check_invariants()
    idle.close()
    again.close()


def test_grow_wait_s_outside_the_daemons_bound_is_refused(kvd: RunningDaemon) -> None:
    client = kvd.client()
    with pytest.raises(BadRequest, match="at most 2 s"):  # at once, not at every grow after
        client.register("pool", SPEC, grow_wait_s=60.0)
    for wrong in (-1.0, float("nan"), float("inf"), True, "1"):
        with pytest.raises(BadRequest, match="grow_wait_s"):
            client.register("pool", SPEC, grow_wait_s=wrong)  # type: ignore[arg-type]
    assert "pool" not in rows(client)  # nothing registered
    pool = client.register("pool", SPEC, grow_wait_s=2.0)
    for wrong in (-0.5, 60.0, float("inf")):
        with pytest.raises(BadRequest, match="grow_wait_s"):
            pool.grow_wait_s = wrong  # set later: checked against the same bound
    assert pool.grow_wait_s == 2.0
    pool.core.grow_wait_s = 60.0  # past the bound all the same: the daemon refuses the grow, nothing mapped
    with pytest.raises(BadRequest, match="wait_s"):
        pool.alloc(1)
    assert rows(client)["pool"]["mapped_bytes"] == 0
    pool.close()
