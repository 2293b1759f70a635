"""Which cores a replay's driver and its control plane run on.

The replay stands three engines' forwards in for an accelerator's: on a CPU
the forward's cores are the accelerator, and a CPU deployment binds an
engine's compute threads to them and leaves the rest of the machine to
everything else. ``forward_cores`` picks the driver's cores (the first ones
this process may use, when at least one is left); ``pinned`` holds the
calling thread on them; ``control_plane_off`` keeps the control plane (the
daemon process, the pools' agents and handle-channel readers, ZeroMQ's I/O
threads) on the cores left.

Why the second matters on a small, shared machine: a control-plane thread
that wakes (a notice, a reply, a heartbeat) is placed by the kernel on
whichever core it likes, the driver's too when the other is busy (another
process's work), and may preempt the forward there. Elastic's control plane
wakes more often than static's, so left free it slows elastic's forward most,
a cost of sharing two cores that a deployment with its forward on its own
cores (or on a GPU) does not pay. On a quiet machine it changes little.

Linux only (``os.sched_setaffinity``); elsewhere everything is left as it is.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

ZMQ_THREAD_PREFIX = "ZMQbg"  # the names libzmq gives its background threads


def forward_cores(num_threads: int) -> frozenset[int] | None:
    """The cores the driver thread serves on: the first ``num_threads`` this process may use,
    when that leaves at least one for the daemon and the agents; else None (not pinned). O(cores)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    return frozenset(allowed[:num_threads]) if num_threads < len(allowed) else None


@contextlib.contextmanager
def pinned(cores: frozenset[int] | None) -> Iterator[None]:
    """The calling thread on ``cores`` for the block, then back on the cores it had (None: as it is).
    Threads and processes it starts inside inherit the pin: start them before."""
    if not cores:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def control_plane_threads(daemon_pid: int | None) -> list[int]:
    """Thread ids of the control plane: every thread of process ``daemon_pid`` (None: none),
    and this process's Python threads but the caller's (the pools' agents and handle-channel
    readers) and libzmq's background threads. Not torch's compute threads. O(threads)."""
    me = threading.get_native_id()
    ours = {t.native_id for t in threading.enumerate()} - {me, None}
    for tid in _tasks("self"):
        if tid != me and _thread_name("self", tid).startswith(ZMQ_THREAD_PREFIX):
            ours.add(tid)
    daemon = _tasks(str(daemon_pid)) if daemon_pid is not None else []
    return sorted(ours) + daemon


@contextlib.contextmanager
def control_plane_off(cores: frozenset[int] | None, daemon_pid: int | None) -> Iterator[None]:
    """The control plane (``control_plane_threads``) on the cores this process may use but
    ``cores`` for the block; this process's threads back where they were after (the daemon's
    end with it). None, or no core left: as they are. A thread that ends meanwhile is skipped."""
    if not cores or not hasattr(os, "sched_setaffinity"):
        yield
        return
    rest = frozenset(os.sched_getaffinity(0)) - cores
    if not rest:
        yield
        return
    ours = set(_tasks("self"))
    before: dict[int, set[int]] = {}
    for tid in control_plane_threads(daemon_pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if tid in ours:
                before[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, rest)
    try:
        yield
    finally:
        for tid, cpus in before.items():
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(tid, cpus)


def _tasks(pid: str) -> list[int]:
    """The thread ids of process ``pid`` ("self": this one); [] if it is gone. O(threads)."""
    try:
        return sorted(int(name) for name in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return []


def _thread_name(pid: str, tid: int) -> str:
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as comm:
            return comm.read().strip()
    except OSError:
        return ""
