"""Host memory for warm sleepers is bounded (``--warm-memory``): past it an asked warm sleep is
refused and the daemon's own sleeps go cold; sleeps under way count."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from kvdaemon.daemon import swap
from kvdaemon.wire.protocol import request
from kvdaemon.wire.sizes import bytes_of

from tests.kvdaemon.daemon.test_service import PAGE_BYTES, Harness, deferred, start_sleep
from tests.kvdaemon.daemon.test_service_policy import notices_to

HELD_BYTES = 4 * PAGE_BYTES  # two logical pages of two segments


@pytest.fixture
def h() -> Iterator[Harness]:
    harness = Harness(warm_memory=bytes_of(HELD_BYTES + PAGE_BYTES))  # room for one such sleeper
    yield harness
    harness.backend.close()


def holding(h: Harness, name: str, **extra: object) -> dict[str, object]:
    reg = h.register(name, **extra)
    h.ok("grow", **h.auth(name, reg["token"], logical_pages=[0, 1]))
    return reg


def test_a_warm_sleep_past_the_bound_is_refused_and_a_cold_one_is_not(h: Harness) -> None:
    a, b = holding(h, "a"), holding(h, "b")
    sleep_id = start_sleep(h, "a", "warm")
    h.ok("sleep_ready", **h.auth("a", a["token"], sleep_id=sleep_id))
    assert deferred(h)["result"]["host_bytes"] == HELD_BYTES
    reply = h.call("sleep", name="b", mode="warm")
    assert reply["error"]["code"] == "NO_MEMORY" and "--warm-memory" in reply["error"]["message"]
    row = next(t for t in h.ok("status")["tenants"] if t["name"] == "b")
    assert (row["state"], row["mapped_bytes"], row["sleep_pending"]) == ("active", HELD_BYTES, None)
    assert notices_to(h, b, "sleep") == []  # b was never asked to quiesce
    assert h.service.dispatch(b"admin", request(78, "sleep", {"name": "b", "mode": "cold"})) is None
    assert h.ok("status")["settings"]["warm_memory_bytes"] == HELD_BYTES + PAGE_BYTES


def test_a_warm_sleep_under_way_counts_against_the_bound(h: Harness) -> None:
    holding(h, "a"), holding(h, "b")
    start_sleep(h, "a", "warm")  # not quiesced yet: its pages may still come to host memory
    assert h.call("sleep", name="b", mode="warm")["error"]["code"] == "NO_MEMORY"


def test_the_daemons_own_warm_sleeps_go_cold_past_the_bound(h: Harness) -> None:
    h.service.config = type(h.service.config)(idle_sleep_s=60.0, idle_mode="warm")
    a, b = holding(h, "a", sleepable=True), holding(h, "b", sleepable=True)
    h.tick(61.0)  # both idle: the first sleeps warm, the second cold (no room left)
    modes = {name: notices_to(h, reg, "sleep")[-1]["mode"] for name, reg in (("a", a), ("b", b))}
    assert sorted(modes.values()) == ["cold", "warm"]


def sleep_warm(h: Harness, name: str, token: str) -> None:
    sleep_id = start_sleep(h, name, "warm")
    h.ok("sleep_ready", **h.auth(name, token, sleep_id=sleep_id))
    deferred(h)


def test_the_bound_counts_the_buffers_held_not_only_the_bytes_saved() -> None:
    """A reused buffer may be larger than its copy, and kept buffers are host memory too:
    what warm sleepers hold, with the cache, never passes the bound."""
    bound = 3 * HELD_BYTES // 2  # room for a's copy and one half its size
    h = Harness(warm_memory=bytes_of(bound))
    try:
        a = holding(h, "a")  # 2 logical pages
        sleep_warm(h, "a", a["token"])
        h.ok("wake", name="a")  # its buffer goes to the cache
        small = {}
        for name in ("b", "c", "d"):
            small[name] = h.register(name)
            h.ok("grow", **h.auth(name, small[name]["token"], logical_pages=[0]))  # half of a's
        sleep_warm(h, "b", small["b"]["token"])  # may reuse a's larger buffer
        sleep_warm(h, "c", small["c"]["token"])
        assert h.call("sleep", name="d", mode="warm")["error"]["code"] == "NO_MEMORY"
        held = h.service.sleeper.host_bytes_held() + h.service.sleeper.buffers.cached_bytes
        assert held <= bound
    finally:
        h.backend.close()


def test_the_host_memory_base_is_the_cgroup_limit_where_one_is_set(tmp_path: Path) -> None:
    ram = psutil.virtual_memory().total
    assert swap.host_memory_bytes(tmp_path) == ram  # no cgroup files: the machine's RAM
    (tmp_path / "memory.max").write_text("max\n")
    assert swap.host_memory_bytes(tmp_path) == ram
    (tmp_path / "memory.max").write_text(f"{1 << 30}\n")
    assert swap.host_memory_bytes(tmp_path) == min(ram, 1 << 30)
    (tmp_path / "memory.max").unlink()
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(f"{1 << 29}\n")  # cgroup v1
    assert swap.host_memory_bytes(tmp_path) == min(ram, 1 << 29)
