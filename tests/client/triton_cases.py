"""The Triton kernels' cases, run in a child with ``TRITON_INTERPRET=1`` (see ``test_triton_attention.py``).

Run from the repository root::

    TRITON_INTERPRET=1 python -m tests.client.triton_cases [CASE ...]

Triton reads ``TRITON_INTERPRET`` when its language module is first imported,
so the interpreter needs a process of its own: the test process may have
imported triton already. Each case launches a kernel on CPU tensors and
compares it with the torch path (``kvdaemon.client.torch_attention``) on fp32
copies of the same inputs: ``paged_attention`` over ragged batches mixing
decode, chunked and full prefill (context 1, partial last blocks, ``-1``
past each block table's end, strided query, caches and table), and
``store_kv`` with padded (``-1``) slots and strided K/V, which must write
exactly the slots the torch path writes.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvdaemon.client import torch_attention

from tests import child_cases

NUM_KV_HEADS = 2
TOLERANCE = {torch.float32: (2e-5, 1e-4), torch.float16: (4e-3, 1e-2)}  # (atol, rtol)
DTYPES = {"float32": torch.float32, "float16": torch.float16}

# (context length, new tokens) per sequence: context 1, partial and exact last blocks,
# chunked prefill (new tokens after a cached prefix) and full prefill, in one launch.
MIXED = [(1, 1), (37, 1), (50, 13), (20, 20), (64, 1), (9, 3)]
DECODE = [(1, 1), (17, 1), (33, 1), (64, 1), (5, 1)]


@dataclass
class Batch:
    """A ragged batch over a paged cache with shuffled blocks and -1 past each table's end."""

    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor


def make_batch(
    seqs: list[tuple[int, int]], dtype: torch.dtype, head_dim: int, group: int, block_size: int,
    *, strided: bool = False, index_dtype: torch.dtype = torch.int32, seed: int = 0,
) -> Batch:
    """Random K/V in every block (so a wrong block shows), blocks handed out in random order.

    ``strided``: the query is a head slice of a fused QKV tensor, the caches are the
    K half of an interleaved K/V buffer and the block table is a transposed view.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-ctx // block_size) for ctx, _ in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    if strided:
        both = torch.randn(num_blocks, block_size, 2 * NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
        k_cache, v_cache = both[:, :, :NUM_KV_HEADS], both[:, :, NUM_KV_HEADS:]
    else:
        k_cache = torch.randn(shape, generator=gen).to(dtype)
        v_cache = torch.randn(shape, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(seqs), max(blocks_per_seq) + 1), -1, dtype=index_dtype)
    start = 0
    for s, n in enumerate(blocks_per_seq):
        table[s, :n] = torch.tensor(order[start:start + n], dtype=index_dtype)
        start += n
    if strided:
        table = table.t().contiguous().t()
    num_heads = NUM_KV_HEADS * group
    total_q = sum(q for _, q in seqs)
    if strided:
        fused = torch.randn(total_q, num_heads + 2 * NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
        query = fused[:, :num_heads]
    else:
        query = torch.randn(total_q, num_heads, head_dim, generator=gen).to(dtype)
    starts = [0, *itertools.accumulate(q for _, q in seqs)]
    return Batch(query, k_cache, v_cache, table, torch.tensor([c for c, _ in seqs], dtype=index_dtype),
                 torch.tensor(starts, dtype=index_dtype))


def reference(batch: Batch) -> torch.Tensor:
    """The torch path on fp32 copies of the same inputs."""
    b = batch
    scale = b.query.shape[-1] ** -0.5
    table = torch.where(b.block_tables < 0, 0, b.block_tables)  # the torch path reads whole rows
    return torch_attention.paged_attention(b.query.float(), b.k_cache.float(), b.v_cache.float(), table,
                                           b.seq_lens, b.query_start_loc, scale)


def check_attention(batch: Batch) -> None:
    scale = batch.query.shape[-1] ** -0.5
    out = triton_attention.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.block_tables,
                                  batch.seq_lens, batch.query_start_loc, scale)
    assert out.dtype == batch.query.dtype and out.shape == batch.query.shape
    atol, rtol = TOLERANCE[batch.query.dtype]
    torch.testing.assert_close(out.float(), reference(batch), atol=atol, rtol=rtol)


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
    batch = make_batch([(4, 1)], torch.float32, 64, 1, 16)
    out = triton_attention.paged_attention(batch.query[:0], batch.k_cache, batch.v_cache,
                                           batch.block_tables[:0], batch.seq_lens[:0],
                                           batch.query_start_loc[:1], 0.125)
    assert out.shape == (0, NUM_KV_HEADS, 64)
    cache = batch.k_cache.clone()
    empty = torch.empty(0, NUM_KV_HEADS, 64)
    triton_attention.store_kv(empty, empty, cache, cache, torch.empty(0, dtype=torch.int32))
    assert torch.equal(cache, batch.k_cache)


BF16_REASON = ("the Triton interpreter multiplies bf16 dot inputs as raw integers and truncates "
               "fp32->bf16 casts, so it cannot judge bf16 kernels; bench/gpu_check.py checks bf16 on a GPU")


def _cases() -> dict[str, Callable[[], None]]:
    cases: dict[str, Callable[[], None]] = {}
    for (name, dtype), head_dim, group, block in itertools.product(DTYPES.items(), (64, 80, 128), (1, 4, 8), (16, 32)):
        cases[f"mixed-{name}-d{head_dim}-gqa{group}-b{block}"] = functools.partial(
            check_attention_of, MIXED, dtype, head_dim, group, block)
        SKIPPED[f"mixed-bfloat16-d{head_dim}-gqa{group}-b{block}"] = BF16_REASON
    for (name, dtype), group, block in itertools.product(DTYPES.items(), (1, 8), (16, 32)):
        cases[f"decode-{name}-d128-gqa{group}-b{block}"] = functools.partial(
            check_attention_of, DECODE, dtype, 128, group, block, seed=1)
    for (name, dtype), index in itertools.product(DTYPES.items(), ("int32", "int64")):
        cases[f"strided-{name}-{index}"] = functools.partial(
            check_attention_of, MIXED, dtype, 80, 4, 16, strided=True, index_dtype=getattr(torch, index), seed=2)
    for (key, cache), head_dim in itertools.product(
        [("float32", "float32"), ("float16", "float16"), ("float32", "float16")], (64, 80, 128)
    ):
        cases[f"store_kv-{key}-into-{cache}-d{head_dim}"] = functools.partial(
            store_kv_case, DTYPES[key], DTYPES[cache], head_dim)
    cases["empty-batches"] = empty_batch_case
    return cases


def check_attention_of(seqs: list[tuple[int, int]], dtype: torch.dtype, head_dim: int, group: int,
                       block_size: int, **kwargs: object) -> None:
    batch = make_batch(seqs, dtype, head_dim, group, block_size, **kwargs)  # type: ignore[arg-type]
    if kwargs.get("strided"):
        assert not batch.query.is_contiguous() and not batch.k_cache.is_contiguous()
        assert not batch.block_tables.is_contiguous()
    check_attention(batch)


SKIPPED: dict[str, str] = {}  # the matrix's cases this child cannot judge, with the reason
CASES = _cases()

if __name__ == "__main__":
    from kvdaemon.client import triton_attention

    child_cases.main(CASES)
