"""vLLM's real Scheduler and KVCacheManager over a kvdaemon tenant: admission, preemption, caching."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvdaemon.client import KVClient, KVPool, KVSpec
from kvdaemon.errors import PoolExhausted

from tests.conftest import RunningDaemon, wait_until
from tests.integrations.vllm.conftest import PAGE_BYTES, VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from .engines import NUM_LAYERS, Engine, start_engine, tokens  # noqa: E402

LOGICAL_PAGE_BYTES = NUM_LAYERS * PAGE_BYTES  # one 64 KiB page per layer: 16 vLLM blocks
HOG_SPEC = KVSpec(num_layers=1, num_kv_heads=2, head_dim=64, block_size=128, dtype="float32")
"""A plain tenant whose block fills a page: a logical page of two 64 KiB segments, like the engines'."""


@pytest.fixture
def engines(surface: Any, kvd: RunningDaemon, model_dir: Path) -> Iterator[list[Engine]]:
    """Engines started by a test (``engines.append``), closed after it."""
    started: list[Engine] = []
    yield started
    for engine in started:
        engine.close()
    kvd.check_invariants()


def start(engines: list[Engine], surface: Any, kvd: RunningDaemon, model_dir: Path, name: str, **kw: Any) -> Engine:
    engine = start_engine(surface, kvd.dir, model_dir, name, **kw)
    engines.append(engine)
    return engine


def hog(kvd: RunningDaemon, num_pages: int) -> tuple[KVClient, KVPool]:
    """Another tenant holding ``num_pages`` logical pages of the daemon."""
    client = kvd.client()
    pool = client.register("hog", HOG_SPEC, num_spare_pages=0, num_prefetch_pages=0)
    pool.alloc(num_pages)
    assert pool.mapped_bytes == num_pages * LOGICAL_PAGE_BYTES
    return client, pool


def mapped_pages(engine: Engine) -> int:
    return engine.tenant.pool.mapped_bytes // LOGICAL_PAGE_BYTES


def test_the_free_count_is_what_the_daemon_can_give(surface: Any, kvd: RunningDaemon, model_dir: Path, engines: list[Engine]) -> None:
    engine = start(engines, surface, kvd, model_dir, "a")
    pool = engine.block_pool
    assert pool.num_gpu_blocks == 256  # the whole daemon, virtually
    assert pool.get_num_free_blocks() == 255  # nothing else registered: all of it can be had
    client, hogged = hog(kvd, 12)
    pool.free_block_queue.headroom.expire()
    mapped = mapped_pages(engine)  # the null block's page and one prefetched
    free_pages = 16 - 12 - mapped
    assert pool.get_num_free_blocks() == mapped * 16 - 1 + free_pages * 16
    assert pool.get_usage() == 0.0
    hogged.close()
    client.close()


def test_requests_are_admitted_by_what_the_daemon_can_give(
    surface: Any, kvd: RunningDaemon, model_dir: Path, engines: list[Engine],
) -> None:
    engine = start(engines, surface, kvd, model_dir, "a", max_batched_tokens=2048)
    client, hogged = hog(kvd, 12)  # 4 logical pages left for the engine: 63 blocks
    for i in range(8):
        engine.add(f"r{i}", tokens(i, 150), max_tokens=2)  # 10 blocks each
    first = engine.step()
    assert len(first.scheduled_new_reqs) == 6  # 60 blocks fit, a 7th does not: it waits
    assert len(engine.scheduler.waiting) == 2
    assert mapped_pages(engine) == 4
    engine.check()
    engine.run()  # the first six finish, their blocks are reused, the last two run
    assert mapped_pages(engine) <= 4
    engine.check()
    hogged.close()
    client.close()


def test_a_running_request_is_preempted_when_the_daemon_refuses(
    surface: Any, kvd: RunningDaemon, model_dir: Path, engines: list[Engine],
) -> None:
    engine = start(engines, surface, kvd, model_dir, "a", prefix_caching=False)
    client, hogged = hog(kvd, 12)
    requests = [engine.add(f"r{i}", tokens(i, 16), max_tokens=150) for i in range(8)]
    first = engine.step()
    assert len(first.scheduled_new_reqs) == 8  # short prompts: all fit at first
    engine.run(max_steps=2000)  # decoding outgrows the 4 pages the daemon can give
    assert any(request.num_preemptions > 0 for request in requests)
    assert all(request.is_finished() for request in requests)
    assert mapped_pages(engine) <= 4
    engine.check()
    hogged.close()
    client.close()


def test_a_limit_lowered_under_a_busy_engine_preempts_and_the_pages_go_back(
    surface: Any, kvd: RunningDaemon, model_dir: Path, engines: list[Engine],
) -> None:
    """The free queue once counted the blocks held back by a lowered limit as free: vLLM took
    them, the pool refused (``PoolExhausted`` past the limit), and the engine died."""
    engine = start(engines, surface, kvd, model_dir, "a", prefix_caching=False)
    requests = [engine.add(f"r{i}", tokens(i, 16), max_tokens=150) for i in range(8)]
    while mapped_pages(engine) < 4:
        engine.step()
    limit_pages = mapped_pages(engine) - 2
    with kvd.client() as admin:
        admin.set_limit("a", max_bytes=limit_pages * LOGICAL_PAGE_BYTES)
    wait_until(lambda: engine.tenant.pool.max_bytes == limit_pages * LOGICAL_PAGE_BYTES, 5, "limit not told")
    engine.run(max_steps=3000)
    assert all(request.is_finished() for request in requests)
    assert any(request.num_preemptions > 0 for request in requests)
    assert mapped_pages(engine) <= limit_pages
    engine.check()


def test_free_blocks_counted_by_a_schedule_stay_until_it_takes_them(
    surface: Any, kvd: RunningDaemon, model_dir: Path, engines: list[Engine], monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = start(engines, surface, kvd, model_dir, "a", prefix_caching=False, max_batched_tokens=2048)
    engine.add("warm", tokens(1, 150), max_tokens=1)  # 10 blocks, freed without KV: mapped free in the pool
    engine.run()
    pool, block_pool = engine.tenant.pool, engine.block_pool
    num_free = pool.num_free_blocks
    assert num_free >= 19
    client = kvd.client()
    neighbour = client.register("hog", HOG_SPEC, num_spare_pages=0, num_prefetch_pages=0)
    neighbour.grow_wait_s = 0.3  # its grow waits that long for the pages the daemon asks back
    seen: list[int] = []
    original = type(block_pool).get_new_blocks

    def get_new_blocks(self: Any, num_blocks: int) -> Any:  # vLLM has just counted the free blocks
        free_pages = client.status()["free_bytes"] // LOGICAL_PAGE_BYTES
        with pytest.raises(PoolExhausted):  # the daemon asks "a" for its spare pages meanwhile
            neighbour.alloc(int(free_pages) + 1)  # one block a logical page
        time.sleep(0.3)  # the agent's return waits for the schedule to end
        seen.append(pool.num_free_blocks)
        return original(self, num_blocks)

    monkeypatch.setattr(type(block_pool), "get_new_blocks", get_new_blocks)
    engine.add("second", tokens(2, 300), max_tokens=1)  # 19 blocks, covered by the mapped free ones
    (scheduled,) = engine.step().scheduled_new_reqs  # vLLM would raise ValueError: blocks gone
    assert seen == [num_free] and len(scheduled.block_ids[0]) == 19
    monkeypatch.undo()
    engine.run()
    engine.check()
    neighbour.close()
    client.close()


def test_a_repeated_prompt_hits_the_prefix_cache(surface: Any, kvd: RunningDaemon, model_dir: Path, engines: list[Engine]) -> None:
    engine = start(engines, surface, kvd, model_dir, "a")
    prompt = tokens(1, 64)
    engine.add("first", prompt, max_tokens=2)
    (first,) = engine.step().scheduled_new_reqs
    engine.run()
    engine.add("again", prompt, max_tokens=2)
    (again,) = engine.step().scheduled_new_reqs
    assert again.num_computed_tokens == 48  # three full blocks; the last token is recomputed
    assert again.block_ids[0][:3] == first.block_ids[0][:3]
    engine.run()
    engine.check()


def test_pages_go_back_when_requests_finish(surface: Any, kvd: RunningDaemon, model_dir: Path, engines: list[Engine]) -> None:
    engine = start(engines, surface, kvd, model_dir, "a", prefix_caching=False, max_batched_tokens=2048)
    for i in range(6):
        engine.add(f"r{i}", tokens(i, 200), max_tokens=2)
    engine.step()
    assert mapped_pages(engine) >= 6
    engine.run()
    # The null block's page and at most two spare pages stay mapped (the rest go at the agent's tick).
    wait_until(lambda: mapped_pages(engine) <= 3, 5, "spare pages were not given back")

    def agreed() -> bool:  # the agent unmaps, then tells the daemon: a status may come between
        row = next(t for t in engine.tenant.client.status()["tenants"] if t["name"] == "a")
        return row["mapped_bytes"] == engine.tenant.pool.mapped_bytes

    wait_until(agreed, 5, "the daemon and the pool never agreed on the pages mapped")
    engine.check()


def test_reset_prefix_cache_drops_the_cache_and_returns_its_pages(
    surface: Any, kvd: RunningDaemon, model_dir: Path, engines: list[Engine], monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = start(engines, surface, kvd, model_dir, "a", events=True, max_batched_tokens=2048)
    published: list[str] = []
    monkeypatch.setattr(
        engine.scheduler.kv_event_publisher, "publish",
        lambda batch: published.extend(type(event).__name__ for event in batch.events),
    )
    prompts = [tokens(i, 200) for i in range(6)]
    for i, prompt in enumerate(prompts):
        engine.add(f"r{i}", prompt, max_tokens=2)
    engine.step()
    assert not engine.scheduler.reset_prefix_cache()  # blocks are in use
    engine.run()
    cached_pages = mapped_pages(engine)
    assert cached_pages >= 6  # finished requests' blocks stay cached, their pages mapped
    assert engine.scheduler.get_kv_cache_usage() == 0.0
    assert engine.scheduler.reset_prefix_cache()
    wait_until(lambda: mapped_pages(engine) <= 3, 5, "the cache's pages were not given back")
    assert "BlockStored" in published  # vLLM's events, published each step
    assert [type(event).__name__ for event in engine.block_pool.take_events()] == ["AllBlocksCleared"]
    engine.add("again", prompts[0], max_tokens=2)
    (again,) = engine.step().scheduled_new_reqs
    assert again.num_computed_tokens == 0
    engine.run()
    engine.check()


def test_usage_is_held_blocks_over_what_can_be_had(surface: Any, kvd: RunningDaemon, model_dir: Path, engines: list[Engine]) -> None:
    engine = start(engines, surface, kvd, model_dir, "a")
    assert engine.scheduler.get_kv_cache_usage() == 0.0
    engine.add("r", tokens(0, 100), max_tokens=50)
    engine.step()
    pool = engine.block_pool
    held = pool.free_block_queue.num_held - 1
    assert held == 7  # ceil(101 / 16)
    assert engine.scheduler.get_kv_cache_usage() == held / (held + pool.get_num_free_blocks())
    engine.run()


def run_until_finished(engine: Engine, deadline_s: float) -> None:
    """Step until no request is left; between steps that scheduled nothing, give the daemon a moment."""
    idle = threading.Event()
    deadline = time.monotonic() + deadline_s
    while engine.scheduler.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests did not finish in time"
        if not engine.step().num_scheduled_tokens:
            idle.wait(0.01)


def test_pages_move_from_an_idle_engine_to_a_busy_one(
    surface: Any, kvd: RunningDaemon, model_dir: Path, engines: list[Engine],
) -> None:
    a = start(engines, surface, kvd, model_dir, "a", max_batched_tokens=2048)
    b = start(engines, surface, kvd, model_dir, "b", max_batched_tokens=2048)
    for i in range(12):
        a.add(f"a{i}", tokens(i, 250), max_tokens=2)  # 16 blocks each
    a.run()
    a_peak = mapped_pages(a)
    assert a_peak >= 12  # its finished requests' blocks stay cached: nearly all the daemon
    # 64 blocks for one request: more than b holds (2 pages) and the daemon has free (2 pages),
    # so it runs only once a's cache made room.
    b.add("big", tokens(100, 1010), max_tokens=10)
    run_until_finished(b, deadline_s=60)
    assert mapped_pages(b) >= 5
    assert mapped_pages(b) + mapped_pages(a) <= 16
    assert mapped_pages(a) < a_peak
    assert kvd.daemon.service is not None
    assert kvd.client().status()["counters"]["reclaim_requests"] > 0
    a.check()
    b.check()
    a.add("again", tokens(0, 250), max_tokens=2)  # evicted blocks are gone from a's cache too
    a.run()
    a.check()
