"""Warm and cold sleep and wake of a pool, through the daemon and the Python API."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvdaemon.client import KVClient, KVPool, KVSpec
from kvdaemon.client.pool_state import PoolState
from kvdaemon.errors import Asleep, BackendError, BadRequest, Conflict, KVDaemonError, PoolExhausted, UnknownTenant
from kvdaemon.wire.messages import Notice, WakeNotice

from tests.conftest import PAGE_BYTES, RunningDaemon, running_daemon, wait_until

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)
BLOCKS_PER_PAGE = PAGE_BYTES // SPEC.block_bytes
CAPACITY = 64 * 1024 * 1024


@pytest.fixture
def kvd(request: pytest.FixtureRequest) -> Iterator[RunningDaemon]:
    """A 64 MiB daemon; ``indirect`` parametrization passes config fields."""
    with running_daemon("64MiB", **getattr(request, "param", {})) as running:
        yield running


def row(client: KVClient, name: str = "a") -> dict:
    return next(t for t in client.status()["tenants"] if t["name"] == name)


def fill(pool: KVPool, blocks: list[int], seed: int = 0) -> list[torch.Tensor]:
    """Write random K/V into ``blocks`` of every layer; return what was written."""
    gen = torch.Generator().manual_seed(seed)
    written = []
    for layer in range(SPEC.num_layers):
        for cache in (pool.key_cache(layer), pool.value_cache(layer)):
            data = torch.randn(len(blocks), 16, 2, 64, generator=gen).half()
            cache[blocks] = data
            written.append(data)
    return written


def read(pool: KVPool, blocks: list[int]) -> list[torch.Tensor]:
    return [
        cache[blocks].clone()
        for layer in range(SPEC.num_layers)
        for cache in (pool.key_cache(layer), pool.value_cache(layer))
    ]


def wait_awake(pool: KVPool) -> None:
    assert pool.wait_state(lambda state: state is PoolState.ACTIVE, 5), "the pool did not wake"


@pytest.mark.parametrize("sliced", [False, True], ids=["one-copy", "sliced"])
def test_warm_sleep_keeps_every_byte_at_the_same_addresses(
    kvd: RunningDaemon, sliced: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = kvd.daemon.service
    assert service is not None
    started = []
    real_start = service.sleeper.copies.start
    monkeypatch.setattr(service.sleeper.copies, "start", lambda *a: started.append(1) or real_start(*a))
    if sliced:  # each copy a page at a time, between the daemon loop's other work
        monkeypatch.setattr(service.backend, "copy_slice_bytes", PAGE_BYTES)
    client = kvd.client()
    pool = client.register("a", SPEC, num_prefetch_pages=0)
    blocks = pool.alloc(2 * BLOCKS_PER_PAGE + 5)  # three logical pages
    written = fill(pool, blocks)
    mapped = row(client)["mapped_bytes"]
    addresses = [pool.key_cache(0).data_ptr(), pool.value_cache(1).data_ptr()]

    result = client.sleep("a", "warm")
    assert result["state"] == "sleeping-warm" and result["host_bytes"] == mapped
    asleep = row(client)
    assert (asleep["state"], asleep["mapped_bytes"], asleep["host_bytes"]) == (
        "sleeping-warm", 0, mapped)
    assert client.status()["free_bytes"] == CAPACITY
    with pytest.raises(Asleep):
        pool.alloc(1)
    pool.free(blocks[:1])  # freeing while asleep keeps the books right
    kvd.check_invariants()

    assert client.wake("a")["state"] == "active"
    assert pool.state is PoolState.ACTIVE, "wake returns once this client's pool has mapped its pages"
    assert [pool.key_cache(0).data_ptr(), pool.value_cache(1).data_ptr()] == addresses
    for before, after in zip(written, read(pool, blocks)):
        assert torch.equal(before, after)
    assert row(client)["mapped_bytes"] == mapped and row(client)["host_bytes"] == 0
    assert len(started) == (2 if sliced else 0)  # the sleep's copy and the wake's ran sliced, or in one go
    fresh = pool.alloc(4)
    assert not set(fresh) & set(blocks[1:]), "a live block was handed out again"
    kvd.check_invariants()
    pool.close()


def test_a_warm_sleep_gives_its_spare_pages_back_instead_of_saving_them(kvd: RunningDaemon) -> None:
    client = kvd.client()
    pool = client.register("a", SPEC, num_spare_pages=8, num_prefetch_pages=0)
    blocks = pool.alloc(3 * BLOCKS_PER_PAGE)  # three logical pages
    pool.free(blocks[BLOCKS_PER_PAGE:])  # two of them spare (kept: num_spare_pages)
    kept = blocks[:BLOCKS_PER_PAGE]
    written = fill(pool, kept)
    logical = SPEC.num_segments * PAGE_BYTES
    assert row(client)["mapped_bytes"] == 3 * logical
    assert client.sleep("a", "warm")["host_bytes"] == logical, "only the page with blocks is saved"
    client.wake("a")
    wait_awake(pool)
    assert row(client)["mapped_bytes"] == logical
    for before, after in zip(written, read(pool, kept)):
        assert torch.equal(before, after)
    assert len(pool.alloc(2 * BLOCKS_PER_PAGE)) == 2 * BLOCKS_PER_PAGE  # the pool grows again
    kvd.check_invariants()
    pool.close()


def test_a_pool_woken_above_a_limit_lowered_in_its_sleep_owes_the_excess(kvd: RunningDaemon) -> None:
    client = kvd.client()
    pool = client.register("a", SPEC, num_spare_pages=8, num_prefetch_pages=0)
    blocks = pool.alloc(4 * BLOCKS_PER_PAGE)  # four logical pages, all in use
    logical = SPEC.num_segments * PAGE_BYTES
    client.sleep("a", "warm")
    client.set_limit("a", max_bytes=2 * logical)
    client.wake("a")
    wait_awake(pool)
    wait_until(lambda: pool.max_bytes == 2 * logical, 5, "the pool was not told its limit")
    assert row(client)["mapped_bytes"] == 4 * logical  # live blocks come back
    assert pool.owed_pages == 2, "the engine would admit new work into pages past the limit"
    pool.free(blocks[2 * BLOCKS_PER_PAGE :])
    wait_until(lambda: row(client)["mapped_bytes"] == 2 * logical, 5, "the excess was not given back")
    assert pool.owed_pages == 0
    kvd.check_invariants()
    pool.close()


def test_a_warm_sleep_of_a_pool_with_no_pages_keeps_no_host_bytes(kvd: RunningDaemon) -> None:
    client = kvd.client()
    pool = client.register("a", SPEC)
    pool.quiesce_hook = lambda: None
    assert client.sleep("a", "warm")["host_bytes"] == 0
    assert row(client)["state"] == "sleeping-warm" and row(client)["host_bytes"] == 0
    assert client.status()["host_bytes"] == 0
    client.wake("a")
    wait_awake(pool)
    assert len(pool.alloc(2)) == 2
    pool.close()


def test_cold_sleep_wakes_to_an_empty_pool(kvd: RunningDaemon) -> None:
    client = kvd.client()
    pool = client.register("a", SPEC)
    blocks = pool.alloc(BLOCKS_PER_PAGE)
    fill(pool, blocks)
    assert client.sleep("a", "cold")["host_bytes"] == 0
    assert row(client)["state"] == "sleeping-cold"
    client.wake("a")
    wait_awake(pool)
    assert pool.num_used_blocks == 0 and pool.mapped_bytes == 0
    again = pool.alloc(8)
    assert float(pool.key_cache(0)[again].abs().sum()) == 0.0  # nothing of the old KV survives
    pool.close()


@pytest.mark.parametrize("kvd", [{"sleep_timeout_s": 0.3}], indirect=True)
def test_an_engine_that_does_not_quiesce_loses_nothing(kvd: RunningDaemon) -> None:
    client = kvd.client()
    pool = client.register("a", SPEC, num_prefetch_pages=0)
    blocks = pool.alloc(10)
    written = fill(pool, blocks, seed=3)
    pool.quiesce_hook = lambda: time.sleep(1.0)  # a step that outlasts the timeout
    resumed: list[str | None] = []
    pool.resume_hook = lambda: resumed.append(pool.sleep_mode)
    with pytest.raises(Conflict, match="did not quiesce"):
        client.sleep("a")
    # the late sleep_ready is refused; the pool maps its pages back and lets the engine go, awake
    wait_until(lambda: resumed == [None])
    assert row(client)["state"] == "active"
    assert row(client)["mapped_bytes"] == SPEC.num_segments * PAGE_BYTES
    for before, after in zip(written, read(pool, blocks)):
        assert torch.equal(before, after)
    pool.quiesce_hook = None
    pool.alloc(1)
    kvd.check_invariants()
    pool.close()


def test_auto_wake_pool_wakes_on_alloc(kvd: RunningDaemon) -> None:
    client = kvd.client()
    pool = client.register("a", SPEC, auto_wake=True)
    blocks = pool.alloc(3)
    client.sleep("a")
    got = pool.alloc(2)
    assert row(client)["state"] == "active"
    assert not set(got) & set(blocks)
    pool.close()


def test_bad_sleep_and_wake_requests(kvd: RunningDaemon) -> None:
    client = kvd.client()
    pool = client.register("a", SPEC)
    with pytest.raises(UnknownTenant):
        client.sleep("nobody")
    with pytest.raises(BadRequest, match="mode"):
        client.sleep("a", "tepid")
    assert client.wake("a")["already"] is True  # awake already: said so, exit 0 for the CLI
    client.sleep("a")
    assert client.sleep("a")["already"] is True
    assert client.sleep("a", "cold")["state"] == "sleeping-cold"  # a warm sleeper made cold
    pool.close()  # closing a sleeper drops its warm copy with it
    status = client.status()
    assert status["tenants"] == [] and status["free_bytes"] == CAPACITY


def test_idle_policy_sleeps_the_idle_tenant_not_the_busy_one() -> None:
    with running_daemon("64MiB", idle_sleep_s=2.5) as kvd:
        client = kvd.client()
        idle = client.register("idle", SPEC)
        busy = client.register("busy", SPEC)
        for pool in (idle, busy):
            pool.quiesce_hook = lambda: None  # nothing runs between allocations: safe to sleep
        idle.alloc(4)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:  # a live block change every 0.2 s
            busy.alloc(1)
            time.sleep(0.2)
        states = {t["name"]: t["state"] for t in client.status()["tenants"]}
        assert states == {"idle": "sleeping-warm", "busy": "active"}
        idle.close()
        busy.close()


def test_the_engine_is_held_from_quiesce_to_resume(kvd: RunningDaemon) -> None:
    client = kvd.client()
    pool = client.register("a", SPEC)
    pool.alloc(2)
    events: list[tuple[str, str | None, int]] = []
    pool.quiesce_hook = lambda: events.append(("quiesce", pool.sleep_mode, pool.mapped_bytes))
    pool.resume_hook = lambda: events.append(("resume", pool.sleep_mode, pool.mapped_bytes))
    client.sleep("a", mode="cold")  # answered once the pool is unmapped; resume runs right after
    wait_until(lambda: len(events) >= 2)
    mapped = SPEC.num_segments * PAGE_BYTES * 2  # the page of the blocks and one prefetched
    assert events == [("quiesce", None, mapped), ("resume", "cold", 0)]
    pool.wake()
    assert pool.sleep_mode is None and row(client)["state"] == "active"
    pool.wake()  # awake already: nothing to do
    assert len(pool.alloc(1)) == 1
    pool.close()


def test_pool_wake_while_another_wake_is_on_its_way(kvd: RunningDaemon) -> None:
    client = kvd.client()
    pool = client.register("a", SPEC)
    blocks = pool.alloc(3)
    written = fill(pool, blocks, seed=4)
    client.sleep("a")
    deliver = pool.lease.on_notice

    def late(notice: Notice) -> None:  # the wake notice reaches the agent 0.3 s late
        if isinstance(notice, WakeNotice):
            time.sleep(0.3)
        deliver(notice)

    pool.lease.on_notice = late
    client.call("wake", {"name": "a"})  # the daemon has it awake; the pool does not know yet
    assert pool.sleep_mode == "warm"
    pool.wake()  # the daemon says "already awake": the pool waits for the notice instead
    assert pool.sleep_mode is None
    for before, after in zip(written, read(pool, blocks)):
        assert torch.equal(before, after)
    pool.close()


def test_a_warm_sleeper_keeps_its_room_under_the_map_cap_for_its_wake(kvd: RunningDaemon) -> None:
    client = kvd.client()
    sleeper = client.register("a", SPEC, num_prefetch_pages=0, num_spare_pages=0)
    other = client.register("b", SPEC, num_prefetch_pages=0, num_spare_pages=0)
    sleeper.quiesce_hook = lambda: None
    backend = sleeper.backend
    blocks = sleeper.alloc(2 * BLOCKS_PER_PAGE)  # two logical pages
    written = fill(sleeper, blocks)
    backend.max_mappings -= backend._map_cap() - backend._book.num_mappings  # nothing more may map now
    client.sleep("a", "warm")
    with pytest.raises(PoolExhausted, match="vm.max_map_count"):
        other.alloc(1)  # a's room is held for its wake, unmapped as it is
    assert client.wake("a")["state"] == "active"
    for before, after in zip(written, read(sleeper, blocks)):
        assert torch.equal(before, after)
    client.sleep("a", "cold")  # a cold sleeper holds nothing: its wake maps as a grow does
    assert other.alloc(BLOCKS_PER_PAGE)
    client.wake("a")
    other.close()
    sleeper.close()
    assert backend.num_held_mappings == 0


def failing_map(backend: object, monkeypatch: pytest.MonkeyPatch, after: int) -> None:
    """Make ``backend.map_page`` refuse (as the OS does when out of memory) after ``after`` calls,
    and ``map_pages`` (runs at once) refuse from the first: the pool then maps page by page."""
    real, calls = backend.map_page, [0]

    def map_page(*args: object) -> None:
        calls[0] += 1
        if calls[0] > after:
            raise BackendError("mmap failed: out of memory (a test)")
        real(*args)

    def map_pages(*_args: object) -> None:
        raise BackendError("mmap failed: out of memory (a test)")

    monkeypatch.setattr(backend, "map_page", map_page)
    monkeypatch.setattr(backend, "map_pages", map_pages)


def test_a_warm_wake_this_process_cannot_map_ends_active_with_both_sides_agreeing(
    kvd: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = kvd.client()
    pool = client.register("a", SPEC, num_prefetch_pages=0, num_spare_pages=0)
    blocks = pool.alloc(3 * BLOCKS_PER_PAGE)  # three logical pages
    fill(pool, blocks)
    client.sleep("a", "warm")
    failing_map(pool.backend, monkeypatch, after=SPEC.num_segments + 1)  # the first page, then one segment
    assert client.wake("a")["state"] == "active"
    wait_awake(pool)
    monkeypatch.undo()
    assert pool.num_block_losses == 1, "the blocks of the pages not mapped would read garbage"
    logical = SPEC.num_segments * PAGE_BYTES
    assert pool.mapped_bytes == logical and pool.num_used_blocks == 0
    wait_until(lambda: row(client)["mapped_bytes"] == logical, 5, "the daemon still counts the unmapped pages")
    assert client.status()["free_bytes"] == CAPACITY - logical
    kvd.check_invariants()
    assert len(pool.alloc(3 * BLOCKS_PER_PAGE)) == 3 * BLOCKS_PER_PAGE  # the pool grows again
    pool.close()


def test_a_wake_whose_pages_cannot_be_taken_in_ends_active_with_none(
    kvd: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = kvd.client()
    pool = client.register("a", SPEC, num_prefetch_pages=0)
    fill(pool, pool.alloc(BLOCKS_PER_PAGE))
    client.sleep("a", "warm")
    real = pool.lease.receive_pages

    def out_of_step(grant_id: int, logical_pages: list[int], *rest: object) -> object:
        for pages in real(grant_id, logical_pages, *rest).values():  # read off the channel, then
            pool.core.segments.release(pages)  # refused, nothing kept (as a bad frame is)
        raise BadRequest(f"handle channel out of step for grant {grant_id}")

    monkeypatch.setattr(pool.lease, "receive_pages", out_of_step)
    client.wake("a")
    wait_awake(pool)
    assert pool.num_block_losses == 1 and pool.mapped_bytes == 0
    assert pool.backend.num_held_mappings == 0, "the room kept for the wake's mappings was never given back"
    wait_until(lambda: row(client)["mapped_bytes"] == 0, 5, "the daemon still counts pages the pool never mapped")
    kvd.check_invariants()
    pool.close()


def test_a_sleep_not_done_whose_pages_cannot_all_be_mapped_back_keeps_both_sides_agreeing(
    kvd: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, admin = kvd.client(), kvd.client()
    pool = client.register("a", SPEC, num_prefetch_pages=0, num_spare_pages=0)
    quiescing, go = threading.Event(), threading.Event()
    pool.quiesce_hook = lambda: (quiescing.set(), go.wait(10))
    fill(pool, pool.alloc(2 * BLOCKS_PER_PAGE))
    refused: list[KVDaemonError] = []

    def sleep() -> None:
        try:
            admin.sleep("a", "warm")
        except KVDaemonError as exc:
            refused.append(exc)

    sleeper = threading.Thread(target=sleep)
    sleeper.start()
    assert quiescing.wait(5)
    kvd.client().wake("a")  # the later word: the daemon cancels the sleep the engine is quiescing for
    failing_map(pool.backend, monkeypatch, after=SPEC.num_segments)  # the first page maps back, not the second
    go.set()
    sleeper.join(10)
    assert [exc.code for exc in refused] == ["CONFLICT"], "the sleep was not cancelled by the wake"
    wait_until(lambda: pool.num_block_losses == 1, 5, "the pool kept blocks whose pages are not mapped")
    monkeypatch.undo()
    logical = SPEC.num_segments * PAGE_BYTES
    assert pool.state is PoolState.ACTIVE and pool.mapped_bytes == logical and pool.num_used_blocks == 0
    wait_until(lambda: row(client)["mapped_bytes"] == logical, 5, "the daemon still counts the unmapped page")
    assert pool.backend.num_held_mappings == 0
    kvd.check_invariants()
    pool.close()


def test_the_owners_wake_returns_once_woken_though_a_sleep_follows_at_once(kvd: RunningDaemon) -> None:
    client, other = kvd.client(), kvd.client()
    pool = client.register("a", SPEC, num_prefetch_pages=0, num_spare_pages=0)
    pool.quiesce_hook = lambda: None
    pool.alloc(3 * BLOCKS_PER_PAGE)
    client.sleep("a", "warm")
    real, mapping = pool.backend.map_pages, threading.Event()

    def slow_map(*args: object) -> None:
        mapping.set()
        time.sleep(0.3)
        real(*args)

    pool.backend.map_pages = slow_map
    woken: list[object] = []
    waker = threading.Thread(target=lambda: woken.append(client.wake("a", timeout_s=30)))
    waker.start()
    own = threading.Thread(target=lambda: woken.append(pool.wake()))  # the pool's own wake joins it
    own.start()
    assert mapping.wait(5)
    try:
        other.sleep("a", "cold", timeout_s=10)  # lands while the pool maps its wake
        slept = True
    except Conflict as exc:  # the pool's own wake reached the daemon after it (a slow thread start)
        assert "woken by the tenant itself" in exc.message
        slept = False
    waker.join(10)
    own.join(10)
    assert not waker.is_alive() and not own.is_alive(), "a wake waited for an awake state it had missed"
    assert None in woken and len(woken) == 2  # pool.wake() returned, raised nothing
    final = PoolState.ASLEEP_COLD if slept else PoolState.ACTIVE
    assert pool.wait_state(lambda state: state is final, 5)
    del pool.backend.map_pages
    pool.close()


def test_a_sleep_whose_pages_cannot_be_unmapped_is_refused_at_once_and_keeps_them(
    kvd: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = kvd.client()
    pool = client.register("a", SPEC, num_prefetch_pages=0, num_spare_pages=0)
    pool.quiesce_hook = lambda: None
    blocks = pool.alloc(2 * BLOCKS_PER_PAGE)
    written = fill(pool, blocks)

    def refused(addr: int, size_bytes: int) -> None:
        raise BackendError("munmap failed: out of memory (a test)")

    monkeypatch.setattr(pool.backend, "unmap", refused)
    with pytest.raises(Conflict):  # refused by the pool, not left to the daemon's sleep timeout
        client.sleep("a", "warm", timeout_s=5)
    monkeypatch.undo()
    assert pool.state is PoolState.ACTIVE and row(client)["state"] == "active"
    for before, after in zip(written, read(pool, blocks)):
        assert torch.equal(before, after)
    kvd.check_invariants()
    pool.close()
