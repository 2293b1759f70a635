"""A wake in several notices from a daemon that breaks the protocol: the lease breaks, nothing
is mapped at a wrong page, and both sides end in one state (the pool re-registers, empty)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvdaemon.client import KVClient, KVPool
from kvdaemon.client.pool_state import PoolState
from kvdaemon.wire import messages
from kvdaemon.wire.messages import LimitNotice, WakeNotice

from tests.conftest import RunningDaemon, running_daemon, small_spec, wait_until

SPEC = small_spec()  # one 4 KiB block per segment: with 4 KiB pages, one block per logical page
HONEST_PARTS = WakeNotice.parts.__func__  # type: ignore[attr-defined]


@pytest.fixture
def kvd(monkeypatch: pytest.MonkeyPatch) -> Iterator[RunningDaemon]:
    monkeypatch.setattr(messages, "MAX_WAKE_PAGES", 4)  # a wake of 10 pages: three notices
    with running_daemon("64MiB", page_size_bytes=4096) as running:
        yield running


def asleep_with_written_blocks(client: KVClient) -> tuple[KVPool, list[int]]:
    pool = client.register("a", SPEC, num_spare_pages=0, num_prefetch_pages=0)
    blocks = pool.alloc(10)
    pool.key_cache(0)[blocks] = 5.0
    assert pool.sleep("warm")["state"] == "sleeping-warm"
    assert pool.wait_state(lambda state: state is PoolState.ASLEEP_WARM, 10)
    return pool, blocks


def daemon_sends(monkeypatch: pytest.MonkeyPatch, bend: Callable[[list[WakeNotice]], list]) -> None:
    """The daemon's wake sends ``bend(honest parts)`` instead (the client never calls ``parts``)."""
    monkeypatch.setattr(WakeNotice, "parts", classmethod(lambda cls, *args: bend(HONEST_PARTS(cls, *args))))


def test_a_wake_in_three_notices_maps_every_page_back(kvd: RunningDaemon) -> None:
    pool, blocks = asleep_with_written_blocks(kvd.client())
    pool.wake()
    assert pool.state is PoolState.ACTIVE and pool.num_block_losses == 0
    assert float(pool.key_cache(0)[blocks].float().min()) == 5.0
    kvd.check_invariants()
    pool.close()


@pytest.mark.parametrize("bend", [
    lambda parts: parts[::-1],  # out of order: mapped, every page would hold another page's bytes
    lambda parts: parts[:1] + parts[2:],  # a part lost
    lambda parts: parts[:1] + [LimitNotice(1 << 30, 0, 1.0, 9)] + parts[1:],  # another notice inside
])
def test_wake_parts_out_of_step_break_the_lease_and_the_pool_comes_back_empty(
    kvd: RunningDaemon, monkeypatch: pytest.MonkeyPatch, bend: Callable[[list[WakeNotice]], list]
) -> None:
    client = kvd.client()
    pool, _ = asleep_with_written_blocks(client)
    daemon_sends(monkeypatch, bend)
    client.call("wake", {"name": "a"})  # the daemon has it awake; the pool must not half-map it
    wait_until(lambda: pool.state is PoolState.ACTIVE and pool.num_block_losses == 1, 20,
               "the pool did not re-register after its lease broke")
    assert kvd.daemon.service.quarantine.held_bytes == 10 * pool.core.logical_page_bytes  # held, never re-granted
    assert pool.mapped_bytes == 0
    assert [(t["name"], t["mapped_bytes"]) for t in client.status()["tenants"]] == [("a", 0)]
    fresh = pool.alloc(3)
    assert float(pool.key_cache(0)[fresh].float().abs().max()) == 0.0, "a fresh block holds old bytes"
    kvd.check_invariants()
    pool.close()
