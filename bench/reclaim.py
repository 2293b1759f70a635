"""A 1 GiB grow served by reclaiming an idle tenant's spare pages, against the same grow from free pages.

Both grows run through a daemon process, by a "busy" pool (16 layers, 32
segments: 1 GiB is 16 logical pages) in this process:

- from free pages: the pool is empty and the daemon has 1 GiB free;
- by reclaim: an "idle" pool holds 1 GiB of spare pages (mapped, no live
  blocks) and the daemon has only one logical page (64 MiB) else free, so the
  busy grow waits while the daemon asks the idle pool for pages, the idle
  pool's agent returns them (all but its logical page 0, which a pool keeps
  while it lives), and the parked grow is served.

Target: reclaim grow <= 2x the free-page grow.  Run: ``python bench/reclaim.py``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from daemon_proc import daemon_process  # noqa: E402
from report import save, verdict  # noqa: E402

from kvdaemon.client import KVClient, KVPool, KVSpec  # noqa: E402

GiB = 1 << 30
TARGET = 2.0
SPEC = KVSpec(num_layers=16, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
BLOCKS_PER_GIB = GiB // (SPEC.block_bytes * SPEC.num_segments)


def timed_grow(client: KVClient, name: str) -> float:
    """Seconds for a new pool to allocate 1 GiB of blocks (the daemon maps them on demand)."""
    pool = client.register(name, SPEC, num_spare_pages=0, num_prefetch_pages=0)
    t0 = time.perf_counter()
    pool.alloc(BLOCKS_PER_GIB)
    elapsed = time.perf_counter() - t0
    pool.close()
    return elapsed


def idle_with_spare(client: KVClient) -> KVPool:
    """A pool holding 1 GiB of spare pages: mapped, every block free."""
    pool = client.register("idle", SPEC, num_spare_pages=64, num_prefetch_pages=0)
    pool.free(pool.alloc(BLOCKS_PER_GIB))
    return pool


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    free_s, reclaim_s = [], []
    with daemon_process("1088MiB") as client:  # 1 GiB + the idle pool's pinned logical page
        for r in range(args.rounds):
            free_s.append(timed_grow(client, f"free-{r}"))
            idle = idle_with_spare(client)
            reclaim_s.append(timed_grow(client, f"busy-{r}"))
            idle.close()
    free_ms, reclaim_ms = statistics.median(free_s) * 1e3, statistics.median(reclaim_s) * 1e3
    ratio = reclaim_ms / free_ms
    print(f"1 GiB grow served by reclaim:   {reclaim_ms:8.2f} ms  (idle tenant's spare pages)")
    print(f"1 GiB grow from free pages:     {free_ms:8.2f} ms  (baseline, same run)")
    print(f"ratio: {ratio:.2f}x   target <= {TARGET}x   {verdict(ratio, TARGET)}")
    path = save("reclaim", {"grow_bytes": GiB, "rounds": args.rounds,
                            "reclaim_ms": round(reclaim_ms, 2), "free_ms": round(free_ms, 2),
                            "ratio": round(ratio, 3), "target_ratio": TARGET})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
