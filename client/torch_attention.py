"""The torch implementation of ``store_kv`` and ``paged_attention``: runs on any device.

Called by :mod:`kvdaemon.client.attention` after it checked shapes, dtypes and
devices; this module checks the index *values* (it reads them on the host
anyway): ragged offsets, lengths against the block table, block ids and slots
against the cache.

``paged_attention`` reads ``query_start_loc`` and ``seq_lens`` on the host once.
Decode sequences (one new token) on the CPU go to the fused kernel of
:mod:`kvdaemon.client.cpu_decode` where it can take them (it reads each block in
place: K/V move once); everything else gathers K/V blocks with
``index_select`` and runs ``scaled_dot_product_attention`` over them (fp32
accumulation for bf16/fp16, as SDPA's kernels do):

- decode sequences the kernel cannot take, sorted by length, in chunks of about
  ``DECODE_CHUNK_BYTES`` of K+V: one gather and one SDPA per chunk, the query
  heads of a KV head folded into the query rows of one SDPA head (no K/V
  repeat), a key-padding mask only where lengths differ;
- each prefill chunk alone, GQA by a stride-0 expand of the KV heads, with a
  bottom-right causal mask (SDPA's own causal mode when it covers the whole
  context).

Two options of transformers' attention interface are honoured, per call:

- ``sliding_window=w``: the token at position ``p`` sees keys ``p - w < k <= p``
  (``w`` keys, itself included), transformers' own mask. Masked by position: the
  whole context is still gathered, so a window saves no work here.
- ``softcap=c``: scores become ``c * tanh(scores / c)`` before the mask, as
  transformers' eager attention does (Gemma2). SDPA cannot do this, so these
  calls compute scores, softmax and output explicitly, in fp32.

Cost: the fused CPU decode moves K/V once, like SDPA over contiguous K/V
(``bench/attention.py``). The gather path moves them twice (the gather's copy,
then SDPA reading it): on CPU, where decode is memory-bound, about 2x SDPA's
time. On CPU the gather targets are per-thread buffers kept between calls (see
``_GatherBuffers``).
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F

from kvdaemon.client import cpu_decode
from kvdaemon.errors import BadRequest

DECODE_CHUNK_BYTES = 32 * 1024 * 1024
"""K+V bytes gathered per decode chunk (at least one sequence per chunk). It bounds
the gather buffers; on an idle 2-core CPU 16 MiB chunks and one chunk for the
whole batch ran equally fast, while many small chunks (many short parallel
regions) slowed down most when other processes took a core."""


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Drop negative slots, check the rest against the cache, write K and V (cast to the cache dtype)."""
    num_blocks, block_size = k_cache.shape[:2]
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    if slots.numel() == 0:
        return
    if int(slots.max()) >= num_blocks * block_size:
        raise BadRequest(f"slot {int(slots.max())} is past the cache's {num_blocks * block_size} slots")
    slots = slots.long()
    for cache, states in ((k_cache, key), (v_cache, value)):
        if cache.is_contiguous():  # slot-major rows: one index_copy_ (4-6x an index_put_ on CPU)
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, states.to(cache.dtype))
        else:
            cache.index_put_((slots // block_size, slots % block_size), states.to(cache.dtype))


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``[total_q, num_heads, head_dim]``: decode sequences in chunks, then each prefill chunk alone.

    ``sliding_window`` and ``softcap`` (validated by the caller) as in the module docstring.
    """
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    _check_ragged(starts, lens, query.shape[0], block_tables.shape[1], k_cache.shape[1])
    out = torch.empty_like(query)
    q_lens = [starts[s + 1] - starts[s] for s in range(len(lens))]
    decode = [s for s, n in enumerate(q_lens) if n == 1]
    if decode and cpu_decode.usable(query, k_cache, v_cache):
        rows = [starts[s] for s in decode]
        cpu_decode.attend(out, query, k_cache, v_cache, block_tables, seq_lens, decode, rows, scale,
                          sliding_window, softcap)
        decode = []
    decode.sort(key=lens.__getitem__)  # the torch path's chunks group similar lengths
    token_bytes = 2 * k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()  # K+V of one token
    for chunk in _decode_chunks(decode, lens, token_bytes):
        rows = [starts[s] for s in chunk]
        o = _decode_one_chunk(
            _rows(query, rows), k_cache, v_cache, block_tables, chunk, lens, scale, sliding_window, softcap
        )
        _set_rows(out, rows, o)
    for s, q_len in enumerate(q_lens):
        if q_len > 1:
            rows = slice(starts[s], starts[s + 1])
            out[rows] = _prefill_one(
                query[rows], k_cache, v_cache, block_tables[s], lens[s], scale, sliding_window, softcap
            )
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
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``[n, num_heads, head_dim]`` attention of one new token for each of ``seqs`` (shortest first).

    Gathers ``n * ceil(longest / block_size)`` blocks of K and of V; the query
    heads of one KV head become the query rows of one SDPA head (no K/V repeat).
    Where lengths differ, positions past a sequence's end read a block of its own
    (never the table's padding), are zeroed (stale cache bytes may be NaN) and
    masked; with a window that binds, positions before it are masked too.
    """
    n, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    lens = [all_lens[s] for s in seqs]
    longest = lens[-1]
    table = _rows(block_tables, seqs)[:, : -(-longest // block_size)]
    padded = lens[0] != longest
    windowed = sliding_window is not None and longest > sliding_window
    mask = None
    if padded or windowed:
        lens_t = torch.tensor(lens, device=q.device)[:, None]
        positions = torch.arange(longest, device=q.device)[None, :]
    if padded:
        table = _pad_with_first_block(table, lens_t[:, 0], block_size)
        mask = positions < lens_t
    keys, values = _gather(k_cache, v_cache, table.reshape(-1), n, longest)
    if mask is not None:
        for t in (keys, values):
            t.transpose(1, 2)[~mask] = 0
    if windowed:
        in_window = positions >= lens_t - sliding_window
        mask = in_window if mask is None else mask & in_window
    group = num_heads // num_kv_heads
    q = q.reshape(n, num_kv_heads, group, head_dim)
    o = _attend(q, keys, values, None if mask is None else mask.view(n, 1, 1, longest), scale, softcap)
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
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    ctx: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``[q_len, num_heads, head_dim]`` attention of one sequence's new tokens over its ``ctx`` tokens.

    Bottom-right causal (and windowed, when a window binds): with ``q_len == ctx``
    and no window SDPA's own causal mode, else a ``[q_len, ctx]`` bool mask. GQA by
    a stride-0 expand of the KV heads (no copy).
    """
    q_len, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    group = num_heads // num_kv_heads
    table = table[: -(-ctx // block_size)]
    keys, values = _gather(k_cache, v_cache, table, 1, ctx)  # [1, kv_heads, ctx, head_dim]
    shape = (num_kv_heads, group, ctx, head_dim)
    keys, values = keys[0, :, None].expand(shape), values[0, :, None].expand(shape)
    q = q.reshape(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    windowed = sliding_window is not None and ctx > sliding_window
    if q_len == ctx and not windowed:
        o = _attend(q, keys, values, None, scale, softcap, is_causal=True)
    else:
        key_pos = torch.arange(ctx, device=q.device)[None, :]
        query_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
        mask = key_pos <= query_pos
        if windowed:
            mask &= key_pos > query_pos - sliding_window
        o = _attend(q, keys, values, mask, scale, softcap)
    return o.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim)


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    is_causal: bool = False,
) -> torch.Tensor:
    """Softmax attention of ``q [..., q_len, d]`` over ``keys``/``values [..., ctx, d]``.

    ``mask`` (bool, broadcast to ``[..., q_len, ctx]``, True = attend) or
    ``is_causal`` (top-left, for ``q_len == ctx``). Without ``softcap``: SDPA.
    With it: explicit fp32 scores ``softcap * tanh(q k^T * scale / softcap)``,
    softmax and weighted sum, cast back to the query's dtype.
    """
    if softcap is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=is_causal, scale=scale)
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2))
    scores = torch.tanh(scores * (scale / softcap)) * softcap
    if is_causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), values.float()).to(q.dtype)


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
    Buffers made under ``torch.inference_mode`` (the engine's forwards) are
    inference tensors, which cannot be written outside it: each mode has its own.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[int, torch.dtype, bool], torch.Tensor] = {}

    def get(self, which: int, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """An uninitialised ``shape`` tensor of ``like``'s dtype and device (fresh off CPU)."""
        if like.device.type != "cpu":
            return torch.empty(shape, dtype=like.dtype, device=like.device)
        numel = math.prod(shape)
        key = (which, like.dtype, torch.is_inference_mode_enabled())
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=like.dtype)
            self.buffers[key] = buffer
        return buffer[:numel].view(shape)


_BUFFERS = _GatherBuffers()


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
