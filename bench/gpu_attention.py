"""GPU check of the attention ops: the Triton path against the torch path, and Triton decode bandwidth.

``gpu_attention_check()`` is meant for ``bench/gpu_check.py``'s list of checks; it
raises ``AssertionError`` (or a CUDA ``RuntimeError``) on failure and returns
flat figures otherwise. Standalone: ``python bench/gpu_attention.py``. The
kvdaemon imports happen inside the functions (``kvdaemon.client`` needs pyzmq).
Tolerances are absolute plus relative (``|a - b| <= atol + rtol * |b|``): one
bf16 step above 4 is 0.031, so bf16 needs a relative bound.

- correctness: ragged batches mixing decode and chunked prefill (prefixes ending
  mid-block, shuffled block ids) for fp32/bf16/fp16, block sizes 1/16/32 and
  GQA ratios 1/4/8, head_dim 64/80/128 (five combinations); ``store_kv`` with
  padding slots.
- bandwidth: bf16 decode, batch 64 x context 4096, 32 query / 8 KV heads of
  128 dims, block size 16 (1 GiB of K+V): K+V bytes over the Triton kernel's
  median time, next to SDPA over the same K/V made contiguous and to the torch
  path.

Cost: a few seconds of kernel compiles, at most about 4 GiB of device memory.
"""

from __future__ import annotations

import importlib.util
import math
import statistics
import sys
from collections.abc import Callable

import torch

Figures = dict[str, float | int | str | bool]

# (dtype, block_size, num_heads, num_kv_heads, head_dim)
CONFIGS = [
    (torch.float32, 16, 8, 2, 64),
    (torch.bfloat16, 16, 32, 4, 128),
    (torch.float16, 32, 4, 4, 128),
    (torch.bfloat16, 1, 16, 4, 64),
    (torch.bfloat16, 16, 64, 8, 80),
]
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (4e-3, 1e-2), torch.bfloat16: (1e-2, 2e-2)}  # atol, rtol
MIXED = [(37, 1), (300, 45), (16, 1), (1, 1), (130, 130), (20, 0), (1000, 1), (77, 9), (512, 1)]
BANDWIDTH_CASE = {"batch": 64, "context": 4096, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16}
REPEATS = 20


def random_batch(
    specs: list[tuple[int, int]], dtype: torch.dtype, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, ...]:
    """``(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)`` on CUDA, shuffled block ids.

    Unused table entries are ``-1``; cache contents are random (every slot finite).
    """
    needed = [math.ceil(ctx / block_size) for ctx, _ in specs]
    num_blocks = sum(needed) + 1
    cache = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache, device="cuda").to(dtype)
    v_cache = torch.randn(cache, device="cuda").to(dtype)
    ids = torch.randperm(num_blocks, device="cuda")
    block_tables = torch.full((len(specs), max(needed)), -1, dtype=torch.int32, device="cuda")
    first = 0
    for s, n in enumerate(needed):
        block_tables[s, :n] = ids[first : first + n]
        first += n
    starts = [0]
    for _, q_len in specs:
        starts.append(starts[-1] + q_len)
    query = torch.randn(starts[-1], num_heads, head_dim, device="cuda").to(dtype)
    seq_lens = torch.tensor([ctx for ctx, _ in specs], dtype=torch.int32, device="cuda")
    return query, k_cache, v_cache, block_tables, seq_lens, torch.tensor(starts, dtype=torch.int32, device="cuda")


def check_correctness() -> Figures:
    """Triton vs torch path per config; raises AssertionError past the dtype's tolerance."""
    from kvdaemon.client.attention import paged_attention

    figures: Figures = {}
    for dtype, block_size, heads, kv_heads, dim in CONFIGS:
        args = random_batch(MIXED, dtype, block_size, heads, kv_heads, dim)
        ours = paged_attention(*args, impl="triton").float()
        torch_path = paged_attention(*args, impl="torch").float()
        atol, rtol = TOLERANCE[dtype]
        excess = ((ours - torch_path).abs() - rtol * torch_path.abs()).max().item()
        name = f"{str(dtype).removeprefix('torch.')}_bs{block_size}_gqa{heads // kv_heads}_d{dim}"
        figures[f"max_err_{name}"] = float(f"{(ours - torch_path).abs().max().item():.3g}")
        if not excess <= atol:
            raise AssertionError(f"{name}: Triton differs from torch past atol {atol} + rtol {rtol} * |ref|")
    figures["store_kv_exact"] = check_store_kv()
    return figures


def check_store_kv() -> bool:
    """Triton store_kv writes what the torch path writes, skipping negative slots."""
    from kvdaemon.client import torch_attention
    from kvdaemon.client.attention import store_kv

    k_cache = torch.full((64, 16, 8, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    v_cache, expect_k, expect_v = k_cache.clone(), k_cache.clone(), k_cache.clone()
    key, value = torch.randn(300, 8, 128, device="cuda"), torch.randn(300, 8, 128, device="cuda")
    slots = torch.randperm(64 * 16, device="cuda")[:300]
    slots[::5] = -1
    store_kv(key, value, k_cache, v_cache, slots)
    torch_attention.store_kv(key, value, expect_k, expect_v, slots)
    same = torch.equal(k_cache.nan_to_num(7.0), expect_k.nan_to_num(7.0))
    same = same and torch.equal(v_cache.nan_to_num(7.0), expect_v.nan_to_num(7.0))
    if not same:
        raise AssertionError("Triton store_kv wrote different slots or values than the torch path")
    return True


def median_ms(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    """Median milliseconds of ``fn`` on the GPU (CUDA events), after three warm-up runs."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def check_bandwidth() -> Figures:
    """Decode over 1 GiB of bf16 K+V: Triton GB/s, and its time against SDPA and the torch path."""
    from kvdaemon.client.attention import paged_attention

    c = BANDWIDTH_CASE
    batch, ctx, heads, kv_heads, dim = c["batch"], c["context"], c["num_heads"], c["num_kv_heads"], c["head_dim"]
    args = random_batch([(ctx, 1)] * batch, torch.bfloat16, c["block_size"], heads, kv_heads, dim)
    query, k_cache, v_cache, block_tables = args[:4]
    kv_bytes = 2 * batch * ctx * kv_heads * dim * k_cache.element_size()
    triton_ms = median_ms(lambda: paged_attention(*args, impl="triton"))
    torch_ms = median_ms(lambda: paged_attention(*args, impl="torch"), repeats=5)
    rows = block_tables.long()
    k = k_cache[rows].view(batch, ctx, kv_heads, dim).transpose(1, 2).contiguous()
    v = v_cache[rows].view(batch, ctx, kv_heads, dim).transpose(1, 2).contiguous()
    q = query.view(batch, kv_heads, heads // kv_heads, dim)
    sdpa_ms = median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    torch.testing.assert_close(
        paged_attention(*args, impl="triton").view_as(q), torch.nn.functional.scaled_dot_product_attention(q, k, v),
        atol=2e-2, rtol=2e-2,
    )
    return {
        "decode_case": f"b{batch} ctx{ctx} h{heads}/{kv_heads} d{dim} bf16 bs{c['block_size']}",
        "decode_kv_gib": round(kv_bytes / 2**30, 3),
        "triton_decode_ms": round(triton_ms, 4),
        "triton_decode_gb_s": round(kv_bytes / triton_ms / 1e6, 1),
        "sdpa_contiguous_ms": round(sdpa_ms, 4),
        "sdpa_contiguous_gb_s": round(kv_bytes / sdpa_ms / 1e6, 1),
        "triton_vs_sdpa_ratio": round(triton_ms / sdpa_ms, 3),
        "torch_path_ms": round(torch_ms, 4),
    }


def gpu_attention_check() -> Figures:
    """Correctness of the Triton path against the torch path, then Triton decode bandwidth.

    Needs a CUDA GPU and triton; raises AssertionError when the Triton path is
    not used or disagrees with the torch path.
    """
    if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        raise AssertionError("the Triton attention path needs a CUDA GPU and an importable triton")
    return {**check_correctness(), **check_bandwidth()}


if __name__ == "__main__":
    for key, value in gpu_attention_check().items():
        print(f"{key:<36} {value}")
    sys.exit(0)
