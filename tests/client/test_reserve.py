"""``keep_free``: the agent maps the engine's next needs ahead and neither returns nor yields them;
a floor ahead of need it maps only from memory nobody needs, and yields it to a reclaim."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvdaemon.client import KVClient, KVPool, KVSpec, PoolExhausted, pool_agent
from kvdaemon.daemon import reclaim, shares
from kvdaemon.errors import BadRequest

from tests.conftest import PAGE_BYTES, RunningDaemon, running_daemon, wait_until

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)
BLOCKS_PER_PAGE = PAGE_BYTES // SPEC.block_bytes
LOGICAL = SPEC.num_segments * PAGE_BYTES  # the 64 MiB daemon holds 8 logical pages


@pytest.fixture
def kvd() -> Iterator[RunningDaemon]:
    with running_daemon("64MiB", reclaim_escalate_s=5.0) as running:
        yield running


def mapped(client: KVClient, name: str) -> int:
    return next(t["mapped_bytes"] for t in client.status()["tenants"] if t["name"] == name)


def occupy(client: KVClient, num_pages: int) -> tuple[KVPool, list[int]]:
    """A tenant "hog" holding ``num_pages`` logical pages of live blocks, and those blocks."""
    hog = client.register("hog", SPEC, num_spare_pages=0, num_prefetch_pages=0)
    return hog, hog.alloc(num_pages * BLOCKS_PER_PAGE)


def test_the_agent_maps_the_reserve_ahead_and_alloc_needs_no_grow(kvd: RunningDaemon) -> None:
    client = kvd.client()
    pool = client.register("a", SPEC, num_spare_pages=0, num_prefetch_pages=0)
    pool.keep_free(3 * BLOCKS_PER_PAGE)
    wait_until(lambda: pool.num_free_blocks >= 3 * BLOCKS_PER_PAGE, 10, "the reserve was never mapped")
    lease, asked = pool.lease, []
    grow = lease.grow
    lease.grow = lambda *args, **kwargs: asked.append(args) or grow(*args, **kwargs)  # type: ignore[method-assign]
    blocks = pool.alloc(3 * BLOCKS_PER_PAGE)
    assert asked == [], "the engine's alloc waited on a grow"
    assert mapped(client, "a") == 3 * LOGICAL
    pool.free(blocks)
    pool.keep_free(0)  # idle again: spare pages past page 0 go back at the next tick
    wait_until(lambda: mapped(client, "a") == LOGICAL, 10, "spare pages were kept without a reserve")
    pool.close()


def test_spare_pages_inside_the_reserve_stay_at_the_tick(kvd: RunningDaemon) -> None:
    client = kvd.client()
    pool = client.register("a", SPEC, num_spare_pages=0, num_prefetch_pages=0)
    pool.keep_free(2 * BLOCKS_PER_PAGE)
    pool.free(pool.alloc(4 * BLOCKS_PER_PAGE))  # four spare pages; two are the reserve
    wait_until(lambda: mapped(client, "a") == 2 * LOGICAL, 10, "the pages past the reserve stayed")
    assert pool.num_free_blocks >= 2 * BLOCKS_PER_PAGE
    pool.close()


def test_a_reclaim_never_takes_the_reserve(kvd: RunningDaemon) -> None:
    client = kvd.client()
    busy = client.register("busy", SPEC, num_spare_pages=8, num_prefetch_pages=0)
    busy.keep_free(3 * BLOCKS_PER_PAGE)
    busy.free(busy.alloc(6 * BLOCKS_PER_PAGE))  # six spare pages, three of them its reserve
    other = client.register("other", SPEC, num_spare_pages=0, num_prefetch_pages=0)
    other.grow_wait_s = 2.0
    held = other.alloc(2 * BLOCKS_PER_PAGE)  # 2 free: fits without reclaim
    wait_until(lambda: mapped(client, "busy") == 6 * LOGICAL, 5)
    held += other.alloc(3 * BLOCKS_PER_PAGE)  # needs three of busy's six: its spare past the reserve
    assert mapped(client, "busy") == 3 * LOGICAL and busy.num_free_blocks >= 3 * BLOCKS_PER_PAGE
    kvd.check_invariants()
    other.free(held)
    other.close()
    busy.close()


def test_a_lowered_limit_binds_whatever_the_reserve_and_takes_no_more(kvd: RunningDaemon) -> None:
    client = kvd.client()
    pool = client.register("a", SPEC, num_spare_pages=8, num_prefetch_pages=0)
    pool.keep_free(4 * BLOCKS_PER_PAGE)
    held = pool.alloc(BLOCKS_PER_PAGE)
    pool.free(pool.alloc(4 * BLOCKS_PER_PAGE))  # five pages mapped, four of them the reserve
    client.set_limit("a", max_bytes=3 * LOGICAL)
    wait_until(lambda: mapped(client, "a") == 3 * LOGICAL, 10, "the limit did not bind")
    time.sleep(0.3)  # a page returned twice (for the limit and for the daemon's ask) would show now
    assert mapped(client, "a") == pool.mapped_bytes == 3 * LOGICAL
    pool.free(held)
    pool.close()


def test_the_agent_takes_what_the_daemon_has_toward_a_larger_reserve(kvd: RunningDaemon) -> None:
    client = kvd.client()
    hog, held = occupy(client, 6)  # two logical pages left
    pool = client.register("a", SPEC, num_spare_pages=0, num_prefetch_pages=0, grow_wait_s=0.0)
    pool.keep_free(4 * BLOCKS_PER_PAGE)
    wait_until(lambda: pool.mapped_bytes == 2 * LOGICAL, 10, "the agent waited for the whole reserve")
    assert len(pool.alloc(2 * BLOCKS_PER_PAGE)) == 2 * BLOCKS_PER_PAGE  # no grow needed
    hog.free(held)
    hog.close()
    pool.close()


def test_spare_blocks_stay_at_the_tick_but_a_reclaim_takes_them(kvd: RunningDaemon) -> None:
    client = kvd.client()
    pool = client.register("a", SPEC, num_spare_pages=0, num_prefetch_pages=0)
    pool.keep_free(0, 3 * BLOCKS_PER_PAGE)  # an idle engine: nothing reserved, three pages may stay
    pool.free(pool.alloc(4 * BLOCKS_PER_PAGE))
    # one tick returns every page past the allowance at once: all four, were it ignored
    wait_until(lambda: mapped(client, "a") == 3 * LOGICAL, 10, "the tick returned the spare the engine keeps")
    other = client.register("other", SPEC, num_spare_pages=0, num_prefetch_pages=0, grow_wait_s=2.0)
    held = other.alloc(7 * BLOCKS_PER_PAGE)  # five free: two more come from a's spare
    assert mapped(client, "a") == LOGICAL
    other.free(held)
    other.close()
    pool.close()


def test_a_reserve_past_the_limit_maps_up_to_the_limit(kvd: RunningDaemon) -> None:
    client = kvd.client()
    pool = client.register("a", SPEC, num_spare_pages=0, num_prefetch_pages=0, max_bytes=3 * LOGICAL)
    pool.keep_free(5 * BLOCKS_PER_PAGE)  # the engine wants more than its limit allows
    wait_until(lambda: mapped(client, "a") == 3 * LOGICAL, 10, "the reserve mapped nothing past the limit")
    assert len(pool.alloc(3 * BLOCKS_PER_PAGE)) == 3 * BLOCKS_PER_PAGE
    pool.close()


@pytest.mark.parametrize("count", [-1, 1.5, None, True, 10**15])
def test_a_bad_reserve_is_refused_and_changes_nothing(kvd: RunningDaemon, count: object) -> None:
    pool = kvd.client().register("a", SPEC)
    pool.keep_free(2, 3, 4)
    with pytest.raises(BadRequest):
        pool.keep_free(count)  # type: ignore[arg-type]
    with pytest.raises(BadRequest):
        pool.keep_free(0, count)  # type: ignore[arg-type]
    with pytest.raises(BadRequest):
        pool.keep_free(0, 0, count)  # type: ignore[arg-type]
    assert (pool.core.reserve_blocks, pool.core.spare_blocks, pool.core.ahead_blocks) == (2, 3, 4)
    pool.keep_free(pool.num_blocks, pool.num_blocks, pool.num_blocks)  # the whole virtual range is valid
    pool.close()


def test_a_full_daemon_is_not_asked_again_at_once_while_the_agent_probes(kvd: RunningDaemon) -> None:
    client = kvd.client()
    hog, held = occupy(client, 8)  # the whole device
    pool = client.register("a", SPEC, num_spare_pages=0, num_prefetch_pages=0, grow_wait_s=0.0)
    pool.keep_free(2 * BLOCKS_PER_PAGE)  # an engine's reserve: more than the daemon has
    lease, asked = pool.lease, []
    grow = lease.grow

    def counted(*args: object, **kwargs: object) -> object:
        if threading.current_thread() is threading.main_thread():  # the engine's, not the agent's
            asked.append(args)
        return grow(*args, **kwargs)

    lease.grow = counted  # type: ignore[method-assign]
    with pytest.raises(PoolExhausted):
        pool.alloc(3 * BLOCKS_PER_PAGE)
    before = len(asked)
    with pytest.raises(PoolExhausted, match="just now"):
        pool.alloc(3 * BLOCKS_PER_PAGE)
    assert len(asked) == before, "the engine asked a full daemon again at once"
    hog.free(held)  # memory comes back: the agent's probe maps the reserve
    wait_until(lambda: pool.num_free_blocks >= 2 * BLOCKS_PER_PAGE, 10, "the agent never probed again")
    assert len(pool.alloc(2 * BLOCKS_PER_PAGE)) == 2 * BLOCKS_PER_PAGE
    pool.close()
    hog.close()


def test_the_floor_is_mapped_ahead_and_a_reclaim_takes_it_until_memory_is_free(kvd: RunningDaemon) -> None:
    client = kvd.client()
    pool = client.register("a", SPEC, num_spare_pages=0, num_prefetch_pages=0)
    pool.keep_free(0, 0, 3 * BLOCKS_PER_PAGE)  # an engine with work: a floor ahead of need, no reserve
    wait_until(lambda: mapped(client, "a") == 3 * LOGICAL, 10, "the floor was never mapped ahead")
    other = client.register("other", SPEC, num_spare_pages=0, num_prefetch_pages=0, grow_wait_s=2.0)
    held = other.alloc(6 * BLOCKS_PER_PAGE)  # five free: one more comes from a's floor
    assert mapped(client, "a") == 2 * LOGICAL
    time.sleep(1.2)  # the agent probes for its floor meanwhile: no memory is free above the low water
    assert mapped(client, "a") == 2 * LOGICAL and mapped(client, "other") == 6 * LOGICAL
    kvd.check_invariants()
    other.free(held)
    other.close()
    wait_until(lambda: mapped(client, "a") == 3 * LOGICAL, 10, "the floor was not mapped again once memory was free")
    pool.close()


def test_a_refused_floor_does_not_refuse_the_engines_own_grow(kvd: RunningDaemon) -> None:
    client = kvd.client()
    hog, held = occupy(client, 7)  # one logical page free: under the low water for speculation
    pool = client.register("a", SPEC, num_spare_pages=0, num_prefetch_pages=0, grow_wait_s=0.0)
    pool.keep_free(0, 0, 2 * BLOCKS_PER_PAGE)
    time.sleep(0.3)  # the agent's floor probes are refused
    assert mapped(client, "a") == 0
    assert len(pool.alloc(BLOCKS_PER_PAGE)) == BLOCKS_PER_PAGE, "real need gets the last page"
    assert next(t for t in client.status()["tenants"] if t["name"] == "a")["refused_grows"] == 0
    pool.close()
    hog.free(held)
    hog.close()


def test_a_free_notice_ends_the_agents_back_off(kvd: RunningDaemon, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_agent, "GROW_RETRY_S", 60.0)  # without the notice: no probe within the test
    monkeypatch.setattr(pool_agent, "GROW_RETRY_MAX_S", 60.0)
    client = kvd.client()
    hog, held = occupy(client, 8)  # the whole device
    pool = client.register("a", SPEC, num_spare_pages=0, num_prefetch_pages=0, grow_wait_s=0.0)
    pool.keep_free(2 * BLOCKS_PER_PAGE)  # refused: the agent backs off for a minute
    wait_until(lambda: pool.agent.reserve_backoff.at > time.monotonic() + 30, 10, "the probe was never refused")
    hog.free(held)  # hog's agent returns its pages: the daemon tells a
    wait_until(lambda: pool.num_free_blocks >= 2 * BLOCKS_PER_PAGE, 10, "the agent waited out its back-off")
    pool.close()
    hog.close()


def test_the_floor_comes_from_the_engines_own_cache_when_the_daemon_has_none_to_spare(kvd: RunningDaemon) -> None:
    client = kvd.client()
    hog, held = occupy(client, 7)  # one logical page free: under the low water for speculation
    pool = client.register("a", SPEC, num_spare_pages=0, num_prefetch_pages=0)
    cached = pool.alloc(BLOCKS_PER_PAGE)  # the daemon is full now: this page holds cache-only blocks
    asked: list[int] = []

    def evict(num_blocks: int) -> int:  # what BlockManager.evict_cached does: free cached blocks
        asked.append(num_blocks)
        gone, cached[:] = cached[:num_blocks], cached[num_blocks:]
        pool.free(gone)
        return len(gone)

    pool.reclaim_hook = evict
    pool.note_activity()  # the engine works
    pool.keep_free(0, 0, 2 * BLOCKS_PER_PAGE)  # a floor the daemon cannot spare
    wait_until(lambda: pool.num_free_blocks >= BLOCKS_PER_PAGE, 10, "the cache was never evicted for the floor")
    assert asked and asked[0] == 2 * BLOCKS_PER_PAGE
    assert mapped(client, "a") == LOGICAL, "the emptied page stays mapped: it is the floor"
    pool.close()
    hog.free(held)
    hog.close()


def test_an_ask_ahead_of_need_owes_nothing_and_an_ask_for_a_grow_owes_the_rest(
    kvd: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pool_agent, "OWED_S", float("inf"))  # the debt is paid here, never lapsed
    client = kvd.client()
    pool, held = occupy(client, 8)  # the whole device in live blocks: the daemon asks it ahead of need
    time.sleep(0.5)  # several ticks of the daemon's ask-ahead
    assert pool.owed_pages == 0, "an ask ahead of need made the pool owe pages"
    other = client.register("other", SPEC, num_spare_pages=0, num_prefetch_pages=0, grow_wait_s=0.0)
    with pytest.raises(PoolExhausted):
        other.alloc(BLOCKS_PER_PAGE)  # real need: the hog is asked, and owes what it cannot give
    wait_until(lambda: pool.owed_pages == 1, 10, "an ask for a grow was not owed")
    pool.free(held[-BLOCKS_PER_PAGE:])  # a page empties: it goes back
    wait_until(lambda: pool.owed_pages == 0 and mapped(client, "hog") == 7 * LOGICAL, 10, "the owed page stayed")
    other.close()
    pool.free(held[:-BLOCKS_PER_PAGE])
    pool.close()


def test_a_debt_lapses_no_sooner_than_the_daemon_forgets_a_refusal_or_asks_again() -> None:
    assert pool_agent.OWED_S == shares.STARVED_S
    assert reclaim.REASK_S < pool_agent.OWED_S


def owe_one_page(client: KVClient) -> tuple[KVPool, list[int], KVPool]:
    """A pool "p" of five logical pages of live blocks that owes one page to "o"'s refused grow."""
    pool = client.register("p", SPEC, num_spare_pages=0, num_prefetch_pages=0)
    held = pool.alloc(5 * BLOCKS_PER_PAGE)
    other = client.register("o", SPEC, num_spare_pages=0, num_prefetch_pages=0, grow_wait_s=0.0)
    with pytest.raises(PoolExhausted):
        other.alloc(4 * BLOCKS_PER_PAGE)  # three free: p is asked for one it cannot give yet
    wait_until(lambda: pool.owed_pages == 1, 10, "the urgent ask was not owed")
    return pool, held, other


def test_a_pool_that_owes_maps_no_floor_and_keeps_its_debt(kvd: RunningDaemon, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_agent, "OWED_S", float("inf"))  # the debt is paid here, never lapsed
    client = kvd.client()
    pool, held, other = owe_one_page(client)
    pool.keep_free(0, 0, 2 * BLOCKS_PER_PAGE)  # memory is free above the low water, but it owes
    time.sleep(0.5)
    assert pool.owed_pages == 1 and mapped(client, "p") == 5 * LOGICAL
    pool.free(held)
    wait_until(lambda: pool.owed_pages == 0, 10, "the debt was not paid")
    other.close()
    pool.close()


def test_an_unpaid_debt_lapses_after_owed_s(kvd: RunningDaemon, monkeypatch: pytest.MonkeyPatch) -> None:
    client = kvd.client()
    pool, held, other = owe_one_page(client)
    monkeypatch.setattr(pool_agent, "OWED_S", 0.0)  # read at the agent's wake-ups only
    pool.agent.nudge()
    wait_until(lambda: pool.owed_pages == 0, 10, "the debt outlived OWED_S")
    assert mapped(client, "p") == 5 * LOGICAL, "a page in use went back"
    other.close()
    pool.free(held)
    pool.close()


def test_a_sleep_settles_a_debt(kvd: RunningDaemon, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_agent, "OWED_S", float("inf"))  # the sleep settles it, not a lapse
    client = kvd.client()
    pool, _held, other = owe_one_page(client)
    pool.sleep("warm")  # every page goes back: nothing is owed after
    wait_until(lambda: pool.state.asleep and pool.owed_pages == 0, 10, "the debt outlived the sleep")
    pool.wake()
    assert pool.owed_pages == 0 and mapped(client, "p") == 5 * LOGICAL
    other.close()
    pool.close()


def test_the_cache_is_evicted_for_the_floor_once_per_refused_floor_grow(kvd: RunningDaemon) -> None:
    client = kvd.client()
    hog, held = occupy(client, 7)  # under the low water for speculation
    pool = client.register("a", SPEC, num_spare_pages=0, num_prefetch_pages=0)
    attempts, evictions = [], []
    grow_floor = pool.core.grow_floor
    pool.core.grow_floor = lambda: attempts.append(1) or grow_floor()  # type: ignore[method-assign]
    pool.reclaim_hook = lambda n: evictions.append(n) or 0  # an empty cache
    pool.keep_free(0, 0, BLOCKS_PER_PAGE)
    for _ in range(40):  # wake-ups that retry nothing (the floor backs off)
        pool.agent.nudge()
        time.sleep(0.02)
    assert attempts and len(evictions) <= len(attempts), "the hook ran on wake-ups that asked nothing"
    pool.close()
    hog.free(held)
    hog.close()


def test_the_pool_says_memory_is_scarce_while_its_floor_is_refused(kvd: RunningDaemon) -> None:
    client = kvd.client()
    pool = client.register("a", SPEC, num_spare_pages=0, num_prefetch_pages=0)
    pool.keep_free(0, 0, BLOCKS_PER_PAGE)
    wait_until(lambda: pool.num_free_blocks >= BLOCKS_PER_PAGE, 10, "the floor was never mapped ahead")
    assert pool.scarce_free_blocks() is None, "memory to spare: growing is cheap"
    hog, held = occupy(client, 6)  # one logical page free besides a's: under the low water
    pool.keep_free(0, 0, 2 * BLOCKS_PER_PAGE)  # a larger floor the daemon cannot spare
    wait_until(lambda: pool.scarce_free_blocks() is not None, 10, "the floor was never refused")
    assert pool.scarce_free_blocks() == pool.num_free_blocks == BLOCKS_PER_PAGE
    hog.free(held)
    hog.close()
    wait_until(lambda: pool.num_free_blocks >= 2 * BLOCKS_PER_PAGE, 10, "the floor was not mapped once memory was free")
    assert pool.scarce_free_blocks() is None
    pool.close()


def test_an_idle_engines_cache_is_not_evicted_for_its_floor(kvd: RunningDaemon) -> None:
    client = kvd.client()
    hog, held = occupy(client, 7)  # under the low water for speculation
    pool = client.register("a", SPEC, num_spare_pages=0, num_prefetch_pages=0)
    cached = pool.alloc(BLOCKS_PER_PAGE)  # cache-only blocks of an engine that does not step
    asked: list[int] = []
    pool.reclaim_hook = lambda n: asked.append(n) or 0
    pool.keep_free(0, 0, 2 * BLOCKS_PER_PAGE)  # a floor the daemon cannot spare
    wait_until(lambda: pool.scarce_free_blocks() is not None, 10, "the floor was never refused")
    time.sleep(0.3)  # the agent's refused floor probes
    assert asked == [], "an idle engine's cache was evicted for its floor"
    pool.free(cached)
    pool.close()
    hog.free(held)
    hog.close()


def cache_pool(client: KVClient, num_pages: int) -> tuple[KVPool, list[int], list[int]]:
    """A working engine's pool "a" of ``num_pages`` logical pages of cache-only blocks, with the
    reclaim hook an engine gives (it frees the oldest cached blocks): the pool, the cached
    blocks, and the sizes the hook was asked for."""
    pool = client.register("a", SPEC, num_spare_pages=0, num_prefetch_pages=0)
    cached, asked = pool.alloc(num_pages * BLOCKS_PER_PAGE), []

    def evict(num_blocks: int) -> int:
        asked.append(num_blocks)
        gone, cached[:] = cached[:num_blocks], cached[num_blocks:]
        pool.free(gone)
        return len(gone)

    pool.reclaim_hook = evict
    pool.note_activity()
    return pool, cached, asked


def need_grows(pool: KVPool) -> list[int]:
    """Record the pages of every grow for real need (not ahead of it) the pool asks from now on."""
    lease, asked = pool.lease, []
    grow = lease.grow

    def recording(pages: list[int], *args: object, **kwargs: object) -> object:
        if not kwargs.get("ahead"):
            asked.append(len(pages))
        return grow(pages, *args, **kwargs)

    lease.grow = recording  # type: ignore[method-assign]
    return asked


def agent_passes(pool: KVPool) -> list[int]:
    """A one-item list counting the agent's passes that ended from now on (each pass's
    housekeeping done; the floor's eviction, if any, follows within the pass)."""
    passes, housekeep = [0], pool.agent._housekeep

    def counting() -> None:
        housekeep()
        passes[0] += 1

    pool.agent._housekeep = counting  # type: ignore[method-assign]
    return passes


def told_scarce(pool: KVPool) -> bool:
    """The last heartbeat reply said the daemon has under a logical page to spare ahead of need."""
    room = pool.core.ahead_room_bytes
    return pool.core.fair_bytes is not None and room is not None and room < LOGICAL


def test_a_pool_holding_its_fair_share_takes_its_reserve_from_its_own_cache(kvd: RunningDaemon) -> None:
    """Fair shares: 29 of the 32 pages (3 are the low water), halved, in logical pages of 4: 12
    pages, 3 logical each. "a" holds exactly that in cache-only blocks; "hog" the rest, live."""
    client = kvd.client()
    hog, held = occupy(client, 5)
    pool, _cached, evicted = cache_pool(client, 3)  # the daemon is full
    wait_until(lambda: told_scarce(pool), 10, "no heartbeat reply said the daemon has nothing to spare")
    assert pool.mapped_bytes == pool.core.fair_bytes
    asked = need_grows(pool)
    passes = agent_passes(pool)
    nudges: list[int] = []
    nudge = pool.agent.nudge
    pool.agent.nudge = lambda: nudges.append(1)  # type: ignore[method-assign]
    pool.note_activity()
    assert pool.scarce_free_blocks() == 0, "its engine's allocations should take its own cache first"
    pool.keep_free(2 * BLOCKS_PER_PAGE, 0, 3 * BLOCKS_PER_PAGE)  # the next step's need, and a floor
    assert nudges == [], "keep_free woke the agent of a pool that recycles its cache"
    pool.agent.nudge = nudge  # type: ignore[method-assign]
    wait_until(lambda: pool.note_activity() or pool.num_free_blocks >= 2 * BLOCKS_PER_PAGE, 10,
               "the cache was not evicted for the reserve")  # the engine kept busy meanwhile
    done = passes[0]
    pool.agent.nudge()
    wait_until(lambda: passes[0] >= done + 2, 10, "the agent made no more passes")  # the reserve's pass ended
    assert asked == [], "a pool holding its fair share asked the daemon instead of its own cache"
    assert evicted == [2 * BLOCKS_PER_PAGE], "the floor stays in the cache, evicted when an allocation needs it"
    assert pool.num_free_blocks == 2 * BLOCKS_PER_PAGE and mapped(client, "a") == 3 * LOGICAL
    pool.close()
    hog.free(held)
    hog.close()


def test_a_pool_below_its_fair_share_grows_its_reserve_from_the_daemon(kvd: RunningDaemon) -> None:
    client = kvd.client()
    hog, held = occupy(client, 5)
    pool, _cached, evicted = cache_pool(client, 2)  # one logical page free: under the low water
    wait_until(lambda: told_scarce(pool), 10, "no heartbeat reply said the daemon has nothing to spare")
    assert pool.mapped_bytes < pool.core.fair_bytes
    asked = need_grows(pool)
    pool.note_activity()
    pool.keep_free(BLOCKS_PER_PAGE)  # its cache could cover it, but the pool is below its share
    wait_until(lambda: mapped(client, "a") == 3 * LOGICAL, 10, "the free page was not granted")
    assert asked and evicted == [], "a pool below its fair share evicted its cache instead of growing"
    pool.close()
    hog.free(held)
    hog.close()


def test_a_floor_found_mapped_leaves_its_back_off_to_a_daemon_with_nothing_to_spare(kvd: RunningDaemon) -> None:
    """Only a grant ends the floor's back-off: a busy engine's floor dips and is refilled every
    step, and a back-off reset each time it is found mapped would ask a full daemon each step."""
    client = kvd.client()
    hog, held = occupy(client, 6)  # one logical page free: under the low water for speculation
    pool, _cached, _evicted = cache_pool(client, 1)  # below its fair share: it asks for its floor
    backoff = pool.agent.floor_backoff
    pool.keep_free(0, 0, BLOCKS_PER_PAGE)
    wait_until(lambda: pool.num_free_blocks >= BLOCKS_PER_PAGE and backoff.retry_s > pool_agent.GROW_RETRY_S, 10,
               "the floor was not refused and then made from the cache")
    retry_s = backoff.retry_s
    time.sleep(0.1)  # the back-off's wait is over
    pool.agent.nudge()  # the agent finds the floor mapped
    time.sleep(0.1)
    assert backoff.retry_s == retry_s, "a floor found mapped ended the back-off"
    pool.close()
    hog.free(held)
    hog.close()


def test_a_recycling_pool_with_nothing_cached_leaves_the_grow_to_its_engines_allocation(kvd: RunningDaemon) -> None:
    """The daemon has nothing to spare and the cache cannot cover the reserve: the agent does not
    ask for it (a refusal, and the other tenants asked for pages, at every back-off's end); the
    engine's own allocation asks once it needs the blocks."""
    client = kvd.client()
    hog, held = occupy(client, 5)
    pool, cached, evicted = cache_pool(client, 3)  # the daemon is full; "a" holds its fair share
    pool.grow_wait_s = 0
    pool.reclaim_hook = lambda num_blocks: evicted.append(num_blocks) or 0  # every block is live
    wait_until(lambda: told_scarce(pool), 10, "no heartbeat reply said the daemon has nothing to spare")
    asked, passes = need_grows(pool), agent_passes(pool)
    pool.note_activity()
    pool.keep_free(2 * BLOCKS_PER_PAGE)
    done = passes[0]
    pool.agent.nudge()
    wait_until(lambda: pool.note_activity() or passes[0] >= done + 2, 10, "the agent made no more passes")
    assert evicted and asked == [], "the agent asked the daemon for the reserve of a pool that recycles"
    with pytest.raises(PoolExhausted):
        pool.alloc(1)
    assert asked == [1], "the engine's allocation did not ask for its block's page"
    pool.free(cached)
    pool.close()
    hog.free(held)
    hog.close()


def test_keep_free_does_not_wake_the_agent_for_the_floor_while_the_reserve_backs_off(kvd: RunningDaemon) -> None:
    """The agent maps the floor only once the reserve is free: a nudge for the floor while the
    reserve waits out a refusal would wake it at every step for nothing."""
    client = kvd.client()
    hog, held = occupy(client, 7)
    pool = client.register("a", SPEC, num_spare_pages=0, num_prefetch_pages=0)
    live = pool.alloc(BLOCKS_PER_PAGE)  # the daemon is full; "a" below its share
    pool.agent.grow_due = lambda floor=False: floor  # type: ignore[method-assign]  # the reserve backs off
    nudges: list[int] = []
    pool.agent.nudge = lambda: nudges.append(1)  # type: ignore[method-assign]
    pool.keep_free(BLOCKS_PER_PAGE, 0, 2 * BLOCKS_PER_PAGE)
    assert nudges == [], "keep_free woke the agent for a floor it may not map yet"
    pool.agent.grow_due = lambda floor=False: True  # type: ignore[method-assign]
    pool.keep_free(BLOCKS_PER_PAGE, 0, 2 * BLOCKS_PER_PAGE)
    assert nudges == [1], "keep_free did not wake the agent for a reserve it may grow"
    pool.free(live)
    pool.close()
    hog.free(held)
    hog.close()
