"""bench/cores.py: the driver on the forward's cores, the control plane on the others."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import cores  # noqa: E402
import multitenant  # noqa: E402

LINUX_AFFINITY = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="thread affinity is Linux's")
TWO_CORES = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs two cores to split"
)


def test_the_driver_is_pinned_to_the_forwards_cores_only_when_one_is_left_for_the_daemon(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: {4, 2, 7}, raising=False)
    assert cores.forward_cores(1) == {2}  # the lowest core this process may use
    assert cores.forward_cores(2) == {2, 4}
    assert cores.forward_cores(3) is None  # nothing left for the control plane: not pinned
    assert multitenant.options([]).no_pin is False and multitenant.options(["--no-pin"]).no_pin is True


@LINUX_AFFINITY
def test_pinned_holds_the_calling_thread_on_its_cores_for_the_block_only() -> None:
    before = os.sched_getaffinity(0)
    core = frozenset({min(before)})
    with cores.pinned(core):
        assert os.sched_getaffinity(0) == core
    assert os.sched_getaffinity(0) == before
    with pytest.raises(RuntimeError), cores.pinned(core):
        raise RuntimeError("a failed replay")
    assert os.sched_getaffinity(0) == before  # restored however the block ends
    with cores.pinned(None):
        assert os.sched_getaffinity(0) == before


@pytest.fixture
def agent() -> Iterator[threading.Thread]:
    """A Python thread standing in for a pool's agent, waiting until the test ends."""
    done = threading.Event()
    thread = threading.Thread(target=done.wait, name="agent", daemon=True)
    thread.start()
    yield thread
    done.set()
    thread.join(5)


@pytest.fixture
def daemon() -> Iterator[subprocess.Popen[bytes]]:
    """A child process standing in for the daemon."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait(10)


@LINUX_AFFINITY
def test_the_control_plane_is_the_daemons_threads_and_ours_but_the_callers(
    agent: threading.Thread, daemon: subprocess.Popen[bytes]
) -> None:
    found = cores.control_plane_threads(daemon.pid)
    assert agent.native_id in found
    assert daemon.pid in found  # a process's first thread has its pid
    assert threading.get_native_id() not in found
    assert daemon.pid not in cores.control_plane_threads(None)


@TWO_CORES
def test_the_control_plane_runs_off_the_forwards_cores_for_the_block_only(
    agent: threading.Thread, daemon: subprocess.Popen[bytes]
) -> None:
    allowed = os.sched_getaffinity(0)
    forward = frozenset({min(allowed)})
    agent_before = os.sched_getaffinity(agent.native_id)  # type: ignore[arg-type]
    with cores.control_plane_off(forward, daemon.pid):
        assert os.sched_getaffinity(agent.native_id) == allowed - forward  # type: ignore[arg-type]
        assert os.sched_getaffinity(daemon.pid) == allowed - forward
        assert os.sched_getaffinity(0) == allowed  # the caller stays where it was
    assert os.sched_getaffinity(agent.native_id) == agent_before  # type: ignore[arg-type]
    with cores.control_plane_off(None, daemon.pid):  # not pinned: nothing moves
        assert os.sched_getaffinity(agent.native_id) == agent_before  # type: ignore[arg-type]
    with cores.control_plane_off(frozenset(allowed), daemon.pid):  # no core left for it: nothing moves
        assert os.sched_getaffinity(agent.native_id) == agent_before  # type: ignore[arg-type]


@TWO_CORES
def test_a_thread_that_ends_in_the_block_is_skipped_on_the_way_out(daemon: subprocess.Popen[bytes]) -> None:
    done = threading.Event()
    thread = threading.Thread(target=done.wait, daemon=True)
    thread.start()
    forward = frozenset({min(os.sched_getaffinity(0))})
    with cores.control_plane_off(forward, daemon.pid):
        done.set()
        thread.join(5)
    assert not thread.is_alive()
