"""Round trips to the daemon on the data path (issue #14): a grow is one request, and
what the pool can serve itself (its own cached blocks, under its known limit) costs none."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvdaemon.client import KVPool, KVSpec
from kvdaemon.client.block_manager import BlockManager

from tests.conftest import PAGE_BYTES, RunningDaemon, running_daemon

SPEC = KVSpec(num_layers=1, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.float16)
BLOCKS_PER_PAGE = PAGE_BYTES // SPEC.block_bytes  # 64
TOKENS_PER_PAGE = BLOCKS_PER_PAGE * SPEC.block_size
LOGICAL = SPEC.num_segments * PAGE_BYTES


@pytest.fixture
def kvd() -> Iterator[RunningDaemon]:
    with running_daemon("64MiB") as running:
        yield running


def count_requests(pool: KVPool) -> Counter[str]:
    """Count the pool's page requests (grow, shrink) from here on."""
    counts: Counter[str] = Counter()
    lease = pool.lease
    real = lease._grant_call

    def counted(op: str, *args: Any, **kwargs: Any) -> Any:
        counts[op] += 1
        return real(op, *args, **kwargs)

    lease._grant_call = counted  # type: ignore[method-assign]
    return counts


def test_a_sequence_served_by_evicting_own_cached_blocks_makes_no_round_trip(kvd: RunningDaemon) -> None:
    client = kvd.client()
    pool = client.register("a", SPEC, max_bytes=5 * LOGICAL, num_spare_pages=8)
    manager = BlockManager(pool)
    manager.add_sequence("warm-up", list(range(4 * TOKENS_PER_PAGE + 1)))
    manager.free_sequence("warm-up")  # four pages of evictable cached blocks, five pages mapped
    assert pool.mapped_bytes == 5 * LOGICAL and manager.num_evictable_blocks == 4 * BLOCKS_PER_PAGE
    requests = count_requests(pool)
    manager.add_sequence("new", [7] * (3 * TOKENS_PER_PAGE))  # needs three pages
    assert requests == Counter(), "the pool asked the daemon for what its own cache could give"
    assert pool.mapped_bytes == 5 * LOGICAL
    pool.close()
    client.close()


def test_a_grow_for_several_pages_is_one_request_with_prefetch_when_it_fits(kvd: RunningDaemon) -> None:
    client = kvd.client()
    pool = client.register("a", SPEC, max_bytes=4 * LOGICAL, num_prefetch_pages=2, num_spare_pages=2)
    requests = count_requests(pool)
    pool.alloc(3 * BLOCKS_PER_PAGE)  # three pages; prefetch capped by the 4-page limit
    assert requests == Counter({"grow": 1})
    assert pool.mapped_bytes == 4 * LOGICAL
    pool.close()
    client.close()
