"""Scheduler: budgets, chunking, admission, preemption of the youngest; no model needed."""

from __future__ import annotations

import random

import pytest

from kvdaemon.client.block_manager import BlockManager
from kvdaemon.client.local_pool import LocalPool
from kvdaemon.client.spec import KVSpec
from kvdaemon.errors import BadRequest, DaemonUnreachable, PoolExhausted
from kvdaemon.integrations.request import Request
from kvdaemon.integrations.scheduler import Scheduler

SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, dtype="float32")


def make(num_blocks: int, budget: int = 16, max_seqs: int = 8) -> tuple[Scheduler, LocalPool]:
    pool = LocalPool(SPEC, num_blocks)
    return Scheduler(BlockManager(pool), budget, max_seqs), pool


def request(request_id: int, num_prompt: int, max_new: int, seed: int = 0) -> Request:
    rng = random.Random(seed * 1000 + request_id)
    prompt = [rng.randrange(3, 100) for _ in range(num_prompt)]
    return Request(request_id, prompt, max_new, frozenset(), arrival_s=0.0)


def run_step(scheduler: Scheduler, now: float = 1.0) -> list[tuple[int, int]]:
    """Schedule and complete one step with token 1 for every sampled request; (id, new tokens)."""
    batch = scheduler.schedule()
    sampled = sum(1 for r, n in batch.items if r.num_computed + n == r.num_tokens)
    items = [(r.request_id, n) for r, n in batch.items]
    scheduler.complete(batch, [1] * sampled, now)
    return items


def check(scheduler: Scheduler) -> None:
    manager = scheduler.manager
    assert len(manager) == len(scheduler.running)
    for r in scheduler.running:
        assert manager.num_tokens(r.request_id) == r.num_computed
    for r in scheduler.waiting:
        assert r.request_id not in manager and r.num_computed == 0


def test_a_long_prompt_is_chunked_and_decodes_join_the_same_step() -> None:
    scheduler, _ = make(64, budget=8)
    scheduler.add(request(0, 4, 3))
    assert run_step(scheduler) == [(0, 4)]  # prefill done, first token
    scheduler.add(request(1, 20, 2))
    assert run_step(scheduler) == [(0, 1), (1, 7)]  # a decode and a 7-token chunk
    assert run_step(scheduler) == [(0, 1), (1, 7)]
    assert run_step(scheduler) == [(1, 6)]  # request 0 finished; the last chunk samples
    check(scheduler)


def test_max_num_seqs_bounds_the_running_set() -> None:
    scheduler, _ = make(64, budget=100, max_seqs=2)
    for i in range(4):
        scheduler.add(request(i, 3, 5))
    assert [rid for rid, _ in run_step(scheduler)] == [0, 1]
    assert len(scheduler.running) == 2 and len(scheduler.waiting) == 2


def test_out_of_blocks_preempts_the_youngest_and_requeues_it_first() -> None:
    scheduler, pool = make(8, budget=100)  # 8 blocks of 4 tokens
    for i in range(3):
        scheduler.add(request(i, 8, 20))  # each prompt needs 2 blocks now and more later
    run_step(scheduler)  # admitted with 0, 1 and 2 blocks of headroom: 2 blocks stay free
    assert pool.num_free_blocks == 2 and len(scheduler.running) == 3
    run_step(scheduler)  # each needs a 3rd block: 0 and 1 get the last two, 2 (youngest) is preempted
    assert [r.request_id for r in scheduler.running] == [0, 1]
    assert [r.request_id for r in scheduler.waiting] == [2]
    assert scheduler.num_preemptions == 1 and scheduler.waiting[0].num_preemptions == 1
    check(scheduler)


class UnreachablePool(LocalPool):
    """A pool whose daemon is down: its free blocks serve, a grow for more cannot."""

    def alloc(self, num_blocks: int) -> list[int]:
        try:
            return super().alloc(num_blocks)
        except PoolExhausted:
            raise DaemonUnreachable("no kvdaemon running") from None


def test_with_the_daemon_down_running_requests_go_on_in_what_is_mapped() -> None:
    pool = UnreachablePool(SPEC, 8)
    scheduler = Scheduler(BlockManager(pool), 100, 8)
    for i in range(3):
        scheduler.add(request(i, 8, 20))
    run_step(scheduler)
    run_step(scheduler)  # as with an exhausted pool: the youngest makes room for the others
    assert [r.request_id for r in scheduler.running] == [0, 1] and scheduler.num_preemptions == 1
    check(scheduler)
    for _ in range(200):
        if not scheduler.has_work:
            break
        run_step(scheduler)
        check(scheduler)
    assert not scheduler.has_work, "every request finished without the daemon"


def test_a_request_waits_rather_than_take_the_blocks_running_decodes_need_next() -> None:
    scheduler, pool = make(7, budget=100)
    scheduler.add(request(0, 12, 20))  # 3 blocks; nothing running, so no headroom asked
    run_step(scheduler)
    scheduler.add(request(1, 12, 20))  # 3 blocks would fit, but not with 1 to spare for request 0
    run_step(scheduler)
    assert [r.request_id for r in scheduler.running] == [0]
    assert [r.request_id for r in scheduler.waiting] == [1] and scheduler.waiting[0].num_preemptions == 0
    assert pool.num_free_blocks == 3  # request 0 took its 4th block; the headroom went back
    check(scheduler)


def test_a_random_workload_keeps_every_invariant_and_finishes() -> None:
    rng = random.Random(4)
    scheduler, pool = make(40, budget=12, max_seqs=5)
    requests = [request(i, rng.randint(1, 30), rng.randint(1, 12), seed=1) for i in range(25)]
    for r in requests[:10]:
        scheduler.add(r)
    pending = requests[10:]
    for _ in range(2000):
        if not scheduler.has_work and not pending:
            break
        if pending and rng.random() < 0.3:
            scheduler.add(pending.pop(0))
        items = run_step(scheduler)
        assert sum(n for _, n in items) <= 12 and len(scheduler.running) <= 5
        check(scheduler)
    assert all(r.finished and r.num_output_tokens == r.max_new_tokens for r in requests)
    assert scheduler.manager.num_held_blocks == 0
    assert pool.num_used_blocks == scheduler.manager.num_evictable_blocks  # only the prefix cache holds blocks


def test_forget_cache_requeues_everything_in_order() -> None:
    scheduler, _ = make(64)
    for i in range(3):
        scheduler.add(request(i, 5, 5))
    run_step(scheduler)
    scheduler.add(request(3, 5, 5))
    scheduler.forget_cache()
    assert [r.request_id for r in scheduler.waiting] == [0, 1, 2, 3]
    assert scheduler.running == [] and len(scheduler.manager) == 0
    assert all(r.num_computed == 0 for r in scheduler.waiting)


def test_bad_limits_are_refused() -> None:
    pool = LocalPool(SPEC, 4)
    for budget, seqs in ((0, 1), (1, 0), (True, 1), (1.5, 1)):
        with pytest.raises(BadRequest):
            Scheduler(BlockManager(pool), budget, seqs)  # type: ignore[arg-type]


def test_blocks_needed_next_covers_what_the_next_step_takes() -> None:
    scheduler, pool = make(4096, budget=24, max_seqs=6)
    rng = random.Random(3)
    for i in range(12):
        scheduler.add(request(i, rng.randint(1, 30), rng.randint(1, 12), seed=3))
    assert scheduler.blocks_needed_next() > 0
    while scheduler.has_work:
        needed = scheduler.blocks_needed_next()
        before = pool.num_used_blocks
        batch = scheduler.schedule()  # memory is ample: it only allocates
        assert pool.num_used_blocks - before <= needed
        sampled = sum(1 for r, n in batch.items if r.num_computed + n == r.num_tokens)
        scheduler.complete(batch, [1] * sampled, 1.0)
    assert scheduler.blocks_needed_next() == 0, "nothing left to run needs nothing"
    scheduler.add(request(99, 1, 1))
    assert scheduler.blocks_needed_next() == 1, "a one-token prompt waiting: its one block, no floor"
    assert scheduler.budget_blocks == 24 // 4


def test_no_request_is_admitted_into_blocks_the_pool_owes_back() -> None:
    owed = [12]
    pool = LocalPool(SPEC, 16)
    scheduler = Scheduler(BlockManager(pool), 64, 4, owed_blocks=lambda: owed[0])
    scheduler.add(request(0, 5 * SPEC.block_size - 1, 2))  # five blocks: fits, but not beside 12 owed
    assert not scheduler.schedule() and len(scheduler.waiting) == 1
    assert pool.num_used_blocks == 0, "a refused admission holds nothing"
    owed[0] = 0
    assert scheduler.schedule().items and scheduler.running
