"""Block alloc+free throughput: KVPool against a plain free list and a BlockPool-style pool.

Each side repeatedly allocates a batch of blocks and frees it again, at batch
sizes 1, 16 and 256, and reports blocks per second (one alloc + one free of a
block counts once). The sides, all in one run:

- ``KVPool``: the real pool of a tenant of a real daemon process (the pages are
  mapped before timing; the lock and the page-aware allocator are included);
- ``list``: a plain Python list used as a stack of free ids (the floor);
- ``vllm``: vLLM's ``BlockPool`` when ``vllm`` imports; otherwise ``blockpool``,
  our own model of its design (``LinkedBlockPool``), labelled as such.

Target: KVPool at least as fast as vLLM's BlockPool at every batch size.
Run: ``python bench/alloc.py``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from daemon_proc import daemon_process  # noqa: E402
from report import save, verdict  # noqa: E402

from kvdaemon.client import KVPool, KVSpec  # noqa: E402

BATCHES = (1, 16, 256)
NUM_BLOCKS = 4096


class _Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "is_null", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.is_null = False
        self.prev: _Block | None = None
        self.next: _Block | None = None


class LinkedBlockPool:
    """A model of vLLM v1's BlockPool with prefix caching on (its default).

    What each call does follows vLLM's design: a block object per id with a
    ref count, an intrusive doubly linked free queue (``popleft_n`` /
    ``append_n``), a free-count check before allocating, a per-block check that
    evicts a cached hash, and a null-block filter on free. Written here from
    that description; vLLM itself is used instead whenever it imports.
    """

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [_Block(i) for i in range(num_blocks)]
        self.cached: dict[bytes, dict[int, _Block]] = {}
        self.head = _Block(-1)
        self.tail = _Block(-1)
        self.head.next, self.tail.prev = self.tail, self.head
        self.num_free = 0
        self._append_n(self.blocks)

    def _popleft_n(self, n: int) -> list[_Block]:
        out = []
        block = self.head.next
        for _ in range(n):
            assert block is not None
            out.append(block)
            block.prev, nxt = None, block.next
            block.next = None
            block = nxt
        assert block is not None
        self.head.next, block.prev = block, self.head
        self.num_free -= n
        return out

    def _append_n(self, blocks: list[_Block]) -> None:
        last = self.tail.prev
        assert last is not None
        for block in blocks:
            last.next, block.prev = block, last
            last = block
        last.next, self.tail.prev = self.tail, last
        self.num_free += len(blocks)

    def _maybe_evict_cached_block(self, block: _Block) -> None:
        if block.block_hash is not None and block.block_hash in self.cached:
            del self.cached[block.block_hash][block.block_id]
            block.block_hash = None

    def get_num_free_blocks(self) -> int:
        return self.num_free

    def get_new_blocks(self, n: int) -> list[_Block]:
        if n > self.get_num_free_blocks():
            raise ValueError(f"cannot get {n} free blocks")
        blocks = self._popleft_n(n)
        for block in blocks:
            self._maybe_evict_cached_block(block)
            block.ref_cnt += 1
        return blocks

    def free_blocks(self, ordered_blocks: list[_Block]) -> None:
        blocks = list(ordered_blocks)
        for block in blocks:
            block.ref_cnt -= 1
        self._append_n([b for b in blocks if b.ref_cnt == 0 and not b.is_null])


def vllm_side(num_blocks: int) -> tuple[str, Callable[[int], object], Callable[[object], None]]:
    """vLLM's BlockPool if it imports, else our model of it."""
    try:
        from vllm.v1.core.block_pool import BlockPool  # type: ignore[import-not-found]
    except ImportError:
        pool = LinkedBlockPool(num_blocks)
        return "blockpool", pool.get_new_blocks, pool.free_blocks
    real = BlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=16)
    return "vllm", real.get_new_blocks, real.free_blocks


def rate(alloc: Callable[[int], object], free: Callable[[object], None], batch: int,
         seconds: float) -> float:
    """Blocks per second of alloc(batch)+free over about ``seconds``."""
    num = 0
    t0 = time.perf_counter()
    deadline = t0 + seconds
    while time.perf_counter() < deadline:
        for _ in range(64):
            free(alloc(batch))
        num += 64 * batch
    return num / (time.perf_counter() - t0)


def list_side() -> tuple[Callable[[int], list[int]], Callable[[list[int]], None]]:
    free_ids = list(range(NUM_BLOCKS))

    def alloc(n: int) -> list[int]:
        out = free_ids[-n:]
        del free_ids[-n:]
        return out

    return alloc, free_ids.extend


def warm(pool: KVPool) -> None:
    """Map enough pages that timing never waits on the daemon."""
    pool.free(pool.alloc(max(BATCHES)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.5, help="per side and batch size")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    spec = KVSpec(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16)
    figures: dict[str, dict[str, float]] = {}
    with daemon_process("256MiB") as client:
        pool = client.register("bench", spec, num_spare_pages=4)
        warm(pool)
        ref_name, ref_alloc, ref_free = vllm_side(NUM_BLOCKS)
        list_alloc, list_free = list_side()
        sides = {"kvpool": (pool.alloc, pool.free), ref_name: (ref_alloc, ref_free),
                 "list": (list_alloc, list_free)}
        for batch in BATCHES:
            best = {name: 0.0 for name in sides}
            for _ in range(args.repeats):  # interleaved, best of: drift hits all sides
                for name, (alloc, free) in sides.items():
                    best[name] = max(best[name], rate(alloc, free, batch, args.seconds))
            figures[str(batch)] = best
        pool.close()
    print(f"{'batch':>6} {'kvpool':>12} {ref_name:>12} {'list':>12}   kvpool/{ref_name}")
    worst = float("inf")
    for batch, best in figures.items():
        ratio = best["kvpool"] / best[ref_name]
        worst = min(worst, ratio)
        print(f"{batch:>6} {best['kvpool'] / 1e6:9.2f} M/s {best[ref_name] / 1e6:9.2f} M/s "
              f"{best['list'] / 1e6:9.2f} M/s   {ratio:5.2f}x")
    print(f"worst kvpool/{ref_name}: {worst:.2f}x   target >= 1.0x   "
          f"{verdict(worst, 1.0, lower_is_better=False)}"
          + ("" if ref_name == "vllm" else "   (vllm not importable: our model of BlockPool)"))
    path = save("alloc", {"reference": ref_name, "blocks_per_second": figures,
                          "worst_ratio": round(worst, 3), "target_ratio": 1.0})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
