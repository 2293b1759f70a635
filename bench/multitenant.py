"""Three engines on one daemon: static thirds against one elastic pool, on the same bursty traces.

Three tiny Llama models (4 layers, 8 query / 4 KV heads of 32, fp32, random
weights, one seed each) are three tenants of one daemon process (host
backend). One driver thread replays a seeded bursty trace (``traces.py``:
each tenant peaks in its own window) and steps the three engines round-robin,
as three engines time-share one device. Both modes replay the same trace,
each on a fresh daemon of the same capacity:

- static: each tenant's pool is capped at a third of the capacity
  (``max_bytes = min_bytes``) and maps its whole third before the trace starts;
- elastic: the pools start empty and grow and shrink through the daemon
  (grows do not wait; idle tenants give back spare and cache-only pages when
  asked).

The capacity is sized so that a tenant's peak needs more than a third of it.
Reported per tenant and overall: TTFT mean and p99, output tokens/s over the
makespan, preemptions, and the peak bytes held by a tenant's running requests
(prefix-cache blocks no request uses are not counted: they are reclaimable).
Targets: elastic TTFT p99 <= 0.5x static, throughput >= 0.95x static.
Plots: ``bench/results/multitenant_memory.png`` (stacked memory per tenant
over time, both modes), ``bench/results/multitenant_ttft.png`` (TTFT CDFs).

Run: ``python bench/multitenant.py [--seed 0] [--scale 1.0]`` (needs the
``bench`` extra for the plots; about 2-3 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from daemon_proc import daemon_process  # noqa: E402
from engine import build_model  # noqa: E402
from plots import machine_caption, memory_plot, model_caption, ttft_plot  # noqa: E402
from report import RESULTS_DIR, percentile_us, save, verdict  # noqa: E402
from traces import Arrival, TraceShape, bursty_trace  # noqa: E402

from kvdaemon.client import KVClient, KVPool  # noqa: E402
from kvdaemon.client.local_pool import LocalPool  # noqa: E402
from kvdaemon.client.spec import KVSpec  # noqa: E402
from kvdaemon.integrations.hf import Engine, Request, kv_spec_for  # noqa: E402

MiB = 1 << 20
PAGE_BYTES = 64 * 1024
BLOCK = 16
TTFT_TARGET = 0.5
THROUGHPUT_TARGET = 0.95
SAMPLE_S = 0.1


@dataclass
class ModeRun:
    """What one mode's replay produced."""

    mode: str
    requests: list[tuple[int, Request]] = field(default_factory=list)
    timeline: dict[str, Any] = field(default_factory=dict)
    makespan_s: float = 0.0
    preemptions: list[int] = field(default_factory=list)
    peak_used_bytes: list[int] = field(default_factory=list)


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


def replay(mode: str, models: list[Any], trace: list[Arrival], capacity_bytes: int, budget: int) -> ModeRun:
    """Serve ``trace`` with three engines on a fresh daemon; timings on ``time.perf_counter``."""
    run = ModeRun(mode)
    spec = kv_spec_for(models[0], BLOCK)
    third = capacity_bytes // 3 // (spec.num_segments * PAGE_BYTES) * (spec.num_segments * PAGE_BYTES)
    with daemon_process(str(capacity_bytes), "--page-size", str(PAGE_BYTES)) as client:
        pools = [open_pool(client, mode, i, spec, third) for i in range(len(models))]
        engines = [Engine(m, p, max_num_batched_tokens=budget) for m, p in zip(models, pools)]
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
            if now >= next_sample:
                _sample(run, engines, pools, now)
                next_sample = now + SAMPLE_S
            if not worked:
                idle = pending[0].time_s - now if pending else 0.002
                time.sleep(min(max(idle, 0.0), 0.005))
        run.makespan_s = max(r.finish_s for _, r in run.requests) - t0
        _sample(run, engines, pools, time.perf_counter() - t0)
        run.preemptions = [e.num_preemptions for e in engines]
        for engine, pool in zip(engines, pools):
            engine.close()
            pool.close()
    return run


def _sample(run: ModeRun, engines: list[Engine], pools: list[KVPool], now: float) -> None:
    """Mapped bytes per tenant, and the peak bytes of blocks live requests hold (cached ones excluded)."""
    run.timeline["t"].append(now)
    for i, (engine, pool) in enumerate(zip(engines, pools)):
        run.timeline["mapped"][i].append(pool.mapped_bytes)
        held = engine.manager.num_held_blocks * pool.spec.block_bytes * pool.spec.num_segments
        run.peak_used_bytes[i] = max(run.peak_used_bytes[i], held)


def summarize(run: ModeRun, num_tenants: int) -> dict[str, Any]:
    """TTFT mean/p99 (s), tokens/s, preemptions: per tenant and overall."""
    def stats(requests: list[Request]) -> dict[str, float]:
        ttfts = [r.ttft_s for r in requests if r.ttft_s is not None]
        tokens = sum(r.num_output_tokens for r in requests)
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
    overall["makespan_s"] = run.makespan_s
    return {"tenants": per_tenant, "overall": overall}


def print_table(results: dict[str, dict[str, Any]], third_bytes: int) -> None:
    print(f"{'mode':8} {'tenant':>7} {'reqs':>5} {'TTFT mean':>10} {'TTFT p99':>9} {'tok/s':>7} "
          f"{'preempt':>8} {'peak live':>10}")
    for mode, summary in results.items():
        for i, row in enumerate(summary["tenants"]):
            print(f"{mode:8} {i:>7} {row['requests']:>5} {row['ttft_mean_s']:>9.3f}s {row['ttft_p99_s']:>8.3f}s "
                  f"{row['tokens_per_s']:>7.0f} {row['preemptions']:>8} {row['peak_used_bytes'] / MiB:>7.1f}MiB")
        row = summary["overall"]
        print(f"{mode:8} {'all':>7} {row['requests']:>5} {row['ttft_mean_s']:>9.3f}s {row['ttft_p99_s']:>8.3f}s "
              f"{row['tokens_per_s']:>7.0f} {row['preemptions']:>8}   makespan {row['makespan_s']:.1f}s")
    print(f"(a static third is {third_bytes / MiB:.1f} MiB)")


def warm_up(models: list[Any]) -> None:
    """One short generation per model, so first-call costs stay out of both modes."""
    for model in models:
        engine = Engine(model, LocalPool(kv_spec_for(model, BLOCK), 64))
        engine.generate([[5] * 100, [7] * 30], 4)
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--capacity-mib", type=int, default=36)
    parser.add_argument("--budget", type=int, default=512, help="max tokens per engine step")
    parser.add_argument("--scale", type=float, default=1.0, help="stretch every trace time by this factor")
    opts = parser.parse_args()
    shape = TraceShape(ramp_s=3.0 * opts.scale, hold_s=6.0 * opts.scale, lead_s=2.0 * opts.scale)
    trace = bursty_trace(shape, opts.seed)
    models = [build_model(seed) for seed in range(shape.num_tenants)]
    warm_up(models)
    capacity = opts.capacity_mib * MiB
    spec = kv_spec_for(models[0], BLOCK)
    third = capacity // 3 // (spec.num_segments * PAGE_BYTES) * (spec.num_segments * PAGE_BYTES)
    print(f"trace: {len(trace)} requests over {shape.duration_s:.0f} s (seed {opts.seed}); capacity "
          f"{opts.capacity_mib} MiB, page {PAGE_BYTES // 1024} KiB, torch threads {torch.get_num_threads()}")
    runs = {mode: replay(mode, models, trace, capacity, opts.budget) for mode in ("static", "elastic")}
    results = {mode: summarize(run, shape.num_tenants) for mode, run in runs.items()}
    print_table(results, third)
    static, elastic = results["static"]["overall"], results["elastic"]["overall"]
    ttft_ratio = elastic["ttft_p99_s"] / static["ttft_p99_s"]
    tput_ratio = elastic["tokens_per_s"] / static["tokens_per_s"]
    mean_ratio = elastic["ttft_mean_s"] / static["ttft_mean_s"]
    print(f"elastic/static TTFT p99 {ttft_ratio:.3f}x  target <= {TTFT_TARGET}x  {verdict(ttft_ratio, TTFT_TARGET)}")
    print(f"elastic/static TTFT mean {mean_ratio:.3f}x")
    print(f"elastic/static throughput {tput_ratio:.3f}x  target >= {THROUGHPUT_TARGET}x  "
          f"{verdict(tput_ratio, THROUGHPUT_TARGET, lower_is_better=False)}")
    peak_over = max(t["peak_used_bytes"] for t in results["elastic"]["tenants"]) / third
    print(f"largest elastic tenant peak of live KV: {peak_over:.2f}x a static third")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    caption = f"{machine_caption()} · {model_caption(models[0].config, len(models))} · seed {opts.seed}"
    memory_plot(RESULTS_DIR / "multitenant_memory.png", {m: r.timeline for m, r in runs.items()}, capacity,
                caption)
    ttft_plot(RESULTS_DIR / "multitenant_ttft.png",
              {m: [r.ttft_s for _, r in run.requests if r.ttft_s is not None] for m, run in runs.items()},
              caption)
    print(f"plots: {RESULTS_DIR / 'multitenant_memory.png'}, {RESULTS_DIR / 'multitenant_ttft.png'}")
    save("multitenant", {"seed": opts.seed, "capacity_bytes": capacity, "third_bytes": third,
                         "num_requests": len(trace), "results": results, "ttft_p99_ratio": ttft_ratio,
                         "ttft_mean_ratio": mean_ratio, "throughput_ratio": tput_ratio,
                         "peak_over_third": peak_over,
                         "timelines": {m: r.timeline for m, r in runs.items()}})


if __name__ == "__main__":
    main()
