"""The Triton kernels' cases, run in a child with ``TRITON_INTERPRET=1`` (see ``test_triton_attention.py``).

Run from the repository root::

    TRITON_INTERPRET=1 python -m tests.client.triton_cases [CASE ...]

Triton reads ``TRITON_INTERPRET`` when its language module is first imported,
so the interpreter needs a process of its own: the test process may have
imported triton already. Each case launches a kernel on CPU tensors.
``paged_attention`` runs over the batches of ``tests/client/test_attention.py``
(ragged mixes of decode, chunked and full prefill, context 1, partial last
blocks, a sequence with no new tokens, ``-1`` past each table's end, every
unused cache slot NaN) and is compared with its fp32 SDPA reference per
sequence, also through strided query, caches and table. ``store_kv`` with
padded (``-1``) slots and strided K/V must write exactly the slots the torch
path writes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable

import torch

from kvdaemon.client import torch_attention

from tests import child_cases
from tests.client.test_attention import MIXED, PagedBatch, assert_close, make_batch

NUM_KV_HEADS = 2
DTYPES = {"float32": torch.float32, "float16": torch.float16}
DECODE = [(1, 1), (17, 1), (33, 1), (64, 1), (5, 1)]  # decode only: the kernel's other tile shape


def strided(batch: PagedBatch) -> PagedBatch:
    """The same batch through strided views: the query a head slice of a fused QKV tensor,
    the caches the two halves of one interleaved K/V buffer, the block table a transposed copy."""
    total_q, num_heads, head_dim = batch.query.shape
    num_kv_heads = batch.k_cache.shape[2]
    fused = torch.zeros(total_q, num_heads + 2 * num_kv_heads, head_dim, dtype=batch.query.dtype)
    fused[:, :num_heads] = batch.query
    both = torch.cat([batch.k_cache, batch.v_cache], dim=2)
    out = dataclasses.replace(batch, query=fused[:, :num_heads], k_cache=both[:, :, :num_kv_heads],
                              v_cache=both[:, :, num_kv_heads:],
                              block_tables=batch.block_tables.t().contiguous().t())
    for name in ("query", "k_cache", "block_tables"):
        assert not getattr(out, name).is_contiguous(), name
    return out


def attention_case(specs: list[tuple[int, int]], dtype: torch.dtype, head_dim: int, group: int,
                   block_size: int, *, make_strided: bool = False, index_dtype: torch.dtype = torch.int32,
                   seed: int = 0) -> None:
    batch = make_batch(specs, block_size=block_size, num_heads=NUM_KV_HEADS * group, num_kv_heads=NUM_KV_HEADS,
                       head_dim=head_dim, dtype=dtype, index_dtype=index_dtype, seed=seed)
    if make_strided:
        batch = strided(batch)
    assert_close(triton_attention.paged_attention(*batch.args(), head_dim ** -0.5), batch)


def store_kv_case(key_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    num_blocks, block_size, num_tokens = 6, 16, 21
    fused = torch.randn(num_tokens, 3 * NUM_KV_HEADS, head_dim, generator=gen).to(key_dtype)
    key, value = fused[:, :NUM_KV_HEADS], fused[:, NUM_KV_HEADS:2 * NUM_KV_HEADS]  # strided: a QKV split
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[0, 5, 20]] = -1  # padding: skipped
    k_cache = torch.randn(num_blocks, block_size, NUM_KV_HEADS, head_dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, NUM_KV_HEADS, head_dim, generator=gen).to(cache_dtype)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    torch_attention.store_kv(key, value, k_want, v_want, slots)
    assert not torch.equal(k_want, k_cache), "the reference wrote nothing"
    triton_attention.store_kv(key, value, k_cache, v_cache, slots.to(torch.int32))
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)


def empty_batch_case() -> None:
    batch = make_batch([(4, 1)], num_kv_heads=NUM_KV_HEADS, head_dim=64)
    out = triton_attention.paged_attention(batch.query[:0], batch.k_cache, batch.v_cache,
                                           batch.block_tables[:0], batch.seq_lens[:0],
                                           batch.query_start_loc[:1], 0.125)
    assert out.shape == (0, batch.query.shape[1], 64)
    cache = batch.k_cache.clone()
    empty = torch.empty(0, NUM_KV_HEADS, 64)
    triton_attention.store_kv(empty, empty, cache, cache, torch.empty(0, dtype=torch.int32))
    assert torch.equal(cache.nan_to_num(7.0), batch.k_cache.nan_to_num(7.0))


BF16_REASON = ("the Triton interpreter multiplies bf16 dot inputs as raw integers and truncates "
               "fp32->bf16 casts, so it cannot judge bf16 kernels; bench/gpu_check.py checks bf16 on a GPU")


def _cases() -> dict[str, Callable[[], None]]:
    cases: dict[str, Callable[[], None]] = {}
    for (name, dtype), head_dim, group, block in itertools.product(DTYPES.items(), (64, 80, 128), (1, 4, 8), (16, 32)):
        cases[f"mixed-{name}-d{head_dim}-gqa{group}-b{block}"] = functools.partial(
            attention_case, MIXED, dtype, head_dim, group, block)
        SKIPPED[f"mixed-bfloat16-d{head_dim}-gqa{group}-b{block}"] = BF16_REASON
    for (name, dtype), group, block in itertools.product(DTYPES.items(), (1, 8), (16, 32)):
        cases[f"decode-{name}-d128-gqa{group}-b{block}"] = functools.partial(
            attention_case, DECODE, dtype, 128, group, block, seed=1)
    for (name, dtype), index in itertools.product(DTYPES.items(), ("int32", "int64")):
        cases[f"strided-{name}-{index}"] = functools.partial(
            attention_case, MIXED, dtype, 80, 4, 16, make_strided=True, index_dtype=getattr(torch, index), seed=2)
    for (key, cache), head_dim in itertools.product(
        [("float32", "float32"), ("float16", "float16"), ("float32", "float16")], (64, 80, 128)
    ):
        cases[f"store_kv-{key}-into-{cache}-d{head_dim}"] = functools.partial(
            store_kv_case, DTYPES[key], DTYPES[cache], head_dim)
    cases["empty-batches"] = empty_batch_case
    return cases


SKIPPED: dict[str, str] = {}  # the matrix's cases this child cannot judge, with the reason
CASES = _cases()

if __name__ == "__main__":
    from kvdaemon.client import triton_attention

    child_cases.main(CASES)
