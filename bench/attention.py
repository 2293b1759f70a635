"""Torch ``paged_attention`` decode against SDPA over contiguous K/V, on CPU.

Each case is a decode step (one new token per sequence, all of one context
length) of a TinyLlama-shaped layer (32 query heads, 4 KV heads, 64 dims) over
a cache of 16-token blocks at shuffled ids. The baseline is
``scaled_dot_product_attention`` over the same K/V already contiguous as
``[batch, kv_heads, context, dim]``, called the fastest way measured: the query
heads of each KV head folded into query rows (``enable_gqa=True`` is slower on
CPU). Rounds alternate the two (and which goes first), so drift on a noisy
machine hits both alike; figures are medians. ``gather`` is the cost of the
``index_select`` of every block alone, for reading the ratio: the paged path
must move K/V once more than SDPA does.

Target: paged ≤ 1.5x SDPA in every case. Run: ``python bench/attention.py``
(fp32 and bf16 by default; about a minute and at most 1.5 GiB on two cores).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import save, verdict  # noqa: E402

from kvdaemon.client import cpu_decode  # noqa: E402
from kvdaemon.client.attention import paged_attention  # noqa: E402

TARGET_RATIO = 1.5
BATCHES = (8, 32, 64)
CONTEXTS = (512, 2048, 4096)
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 4, 64, 16


class Case:
    """One decode step: a paged cache with shuffled block ids and the same K/V contiguous."""

    def __init__(self, batch: int, context: int, dtype: torch.dtype, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.batch, self.context = batch, context
        blocks_per_seq = context // BLOCK_SIZE
        shape = (batch * blocks_per_seq, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.k_cache = torch.randn(shape, generator=gen).to(dtype)
        self.v_cache = torch.randn(shape, generator=gen).to(dtype)
        ids = torch.randperm(shape[0], generator=gen)
        self.block_tables = ids.view(batch, blocks_per_seq).to(torch.int32)
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32)
        self.query_start_loc = torch.arange(batch + 1, dtype=torch.int32)
        self.query = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
        self.k_contiguous = self._contiguous(self.k_cache)
        self.v_contiguous = self._contiguous(self.v_cache)
        self.k_gathered, self.v_gathered = torch.empty_like(self.k_cache), torch.empty_like(self.v_cache)

    def _contiguous(self, cache: torch.Tensor) -> torch.Tensor:
        """``[batch, kv_heads, context, dim]`` copy of each sequence's K or V."""
        rows = cache[self.block_tables.long()].view(self.batch, self.context, NUM_KV_HEADS, HEAD_DIM)
        return rows.transpose(1, 2).contiguous()

    def paged(self) -> torch.Tensor:
        return paged_attention(
            self.query, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.query_start_loc
        )

    def sdpa(self) -> torch.Tensor:
        q = self.query.view(self.batch, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, HEAD_DIM)
        return F.scaled_dot_product_attention(q, self.k_contiguous, self.v_contiguous)

    def gather(self) -> None:
        ids = self.block_tables.view(-1)
        torch.index_select(self.k_cache, 0, ids, out=self.k_gathered)
        torch.index_select(self.v_cache, 0, ids, out=self.v_gathered)

    def check(self) -> float:
        """Max abs difference of paged vs SDPA (they must agree before being timed)."""
        paged, sdpa = self.paged().reshape(self.batch, -1), self.sdpa().reshape(self.batch, -1)
        return (paged.float() - sdpa.float()).abs().max().item()


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_ms(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[len(ordered) // 2] * 1e3


def run_case(batch: int, context: int, dtype: torch.dtype, rounds: int) -> dict[str, object]:
    """Check one case, then time it ``rounds`` times, alternating which of paged and SDPA runs first."""
    case = Case(batch, context, dtype, seed=batch * 10_000 + context)
    err = case.check()
    if not err <= (1e-4 if dtype == torch.float32 else 2e-2):
        raise SystemExit(f"paged_attention disagrees with SDPA by {err} (b{batch} ctx{context})")
    samples: dict[str, list[float]] = {"paged": [], "sdpa": [], "gather": []}
    for r in range(rounds):
        for name in ("paged", "sdpa", "gather") if r % 2 else ("sdpa", "paged", "gather"):
            samples[name].append(timed(getattr(case, name)))
    paged_ms, sdpa_ms, gather_ms = (median_ms(samples[n]) for n in ("paged", "sdpa", "gather"))
    return {
        "dtype": str(dtype).removeprefix("torch."), "batch": batch, "context": context,
        "sdpa_ms": round(sdpa_ms, 3), "paged_ms": round(paged_ms, 3), "gather_ms": round(gather_ms, 3),
        "ratio": round(paged_ms / sdpa_ms, 3),
    }


def print_rows(rows: list[dict[str, object]]) -> None:
    print(f"{'dtype':<9}{'batch':>6}{'ctx':>6}{'sdpa ms':>10}{'paged ms':>10}{'gather ms':>11}{'ratio':>8}")
    for row in rows:
        print(f"{row['dtype']:<9}{row['batch']:>6}{row['context']:>6}{row['sdpa_ms']:>10.2f}"
              f"{row['paged_ms']:>10.2f}{row['gather_ms']:>11.2f}{row['ratio']:>7.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", action="append", choices=["float32", "bfloat16"],
                        help="repeatable; default: float32 and bfloat16")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    rows: list[dict[str, object]] = []
    for name in args.dtype or ["float32", "bfloat16"]:
        for batch in BATCHES:
            for context in CONTEXTS:
                rows.append(run_case(batch, context, getattr(torch, name), args.rounds))
    print_rows(rows)
    probe = Case(1, BLOCK_SIZE, torch.float32, seed=0)
    path = (f"C kernel, {cpu_decode.lanes()} lanes, bf16 as {cpu_decode.bf16_path()}"
            if cpu_decode.usable(probe.query, probe.k_cache, probe.v_cache) else "torch (gather + SDPA)")
    print(f"paged path: {path}")
    worst = max(rows, key=lambda row: float(row["ratio"]))  # type: ignore[arg-type]
    worst_ratio = float(worst["ratio"])  # type: ignore[arg-type]
    print(f"worst ratio: {worst_ratio:.2f}x ({worst['dtype']} b{worst['batch']} ctx{worst['context']})   "
          f"target <= {TARGET_RATIO}x   {verdict(worst_ratio, TARGET_RATIO)}")
    saved = save("attention", {
        "shape": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE},
        "threads": torch.get_num_threads(), "rounds": args.rounds, "paged_path": path, "cases": rows,
        "worst_ratio": worst_ratio, "target_ratio": TARGET_RATIO,
    })
    print(f"wrote {saved}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
