"""Attention over the paged KV cache: ``store_kv`` writes new K/V, ``paged_attention`` reads it.

Layouts (the cache tensors are what ``KVPool.key_cache(layer)`` returns):

- cache ``[num_blocks, block_size, num_kv_heads, head_dim]``; token ``t`` of a
  sequence lives in block ``block_tables[s, t // block_size]`` at offset
  ``t % block_size``; its *slot* is ``block_id * block_size + offset``.
- a ragged batch of new tokens: ``query [total_q, num_heads, head_dim]`` with the
  tokens of sequence ``s`` at rows ``query_start_loc[s]:query_start_loc[s + 1]``;
  ``seq_lens[s]`` counts the whole context *including* those new tokens, whose K/V
  ``store_kv`` has already written. New token ``i`` of a sequence with ``q_len``
  new tokens sits at position ``seq_lens[s] - q_len + i`` and sees positions
  ``<=`` its own: decode is ``q_len == 1``, chunked prefill ``q_len > 1``.
- GQA: ``num_heads`` is a multiple of ``num_kv_heads``; query head ``h`` reads KV
  head ``h // (num_heads // num_kv_heads)``.

On CUDA tensors ``paged_attention`` runs the Triton kernel of
:mod:`kvdaemon.client.triton_attention` when ``triton`` imports (it is imported on
the first CUDA call, never before), else the torch implementation below, which
runs on any device. The torch path gathers each sequence's blocks with one
``index_select`` per chunk of sequences and runs one
``scaled_dot_product_attention`` per chunk: decode sequences are chunked together
(GQA folded into query rows, a key-padding mask only where lengths differ),
each prefill chunk runs alone with a bottom-right causal mask. Both accumulate in
fp32 for bf16/fp16 (SDPA's kernels and the Triton kernel do).
"""

from __future__ import annotations

import functools
import math
import threading
from types import ModuleType
from typing import Literal

import torch
import torch.nn.functional as F

from kvdaemon.errors import BadRequest

Impl = Literal["auto", "torch", "triton"]

DECODE_CHUNK_BYTES = 16 * 1024 * 1024
"""K+V bytes gathered per decode chunk: small enough to stay in a CPU's last-level
cache between the gather and the attention that reads it, large enough that the
Python cost per chunk (about ten torch calls) is noise."""

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)


# --- store_kv ----------------------------------------------------------------------


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key[t]`` / ``value[t]`` into slot ``slot_mapping[t]`` of the caches, in place.

    ``key``/``value``: ``[num_tokens, num_kv_heads, head_dim]``, cast to the cache
    dtype; ``slot_mapping``: ``[num_tokens]`` integers, ``block_id * block_size +
    offset``; a negative slot skips its token (padding). Slots must be distinct.
    Exactly the named slots change. Raises ``BadRequest`` on a shape, dtype or
    device mismatch and, off the Triton path, on a slot past the cache.
    Cost: one indexed write of ``num_tokens`` rows per cache.
    """
    _check_cache_pair(k_cache, v_cache)
    _, _, num_kv_heads, head_dim = k_cache.shape
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise BadRequest(f"{name} must be [num_tokens, {num_kv_heads}, {head_dim}], got {list(t.shape)}")
    if key.shape[0] != value.shape[0] or slot_mapping.shape != (key.shape[0],):
        raise BadRequest(
            f"key {list(key.shape)}, value {list(value.shape)} and slot_mapping "
            f"{list(slot_mapping.shape)} disagree on num_tokens"
        )
    _check_index(slot_mapping, "slot_mapping")
    _check_devices(k_cache, key=key, value=value, slot_mapping=slot_mapping)
    triton_ops = _triton_ops() if k_cache.is_cuda else None
    if triton_ops is not None:
        triton_ops.store_kv(key, value, k_cache, v_cache, slot_mapping)
        return
    _store_kv_torch(key, value, k_cache, v_cache, slot_mapping)


def _store_kv_torch(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """``store_kv`` with torch indexing: drop negative slots, check the rest, index_put_."""
    num_blocks, block_size = k_cache.shape[:2]
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    if slots.numel() == 0:
        return
    if int(slots.max()) >= num_blocks * block_size:
        raise BadRequest(f"slot {int(slots.max())} is past the cache's {num_blocks * block_size} slots")
    slots = slots.long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache.index_put_((blocks, offsets), key.to(k_cache.dtype))
    v_cache.index_put_((blocks, offsets), value.to(v_cache.dtype))


# --- paged_attention ------------------------------------------------------------------


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None = None,
    *,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Causal attention of a ragged batch of new tokens over the paged cache.

    Shapes: ``query [total_q, num_heads, head_dim]``, caches ``[num_blocks,
    block_size, num_kv_heads, head_dim]``, ``block_tables [batch,
    max_blocks_per_seq]``, ``seq_lens [batch]``, ``query_start_loc [batch + 1]``
    (integers, see the module docstring). Returns ``[total_q, num_heads,
    head_dim]`` in the query's dtype; ``scale`` defaults to ``head_dim ** -0.5``.
    ``impl`` picks the path: ``"auto"`` (Triton on CUDA when it imports), or
    ``"torch"`` / ``"triton"`` to force one (``"triton"`` needs CUDA tensors).

    Raises ``BadRequest`` on shape, dtype, device or GQA mismatches; the torch
    path also checks the index values (ragged offsets, lengths, block ids), the
    Triton path does not, to stay free of host syncs: an out-of-range block id
    there is a device fault. Cost: the torch path moves each sequence's K/V
    twice (gather, then attention) and keeps no state between calls.
    """
    _check_attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    if scale is None:
        scale = query.shape[-1] ** -0.5
    triton_ops = _pick_triton(query, impl)
    if triton_ops is not None:
        return triton_ops.paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
    return _paged_attention_torch(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)


def _pick_triton(query: torch.Tensor, impl: Impl) -> ModuleType | None:
    """The Triton module when ``impl`` and the device call for it, else ``None``."""
    if impl == "torch":
        return None
    if impl not in ("auto", "triton"):
        raise BadRequest(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    triton_ops = _triton_ops() if query.is_cuda else None
    if impl == "triton" and triton_ops is None:
        raise BadRequest("impl='triton' needs CUDA tensors and an importable triton")
    return triton_ops


@functools.cache
def _triton_ops() -> ModuleType | None:
    """``kvdaemon.client.triton_attention``, or ``None`` when triton does not import.

    Imported on the first CUDA call only; the answer is cached for the process.
    """
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    from kvdaemon.client import triton_attention

    return triton_attention


# --- the torch implementation -----------------------------------------------------------


def _paged_attention_torch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode sequences in chunks, then each prefill chunk alone; one host read of the offsets."""
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    _check_ragged(starts, lens, query.shape[0], block_tables.shape[1], k_cache.shape[1])
    out = torch.empty_like(query)
    q_lens = [starts[s + 1] - starts[s] for s in range(len(lens))]
    decode = sorted((s for s, n in enumerate(q_lens) if n == 1), key=lens.__getitem__)
    for chunk in _decode_chunks(decode, lens, 2 * k_cache[0, 0].numel() * k_cache.element_size()):
        rows = [starts[s] for s in chunk]
        o = _decode_one_chunk(_rows(query, rows), k_cache, v_cache, block_tables, chunk, lens, scale)
        _set_rows(out, rows, o)
    for s, q_len in enumerate(q_lens):
        if q_len > 1:
            rows = slice(starts[s], starts[s + 1])
            out[rows] = _prefill_one(query[rows], k_cache, v_cache, block_tables[s], lens[s], scale)
    return out


def _decode_chunks(seqs: list[int], lens: list[int], token_bytes: int) -> list[list[int]]:
    """Split ``seqs`` (sorted by length) into runs whose padded K+V fits ``DECODE_CHUNK_BYTES``.

    A run's padded size is its count times its last (longest) length; a sequence
    larger than the budget gets a run of its own.
    """
    chunks: list[list[int]] = []
    for s in seqs:
        if chunks and (len(chunks[-1]) + 1) * lens[s] * token_bytes <= DECODE_CHUNK_BYTES:
            chunks[-1].append(s)
        else:
            chunks.append([s])
    return chunks


def _decode_one_chunk(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seqs: list[int],
    all_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """``[n, num_heads, head_dim]`` attention of one new token for each of ``seqs`` (shortest first).

    Gathers ``n * ceil(longest / block_size)`` blocks of K and of V; the query
    heads of one KV head become the query rows of one SDPA head (no K/V repeat).
    Where lengths differ, positions past a sequence's end read a block of its own
    (never the table's padding), are zeroed (stale cache bytes may be NaN) and
    masked.
    """
    n, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    lens = [all_lens[s] for s in seqs]
    longest = lens[-1]
    table = _rows(block_tables, seqs)[:, : -(-longest // block_size)]
    mask = None
    if lens[0] != longest:
        lens_t = torch.tensor(lens, device=q.device)
        table = _pad_with_first_block(table, lens_t, block_size)
        mask = torch.arange(longest, device=q.device)[None, :] < lens_t[:, None]
    keys, values = _gather(k_cache, v_cache, table.reshape(-1), n, longest)
    if mask is not None:
        for t in (keys, values):
            t.transpose(1, 2)[~mask] = 0
        mask = mask.view(n, 1, 1, longest)
    group = num_heads // num_kv_heads
    q = q.reshape(n, num_kv_heads, group, head_dim)
    o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    return o.reshape(n, num_heads, head_dim)


def _pad_with_first_block(table: torch.Tensor, lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """``table`` with entries past each row's ``ceil(len / block_size)`` replaced by its first block."""
    needed = (lens + block_size - 1) // block_size
    columns = torch.arange(table.shape[1], device=table.device)
    return torch.where(columns[None, :] < needed[:, None], table, table[:, :1])


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``t[rows]``, as a view when ``rows`` is a run of consecutive indices."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return t[rows[0] : rows[0] + len(rows)]
    return t[rows]


def _set_rows(t: torch.Tensor, rows: list[int], value: torch.Tensor) -> None:
    """``t[rows] = value``, as a slice copy when ``rows`` is a run of consecutive indices."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        t[rows[0] : rows[0] + len(rows)] = value
    else:
        t[rows] = value


def _prefill_one(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, ctx: int, scale: float
) -> torch.Tensor:
    """``[q_len, num_heads, head_dim]`` attention of one sequence's new tokens over its ``ctx`` tokens.

    Bottom-right causal: with ``q_len == ctx`` SDPA's own causal mode, else a
    ``[q_len, ctx]`` bool mask. GQA by a stride-0 expand of the KV heads (no copy).
    """
    q_len, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    group = num_heads // num_kv_heads
    table = table[: -(-ctx // block_size)]
    keys, values = _gather(k_cache, v_cache, table, 1, ctx)  # [1, kv_heads, ctx, head_dim]
    shape = (num_kv_heads, group, ctx, head_dim)
    keys, values = keys[0, :, None].expand(shape), values[0, :, None].expand(shape)
    q = q.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    if q_len == ctx:
        o = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale)
    else:
        positions = torch.arange(ctx, device=q.device)
        mask = positions[None, :] <= positions[ctx - q_len :, None]
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    return o.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim)


def _gather(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor, n: int, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``n`` sequences whose blocks are ``block_ids`` (row-major, same count each).

    Returns two ``[n, num_kv_heads, length, head_dim]`` views (strided, last dim
    contiguous) of ``[len(block_ids), block_size, ...]`` copies, which on CPU live
    in this thread's reused buffers: valid until this thread's next gather. Raises
    ``BadRequest`` on a block id outside the cache.
    """
    lo, hi = torch.aminmax(block_ids)
    if int(lo) < 0 or int(hi) >= k_cache.shape[0]:
        raise BadRequest(f"block ids must lie in [0, {k_cache.shape[0]}), got [{int(lo)}, {int(hi)}]")
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    shape = (block_ids.numel(),) + tuple(k_cache.shape[1:])
    per_seq = block_ids.numel() // n * block_size
    views = []
    for which, cache in enumerate((k_cache, v_cache)):
        blocks = torch.index_select(cache, 0, block_ids, out=_BUFFERS.get(which, shape, cache))
        views.append(blocks.view(n, per_seq, num_kv_heads, head_dim)[:, :length].transpose(1, 2))
    return views[0], views[1]


class _GatherBuffers(threading.local):
    """Per-thread gather targets on CPU, reused across calls, grown to the largest asked.

    Fresh multi-MiB CPU tensors come from ``mmap`` and are paid for again in page
    faults on every call (that costs more than the copy); reusing two buffers
    (K, V) avoids it. They hold about ``DECODE_CHUNK_BYTES``, or one prefill
    sequence's K+V if larger, per thread that called ``paged_attention`` on CPU.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def get(self, which: int, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """An uninitialised ``shape`` tensor of ``like``'s dtype and device (fresh off CPU)."""
        if like.device.type != "cpu":
            return torch.empty(shape, dtype=like.dtype, device=like.device)
        numel = math.prod(shape)
        buffer = self.buffers.get((which, like.dtype))
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=like.dtype)
            self.buffers[(which, like.dtype)] = buffer
        return buffer[:numel].view(shape)


_BUFFERS = _GatherBuffers()


# --- validation -----------------------------------------------------------------------


def _check_attention_args(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    """Shapes, dtypes and devices of ``paged_attention``'s arguments (no host sync)."""
    _check_cache_pair(k_cache, v_cache)
    _, _, num_kv_heads, head_dim = k_cache.shape
    if query.dim() != 3 or query.shape[2] != head_dim:
        raise BadRequest(f"query must be [total_q, num_heads, {head_dim}], got {list(query.shape)}")
    if query.shape[1] % num_kv_heads:
        raise BadRequest(f"num_heads {query.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}")
    if query.dtype != k_cache.dtype:
        raise BadRequest(f"query dtype {query.dtype} differs from the cache's {k_cache.dtype}")
    if block_tables.dim() != 2 or seq_lens.dim() != 1 or query_start_loc.dim() != 1:
        raise BadRequest("block_tables must be 2-D, seq_lens and query_start_loc 1-D")
    batch = block_tables.shape[0]
    if seq_lens.shape[0] != batch or query_start_loc.shape[0] != batch + 1:
        raise BadRequest(
            f"batch sizes disagree: block_tables {batch}, seq_lens {seq_lens.shape[0]}, "
            f"query_start_loc {query_start_loc.shape[0]} (must be batch + 1)"
        )
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        _check_index(t, name)
    _check_devices(
        k_cache, query=query, block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc
    )


def _check_ragged(starts: list[int], lens: list[int], total_q: int, max_blocks: int, block_size: int) -> None:
    """Index values: offsets start at 0, grow, end at ``total_q``; each sequence fits its table."""
    if starts[0] != 0 or starts[-1] != total_q:
        raise BadRequest(f"query_start_loc must run from 0 to total_q={total_q}, got {starts[0]}..{starts[-1]}")
    for s, ctx in enumerate(lens):
        q_len = starts[s + 1] - starts[s]
        if q_len < 0 or q_len > ctx:
            raise BadRequest(f"sequence {s}: {q_len} new tokens with seq_len {ctx}")
        if math.ceil(ctx / block_size) > max_blocks:
            raise BadRequest(f"sequence {s}: seq_len {ctx} needs more than {max_blocks} blocks")


def _check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Both caches ``[num_blocks, block_size, num_kv_heads, head_dim]``, same shape, dtype, device."""
    if k_cache.dim() != 4:
        raise BadRequest(f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {list(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype or v_cache.device != k_cache.device:
        raise BadRequest(
            f"v_cache {list(v_cache.shape)} {v_cache.dtype} {v_cache.device} differs from "
            f"k_cache {list(k_cache.shape)} {k_cache.dtype} {k_cache.device}"
        )
    if k_cache.dtype not in _FLOAT_DTYPES:
        raise BadRequest(f"cache dtype {k_cache.dtype} is not one of {_FLOAT_DTYPES}")


def _check_index(t: torch.Tensor, name: str) -> None:
    if t.dtype not in _INDEX_DTYPES:
        raise BadRequest(f"{name} must be int32 or int64, got {t.dtype}")


def _check_devices(cache: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != cache.device:
            raise BadRequest(f"{name} is on {t.device}, the cache on {cache.device}")
