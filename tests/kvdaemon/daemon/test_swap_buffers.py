"""The warm-sleep buffer cache: reuse by best fit, oldest out past the bound, idle ones trimmed."""

from __future__ import annotations

import errno
import mmap
import threading
from collections.abc import Iterator

import pytest

from kvdaemon.cuda_vmm import HostBackend
from kvdaemon.daemon import swap
from kvdaemon.daemon.copies import run_through
from kvdaemon.daemon.swap import BufferCache
from kvdaemon.errors import BackendError

from tests.conftest import PAGE_BYTES, wait_until

KiB = 1024


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def backend() -> Iterator[HostBackend]:
    host = HostBackend(num_pages=4, page_size_bytes=PAGE_BYTES)
    host.start()
    yield host
    host.close()


def test_a_buffer_given_back_serves_the_next_take_that_fits_best(backend: HostBackend) -> None:
    cache = BufferCache(1 << 20, backend)
    small, big = cache.take(64 * KiB), cache.take(256 * KiB)
    cache.give(big)
    cache.give(small)
    assert cache.take(48 * KiB) is small  # the smallest that holds it
    assert cache.take(100 * KiB) is not big  # 256 KiB is over twice 100: a new one, big stays
    assert cache.take(200 * KiB) is big
    assert cache.cached_bytes == 0


def test_past_its_bound_the_oldest_buffers_go(backend: HostBackend) -> None:
    cache = BufferCache(256 * KiB, backend)
    first, second, third = (cache.take(100 * KiB) for _ in range(3))
    for buffer in (first, second, third):
        cache.give(buffer)
    assert first.closed and not second.closed and not third.closed
    assert cache.cached_bytes == 200 * KiB
    huge = cache.take(512 * KiB)
    cache.give(huge)  # larger than the whole bound: closed, the rest kept
    assert huge.closed and cache.cached_bytes == 200 * KiB


def test_buffers_unused_for_a_while_are_trimmed(backend: HostBackend) -> None:
    clock = Clock()
    cache = BufferCache(1 << 20, backend, clock)
    old = cache.take(64 * KiB)
    cache.give(old)
    clock.now = BufferCache.KEEP_S / 2
    recent = cache.take(mmap.PAGESIZE * 4)
    cache.give(recent)
    assert cache.trim(BufferCache.KEEP_S) == 1 and cache.cached_bytes == len(recent)
    wait_until(lambda: old.closed, 5, "the trimmed buffer was not unmapped")  # on a thread of its own
    assert not recent.closed
    assert cache.trim(BufferCache.KEEP_S * 2) == 1 and cache.cached_bytes == 0
    wait_until(lambda: recent.closed, 5, "the trimmed buffer was not unmapped")


class GatedPopulate:
    """``host_copy.populate`` held until ``release``; it may fail instead."""

    def __init__(self, error: OSError | None = None) -> None:
        self.gate = threading.Event()
        self.error = error
        self.calls = 0

    def __call__(self, addr: int, size: int) -> bool:
        self.calls += 1
        self.gate.wait(10)
        if self.error is not None:
            raise self.error
        return True


def test_a_new_buffer_is_backed_off_the_loop_while_the_steps_wait(
    backend: HostBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    populate = GatedPopulate()
    monkeypatch.setattr(swap.host_copy, "populate", populate)
    steps = BufferCache(1 << 20, backend).take_steps(64 * KiB)
    for _ in range(3):
        next(steps)  # each step waits a little and gives the loop back
    assert populate.calls == 1
    populate.gate.set()
    buffer = run_through(steps)
    assert len(buffer) == 64 * KiB and not buffer.closed


def test_a_buffer_dropped_mid_backing_goes_back_once_its_thread_ends(
    backend: HostBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    populate = GatedPopulate()
    monkeypatch.setattr(swap.host_copy, "populate", populate)
    made: list[swap.Backing] = []
    real = swap.Backing
    monkeypatch.setattr(swap, "Backing", lambda *args: made.append(real(*args)) or made[-1])
    steps = BufferCache(1 << 20, backend).take_steps(64 * KiB)
    next(steps)
    (backing,) = made
    steps.close()  # a cancelled sleep: the thread still writes the buffer, so it stays open
    assert not backing.buffer.closed
    populate.gate.set()
    assert backing.wait(5) and backing.buffer.closed


def test_a_buffer_that_cannot_be_backed_fails_the_take(backend: HostBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    populate = GatedPopulate(OSError(errno.ENOMEM, "Cannot allocate memory"))
    populate.gate.set()
    monkeypatch.setattr(swap.host_copy, "populate", populate)
    with pytest.raises(OSError, match="Cannot allocate memory"):
        BufferCache(1 << 20, backend).take(64 * KiB)


def test_a_buffer_dropped_mid_backing_stops_being_backed(
    backend: HostBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    populate = GatedPopulate()
    monkeypatch.setattr(swap.host_copy, "populate", populate)
    monkeypatch.setattr(swap.Backing, "PIECE_BYTES", 16 * KiB)  # four pieces
    made: list[swap.Backing] = []
    real = swap.Backing
    monkeypatch.setattr(swap, "Backing", lambda *args: made.append(real(*args)) or made[-1])
    steps = BufferCache(1 << 20, backend).take_steps(64 * KiB)
    next(steps)  # the first piece is being backed
    steps.close()
    populate.gate.set()
    assert made[0].wait(5) and made[0].buffer.closed
    assert populate.calls == 1  # the three pieces left were never backed


def test_any_failure_of_the_backing_thread_fails_the_take(backend: HostBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    def cannot_start_a_thread(_addr: int, _size: int) -> bool:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(swap.host_copy, "populate", cannot_start_a_thread)
    with pytest.raises(BackendError, match="could not be made ready: RuntimeError: can't start new thread"):
        BufferCache(1 << 20, backend).take(64 * KiB)
