"""Grows and returns larger than one handle frame: split into frames, nothing lost or leaked."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvdaemon.client import KVClient
from kvdaemon.client.pool_state import PoolState
from kvdaemon.wire.handles import max_grant_pages
from kvdaemon.wire.messages import MAX_WAKE_PAGES

from tests.conftest import RunningDaemon, running_daemon, small_spec, wait_until

SPEC = small_spec()  # one 4 KiB block per segment: with 4 KiB pages, one block per logical page


@pytest.fixture
def kvd() -> Iterator[RunningDaemon]:
    with running_daemon("256MiB", page_size_bytes=4096) as running:
        yield running


def mapped(client: KVClient, name: str) -> int:
    return next(t["mapped_bytes"] for t in client.status()["tenants"] if t["name"] == name)


def test_a_grow_of_many_frames_keeps_every_byte_and_both_sides_agree(kvd: RunningDaemon) -> None:
    client = kvd.client()
    pool = client.register("big", SPEC, num_spare_pages=0, num_prefetch_pages=0)
    first = pool.alloc(1000)
    pool.key_cache(0)[first] = 3.0
    num_more = 8 * max_grant_pages(SPEC.num_segments) + 17  # eight frames' worth and a bit
    more = pool.alloc(num_more)
    assert len(more) == num_more and pool.state is PoolState.ACTIVE
    assert float(pool.key_cache(0)[first].float().min()) == 3.0, "the first blocks lost their bytes"
    assert pool.num_block_losses == 0
    assert mapped(client, "big") == pool.mapped_bytes
    kvd.check_invariants()
    pool.free(first + more)  # every page but page 0 goes back, in frames of a bounded size
    wait_until(lambda: mapped(client, "big") == pool.mapped_bytes == pool.core.logical_page_bytes, 30,
               "the pages did not all go back")
    kvd.check_invariants()
    pool.close()


def test_a_warm_wake_larger_than_a_notice_frame_maps_every_page_back(kvd: RunningDaemon) -> None:
    """The wake names its logical pages in several notices; the pool maps once they add up."""
    client = kvd.client()
    pool = client.register("big", SPEC, num_spare_pages=0, num_prefetch_pages=0)
    num_blocks = 2 * MAX_WAKE_PAGES + 100  # one block a logical page: three wake notices
    blocks = pool.alloc(num_blocks)
    pool.key_cache(0)[blocks] = 5.0
    assert pool.sleep("warm")["state"] == "sleeping-warm"
    assert pool.wait_state(lambda state: state is PoolState.ASLEEP_WARM, 10)
    pool.wake()
    assert pool.state is PoolState.ACTIVE and pool.num_block_losses == 0
    assert float(pool.key_cache(0)[blocks].float().min()) == 5.0, "a page came back without its bytes"
    assert mapped(client, "big") == pool.mapped_bytes == num_blocks * pool.core.logical_page_bytes
    kvd.check_invariants()
    pool.close()
