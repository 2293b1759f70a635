"""``kvdaemon sleep/wake`` of a vLLM tenant: between steps, warm keeps the KV, cold drops it safely."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import RunningDaemon
from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from .engines import Engine, start_engine, tokens  # noqa: E402


@pytest.fixture
def engine(surface: Any, kvd: RunningDaemon, model_dir: Path) -> Iterator[Engine]:
    engine = start_engine(surface, kvd.dir, model_dir, "a")
    yield engine
    engine.close()
    kvd.check_invariants()


def state(engine: Engine) -> str:
    return next(t["state"] for t in engine.tenant.client.status()["tenants"] if t["name"] == "a")


def running_request(engine: Engine) -> tuple[Any, list[int]]:
    """A request mid-decode and its block ids, each block's first layer filled with its id."""
    request = engine.add("r", tokens(0, 100), max_tokens=40)
    (new,) = engine.step().scheduled_new_reqs
    blocks = list(new.block_ids[0])
    segment = engine.tenant.pool.segment(0)
    for block in blocks:
        segment[block].fill_(block % 100 + 1)
    return request, blocks


def test_a_warm_sleep_keeps_the_kv_and_the_next_step_wakes_the_engine(engine: Engine) -> None:
    request, blocks = running_request(engine)
    engine.tenant.client.sleep("a", mode="warm")
    assert state(engine) == "sleeping-warm" and engine.tenant.pool.mapped_bytes == 0
    engine.step()  # wakes the pool before scheduling
    assert state(engine) == "active"
    segment = engine.tenant.pool.segment(0)
    for block in blocks:
        assert torch.all(segment[block] == block % 100 + 1)
    engine.run()
    assert request.is_finished() and request.num_preemptions == 0
    engine.check()


def test_a_sleep_waits_for_the_step_in_progress(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    _, blocks = running_request(engine)
    pool, gate = engine.tenant.pool, engine.tenant.gate
    asked = threading.Event()

    def quiesce() -> None:
        asked.set()
        gate.quiesce()

    monkeypatch.setattr(pool, "quiesce_hook", quiesce)
    sleeper = threading.Thread(target=engine.tenant.client.sleep, args=("a", "warm"))
    with gate.hold():  # an engine step in progress
        sleeper.start()
        assert asked.wait(10), "the daemon never asked the pool to quiesce"
        assert pool.sleep_mode is None and pool.mapped_bytes > 0
        assert engine.tenant.pool.segment(0)[blocks[0]].sum() > 0  # its pages are still there
    sleeper.join(30)
    assert not sleeper.is_alive() and pool.sleep_mode == "warm"
    engine.run()
    engine.check()


def test_a_cold_sleep_preempts_running_requests_and_drops_the_cache(engine: Engine) -> None:
    engine.add("cached", tokens(1, 64), max_tokens=2)
    engine.run()
    request, _ = running_request(engine)
    engine.tenant.client.sleep("a", mode="cold")
    assert state(engine) == "sleeping-cold"
    assert request in engine.scheduler.waiting and request.num_preemptions == 1
    queue = engine.block_pool.free_block_queue
    assert queue.num_held == 1 and not queue.cached  # vLLM holds nothing but the null block
    output = engine.step()  # wakes with fresh pages; the request starts over
    assert state(engine) == "active" and queue.owned[0]
    assert output.num_scheduled_tokens["r"] == 101  # its prompt and first token, computed again
    engine.add("cached-again", tokens(1, 64), max_tokens=2)
    (again,) = engine.step().scheduled_new_reqs
    assert again.num_computed_tokens == 0  # the prefix cache went with the pages
    engine.run()
    assert request.is_finished()
    engine.check()


def test_a_warm_sleep_made_cold_is_found_at_the_wake_and_the_kv_dropped(engine: Engine) -> None:
    request, _ = running_request(engine)
    engine.tenant.client.sleep("a", mode="warm")
    engine.tenant.client.sleep("a", mode="cold")  # the daemon drops the host copy: the blocks are gone
    assert state(engine) == "sleeping-cold" and request.num_preemptions == 0  # the engine does not know yet
    output = engine.step()  # wakes with fresh pages, finds the loss, then schedules
    assert state(engine) == "active" and request.num_preemptions == 1
    assert output.num_scheduled_tokens["r"] == 101  # its prompt and first token, computed again
    engine.run()
    assert request.is_finished()
    engine.check()
