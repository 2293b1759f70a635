"""One mode's replay of a multi-tenant trace: three engines on a fresh daemon, stepped round-robin.

``replay(mode, ...)`` serves a trace (``traces.Arrival`` list) with one engine per
tenant over pools of one daemon process (host backend), as three engines
time-share one device: one driver thread adds each request at its arrival
time and steps the engines in turn. Modes:

- ``static``: each pool is capped at a third of the capacity
  (``max_bytes = min_bytes``) and maps its whole third before the trace starts;
- ``elastic``: the pools start empty and grow and shrink through the daemon;
- ``unbounded``: ``static`` on a daemon of three times the capacity (one per
  tenant: the bench's three), each tenant capped at (and mapped to) the whole
  capacity: memory never runs short and no page is mapped on the request
  path, so its TTFT estimates the floor the engines' compute sets, below which
  no memory policy for ``capacity_bytes`` can go but by noise (the reference
  that says how much of static's loss was memory's).

With ``cores`` the driver thread runs on those cores only while it serves
(``cores.pinned``; the bench gives it one core), and the control plane (the
daemon, the pools' agents and readers) on the others (``cores.control_plane_off``),
as an engine's threads are bound to their cores in a CPU deployment. Unpinned, a
driver that blocks (on the daemon, on the GIL an agent holds) may wake on the
other core with its caches cold, and elastic's driver blocks more often:
950-1,350 voluntary context switches per overload replay against static's
225-290, in a probe where its forward took 3-7% longer than static's for the
same steps and tokens (``RESULTS.md``). With the driver pinned and the control
plane left free, while another process loaded the machine, the control plane's
wake-ups landed on the driver's core and preempted its forward: 4,067
involuntary context switches in an elastic overload replay against static's 460
(on a quiet machine ~70 in either mode, pinned or not).

Each replay serves with the heap frozen (``kvdaemon.heap``), as a serving
process does after start-up: a full collection of the models' ~370,000 objects
(~170 ms) never lands in a forward, and every replay starts with the same
collector state whatever the replays before it allocated.

``summarize`` turns a run into TTFT mean/p99, output tokens/s over the
makespan, preemptions and the peak bytes each tenant's running requests held
(prefix-cache blocks no request uses are not counted: they are reclaimable).
``pooled`` merges repeats of one mode into one run: TTFTs of every request,
tokens over the summed makespans, preemptions summed, peaks the highest.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from cores import control_plane_off, pinned
from daemon_proc import daemon_process
from report import percentile_us
from traces import Arrival

from kvdaemon.client import KVClient, KVPool
from kvdaemon.client.spec import KVSpec
from kvdaemon.heap import frozen_heap
from kvdaemon.integrations.hf import Engine, Request, kv_spec_for

PAGE_BYTES = 64 * 1024
BLOCK = 16
SAMPLE_S = 0.1
REPLAY_MODES = ("static", "elastic", "unbounded")


def third_bytes(capacity_bytes: int, spec: KVSpec) -> int:
    """A static tenant's share: a third of the capacity, in whole logical pages."""
    logical_page = spec.num_segments * PAGE_BYTES
    return capacity_bytes // 3 // logical_page * logical_page


@dataclass
class ModeRun:
    """What one mode's replay produced."""

    mode: str
    requests: list[tuple[int, Request]] = field(default_factory=list)
    timeline: dict[str, Any] = field(default_factory=dict)
    makespan_s: float = 0.0
    preemptions: list[int] = field(default_factory=list)
    computed_tokens: list[int] = field(default_factory=list)  # tokens forwards computed (cache hits not)
    steps: list[int] = field(default_factory=list)
    peak_used_bytes: list[int] = field(default_factory=list)
    driver_cpu_s: float = 0.0  # CPU time of the driver thread while it served
    steal_s: float = 0.0  # time the hypervisor gave this VM's cores to others meanwhile (``host_steal_s``)


def host_steal_s() -> float:
    """Seconds of CPU the hypervisor has stolen from this machine since boot, all cores
    together (``/proc/stat``'s steal column); 0.0 where the kernel does not say. O(1)."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return 0.0
    if len(fields) < 9 or fields[0] != "cpu":
        return 0.0
    return int(fields[8]) / os.sysconf("SC_CLK_TCK")


def open_pool(client: KVClient, mode: str, tenant: int, spec: KVSpec, third_bytes: int) -> KVPool:
    """A tenant's pool: static maps its whole third now; elastic starts empty."""
    name = f"{mode}-{tenant}"
    if mode == "elastic":
        return client.register(name, spec)
    logical_page = spec.num_segments * PAGE_BYTES
    num_pages = third_bytes // logical_page
    pool = client.register(name, spec, max_bytes=third_bytes, min_bytes=third_bytes,
                           num_spare_pages=num_pages, num_prefetch_pages=0)
    pool.free(pool.alloc(num_pages * pool.blocks_per_page))  # mapped up front, kept as spare
    return pool


def replay(
    mode: str, models: list[Any], trace: list[Arrival], capacity_bytes: int, budget: int,
    cores: frozenset[int] | None = None,
) -> ModeRun:
    """Serve ``trace`` with three engines on a fresh daemon, the driver on ``cores`` (``pinned``)
    while it serves; timings on ``time.perf_counter``."""
    if mode not in REPLAY_MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(REPLAY_MODES)}")
    run = ModeRun(mode)
    spec = kv_spec_for(models[0], BLOCK)
    if mode == "unbounded":
        capacity_bytes *= 3  # a third of it each (``third_bytes``): the whole capacity per tenant
    third = third_bytes(capacity_bytes, spec)
    with daemon_process(str(capacity_bytes), "--page-size", str(PAGE_BYTES)) as client:
        pools = [open_pool(client, mode, i, spec, third) for i in range(len(models))]
        engines = [Engine(m, p, max_num_batched_tokens=budget) for m, p in zip(models, pools)]
        steal_before = host_steal_s()
        daemon_pid = client.hello()["pid"]
        with frozen_heap(), pinned(cores), control_plane_off(cores, daemon_pid):  # no collection mid-replay
            cpu_before = time.thread_time()
            t0 = _serve(run, engines, pools, trace)
            run.driver_cpu_s = time.thread_time() - cpu_before
        run.steal_s = host_steal_s() - steal_before
        run.makespan_s = max(r.finish_s for _, r in run.requests) - t0
        _sample(run, pools, time.perf_counter() - t0)
        run.preemptions = [e.num_preemptions for e in engines]
        run.computed_tokens = [e.num_computed_tokens for e in engines]
        run.steps = [e.num_steps for e in engines]
        for engine, pool in zip(engines, pools):
            engine.close()
            pool.close()
    return run


def _serve(run: ModeRun, engines: list[Engine], pools: list[KVPool], trace: list[Arrival]) -> float:
    """Add each request at its arrival time and step the engines in turn until all are served;
    return the start (``time.perf_counter``) arrival times count from."""
    run.timeline = {"t": [], "mapped": [[] for _ in pools]}
    run.peak_used_bytes = [0] * len(pools)
    pending = deque(trace)
    t0 = time.perf_counter()
    next_sample = 0.0
    while pending or any(e.has_unfinished for e in engines):
        now = time.perf_counter() - t0
        while pending and pending[0].time_s <= now:
            arrival = pending.popleft()
            request = engines[arrival.tenant].add_request(
                arrival.prompt_ids, arrival.max_new_tokens, arrival_s=t0 + arrival.time_s)
            run.requests.append((arrival.tenant, request))
        worked = False
        for engine in engines:
            engine.step()
            worked = worked or engine.last_num_scheduled_tokens > 0
        _note_peaks(run, engines, pools)
        if now >= next_sample:
            _sample(run, pools, now)
            next_sample = now + SAMPLE_S
        if not worked:
            idle = pending[0].time_s - now if pending else 0.002
            time.sleep(min(max(idle, 0.0), 0.005))
    return t0


def pooled(runs: list[ModeRun]) -> ModeRun:
    """Repeats of one mode as one run (the first one's timeline, for plots)."""
    merged = ModeRun(runs[0].mode, timeline=runs[0].timeline)
    merged.requests = [pair for run in runs for pair in run.requests]
    merged.makespan_s = sum(run.makespan_s for run in runs)
    merged.driver_cpu_s = sum(run.driver_cpu_s for run in runs)
    merged.steal_s = sum(run.steal_s for run in runs)
    for name in ("preemptions", "computed_tokens", "steps"):
        setattr(merged, name, [sum(column) for column in zip(*(getattr(run, name) for run in runs))])
    merged.peak_used_bytes = [max(column) for column in zip(*(run.peak_used_bytes for run in runs))]
    return merged


def _sample(run: ModeRun, pools: list[KVPool], now: float) -> None:
    """Mapped bytes per tenant, for the memory plot."""
    run.timeline["t"].append(now)
    for i, pool in enumerate(pools):
        run.timeline["mapped"][i].append(pool.mapped_bytes)


def _note_peaks(run: ModeRun, engines: list[Engine], pools: list[KVPool]) -> None:
    """The peak bytes of blocks live requests hold, per tenant (cached ones excluded)."""
    for i, (engine, pool) in enumerate(zip(engines, pools)):
        held = engine.manager.num_held_blocks * pool.spec.block_bytes * pool.spec.num_segments
        if held > run.peak_used_bytes[i]:
            run.peak_used_bytes[i] = held


def summarize(run: ModeRun, num_tenants: int) -> dict[str, Any]:
    """TTFT mean/p99 (s), tokens/s, preemptions: per tenant and overall."""
    def stats(requests: list[Request]) -> dict[str, float]:
        ttfts = [r.ttft_s for r in requests if r.ttft_s is not None]
        tokens = sum(r.num_output_tokens for r in requests)
        if not ttfts:  # a tenant a short trace gave no request: nothing to measure
            return {"requests": len(requests), "ttft_mean_s": math.nan, "ttft_p99_s": math.nan,
                    "tokens_per_s": tokens / run.makespan_s}
        return {"requests": len(requests), "ttft_mean_s": statistics.fmean(ttfts),
                "ttft_p99_s": percentile_us(ttfts, 99) / 1e6, "tokens_per_s": tokens / run.makespan_s}

    per_tenant = []
    for tenant in range(num_tenants):
        figures = stats([r for t, r in run.requests if t == tenant])
        figures["preemptions"] = run.preemptions[tenant]
        figures["peak_used_bytes"] = run.peak_used_bytes[tenant]
        per_tenant.append(figures)
    overall = stats([r for _, r in run.requests])
    overall["preemptions"] = sum(run.preemptions)
    overall["computed_tokens"] = sum(run.computed_tokens)
    overall["steps"] = sum(run.steps)
    overall["makespan_s"] = run.makespan_s
    overall["driver_cpu_s"] = run.driver_cpu_s
    overall["steal_s"] = run.steal_s
    return {"tenants": per_tenant, "overall": overall}


