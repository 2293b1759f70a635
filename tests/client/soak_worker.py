"""A tenant process for the soak test: random alloc / pattern-write / verify / free on a KVPool.

Run from the repository root::

    python -m tests.client.soak_worker DIR NAME --seed S --seconds T --max-bytes B

It registers ``NAME`` (``auto_wake``, ``grow_wait_s=0``) with a quiesce hook
that holds its loop between operations, as an engine's step lock does, so the
daemon may sleep it and move its pages across a restart. Every live block holds
a value unique to (block, generation) in K and V of every layer; each round
verifies a sample of live blocks and, every few rounds, all of them. A block
that reads anything else is a corruption. A cold loss (``num_block_losses``)
forgets the live set: those blocks are gone by contract.

Prints ``ready`` once registered, then one JSON line of counts on exit; exits 3
if any corruption was seen.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvdaemon.client import KVClient, KVPool, KVSpec
from kvdaemon.errors import DaemonUnreachable, KVDaemonError, PoolExhausted

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32)
EXIT_CORRUPT = 3
REGISTER_WAIT_S = 30.0


@dataclass
class Counts:
    ops: int = 0
    allocs: int = 0
    refusals: int = 0
    frees: int = 0
    verified: int = 0
    corruptions: int = 0
    losses: int = 0


class Worker:
    """One tenant's random workload (see the module docstring)."""

    def __init__(self, pool: KVPool, seed: int) -> None:
        self.pool = pool
        self.rng = random.Random(seed)
        self.step = threading.Lock()
        self.live: dict[int, float] = {}  # block -> the value written into it
        self.generation = 0
        self.losses_seen = 0
        self.counts = Counts()
        pool.quiesce_hook = self.step.acquire
        pool.resume_hook = self.step.release

    def run(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with self.step:
                self._one_op()
            time.sleep(self.rng.uniform(0.0, 0.01))  # engines idle between steps too
        with self.step:
            if not self.pool.state.asleep:
                self._verify(list(self.live))

    def _one_op(self) -> None:
        self.counts.ops += 1
        if self.pool.state.asleep:  # slept by reclaim between two ops: wake before reading
            try:
                self.pool.wake()
            except KVDaemonError:
                self.counts.refusals += 1
                return
        if self.pool.num_block_losses != self.losses_seen:  # a cold sleep or an empty restart
            self.losses_seen = self.pool.num_block_losses
            self.counts.losses += 1
            self.live.clear()
        roll = self.rng.random()
        if roll < 0.45 or not self.live:
            self._alloc(self.rng.randrange(1, 64))
        elif roll < 0.85:
            victims = self.rng.sample(list(self.live), self.rng.randrange(1, len(self.live) + 1))
            self.pool.free(victims)
            for block in victims:
                del self.live[block]
            self.counts.frees += len(victims)
        sample = self.live if self.counts.ops % 25 == 0 else self.rng.sample(list(self.live), min(8, len(self.live)))
        self._verify(list(sample))

    def _alloc(self, num_blocks: int) -> None:
        try:
            blocks = self.pool.alloc(num_blocks)
        except (PoolExhausted, KVDaemonError):
            self.counts.refusals += 1
            return
        self.counts.allocs += len(blocks)
        for block in blocks:
            self.generation += 1
            value = float(block * 4096 + self.generation % 4096)
            for layer in range(SPEC.num_layers):
                self.pool.key_cache(layer)[block].fill_(value)
                self.pool.value_cache(layer)[block].fill_(-value)
            self.live[block] = value

    def _verify(self, blocks: list[int]) -> None:
        for block in blocks:
            value = self.live[block]
            for layer in range(SPEC.num_layers):
                k, v = self.pool.key_cache(layer)[block], self.pool.value_cache(layer)[block]
                if not (bool((k == value).all()) and bool((v == -value).all())):
                    self.counts.corruptions += 1
                    print(json.dumps({"event": "corrupt", "block": block, "layer": layer}), flush=True)
                    break
            self.counts.verified += 1


def register(client: KVClient, name: str, max_bytes: int | None) -> KVPool:
    """Register ``name``, waiting out a daemon restart under way: a tenant still starting (torch
    imports slowly on a loaded 2-core machine) may first ask while the soak has the daemon killed,
    and a supervised engine would wait for it, not die. ``DaemonUnreachable`` after
    ``REGISTER_WAIT_S``."""
    deadline = time.monotonic() + REGISTER_WAIT_S
    while True:
        try:
            return client.register(name, SPEC, max_bytes=max_bytes, auto_wake=True, grow_wait_s=0,
                                   virtual_bytes=64 << 20)  # fmt: skip
        except DaemonUnreachable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir", type=Path)
    parser.add_argument("name")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--max-bytes", type=int, default=None)
    args = parser.parse_args()
    client = KVClient(args.dir, timeout_s=30.0)  # tenants starting at once on a small machine
    pool = register(client, args.name, args.max_bytes)
    worker = Worker(pool, args.seed)
    print(json.dumps({"event": "ready"}), flush=True)
    try:
        worker.run(args.seconds)
    finally:
        print(json.dumps({"event": "done", **asdict(worker.counts)}), flush=True)
        try:
            pool.close()
        except KVDaemonError:
            pass  # no daemon at the very end: the lease dies with us
        client.close()
    return EXIT_CORRUPT if worker.counts.corruptions else 0


if __name__ == "__main__":
    raise SystemExit(main())
