"""The headroom estimate against a real daemon (no vLLM needed)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvdaemon.client import KVClient, KVPool, KVSpec
from kvdaemon.integrations.vllm.headroom import Headroom, grantable_blocks

from tests.conftest import RunningDaemon, running_daemon

PAGE_BYTES = 64 * 1024
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="float32", layout="joint")
"""4 KiB blocks, 16 per page; a logical page is two 64 KiB pages."""


@pytest.fixture
def kvd() -> Iterator[RunningDaemon]:
    with running_daemon("2MiB", page_size_bytes=PAGE_BYTES) as running:  # 16 logical pages
        yield running


def register(kvd: RunningDaemon, name: str, **kwargs: object) -> tuple[KVClient, KVPool]:
    client = kvd.client()
    return client, client.register(name, SPEC, grow_wait_s=0, **kwargs)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_estimate_is_bounded_by_the_limit_and_by_free_pages(kvd: RunningDaemon) -> None:
    client, pool = register(kvd, "a", max_bytes=6 * 2 * PAGE_BYTES)
    assert grantable_blocks(pool, client.status()) == (6 * 16, True)  # the limit binds
    pool.alloc(20)  # two pages, one prefetched: three mapped
    assert grantable_blocks(pool, client.status()) == (3 * 16, True)
    other, hog = register(kvd, "hog", num_prefetch_pages=0)
    hog.alloc(12 * 16)  # 12 pages: 1 page left in the daemon
    assert grantable_blocks(pool, client.status()) == (16, True)  # the free pages bind
    hog.close()
    pool.alloc(pool.num_free_blocks + 3 * 16)  # up to the limit
    assert pool.mapped_bytes == 6 * 2 * PAGE_BYTES
    assert grantable_blocks(pool, client.status()) == (0, False)
    for closing in (pool, client, other):
        closing.close()


def test_a_refusal_stops_grows_until_the_next_refresh(kvd: RunningDaemon) -> None:
    client, pool = register(kvd, "a")
    clock = Clock()
    headroom = Headroom(pool, client, refresh_s=0.1, clock=clock)
    assert headroom.blocks() == 256 and headroom.may_grow()
    headroom.refused()
    assert headroom.blocks() == 0 and not headroom.may_grow()
    clock.now = 0.05
    assert not headroom.may_grow()
    clock.now = 0.1
    assert headroom.may_grow() and headroom.blocks() == 256
    pool.close()
    client.close()


def test_the_estimate_is_cached_between_refreshes(kvd: RunningDaemon) -> None:
    client, pool = register(kvd, "a")
    clock = Clock()
    headroom = Headroom(pool, client, refresh_s=0.1, clock=clock)
    assert headroom.blocks() == 256
    pool.alloc(1)  # maps two pages
    assert headroom.blocks() == 256  # not asked again yet
    headroom.expire()
    assert headroom.blocks() == 14 * 16
    pool.close()
    client.close()


def test_a_daemon_that_does_not_answer_grants_nothing(kvd: RunningDaemon) -> None:
    client, pool = register(kvd, "a")
    headroom = Headroom(pool, KVClient(kvd.dir / "nowhere", timeout_s=0.2))
    assert headroom.blocks() == 0 and not headroom.may_grow()
    pool.close()
    client.close()
