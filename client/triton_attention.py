"""Triton kernels over the paged KV cache: ``store_kv`` and ragged paged attention.

Imported only by :mod:`kvdaemon.client.attention`, for CUDA tensors, once
``triton`` is known to import; callers go through that module, which checks
shapes, dtypes and devices first. Layouts and semantics are that module's.

``paged_attention`` is one launch for a ragged batch mixing decode and chunked
prefill, with no host sync: program ``(tile, kv_head)`` takes up to ``BLOCK_Q``
consecutive new tokens of one sequence and the ``GROUP`` query heads that share
``kv_head``, so each K/V tile is loaded once for ``BLOCK_Q * GROUP`` query rows.
Sequence ``s`` owns tiles ``query_start_loc[s] // BLOCK_Q + s`` onwards (enough for
its new tokens, and the grid ``total_q // BLOCK_Q + batch`` is known from shapes);
a program finds its sequence by binary search over ``query_start_loc`` and
tiles past a sequence's tokens do nothing. Keys stream in tiles of ``BLOCK_N``
tokens, each token's block looked up in the block table; scores and the
online-softmax state are fp32, the output is cast to the query dtype. fp32
inputs use IEEE fp32 dot products (no TF32). No split over the context: a
sequence's keys are read by ``num_kv_heads`` programs per tile of queries.

The kernels trust their indices (block ids, slots, offsets, lengths): a value
out of range is a device fault, not an error. Cost: K/V of every context token
read once per tile of queries (once in total for decode).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_NEG = tl.constexpr(-1.0e30)  # finite "minus infinity" for masked scores: never inf - inf = NaN


# --- store_kv -------------------------------------------------------------------------


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, block_size,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd, stride_vcb, stride_vcs, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_P2: tl.constexpr, DIM_P2: tl.constexpr,
):
    """One program per token: copy its ``[num_kv_heads, head_dim]`` K and V into its slot."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding
        return
    block = slot // block_size
    offset = slot % block_size
    h = tl.arange(0, HEADS_P2)[:, None]
    d = tl.arange(0, DIM_P2)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + h * stride_kch + d * stride_kcd
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + h * stride_vch + d * stride_vcd
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write token ``t``'s K/V into slot ``slot_mapping[t]`` (negative: skipped). One launch, no sync."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    num_kv_heads, head_dim = k_cache.shape[2:]
    with _on_device(key):
        _store_kv_kernel[(num_tokens,)](
            key, value, k_cache, v_cache, slot_mapping, k_cache.shape[1],
            *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
            NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
            HEADS_P2=triton.next_power_of_2(num_kv_heads), DIM_P2=triton.next_power_of_2(head_dim),
        )


# --- paged attention --------------------------------------------------------------------


@triton.jit
def _find_sequence(qsl_ptr, tile, num_seqs, search_steps, BLOCK_Q: tl.constexpr):
    """The largest ``s`` with ``query_start_loc[s] // BLOCK_Q + s <= tile`` (binary search)."""
    lo = tile * 0
    hi = lo + num_seqs - 1
    for _ in range(search_steps):
        mid = (lo + hi + 1) // 2
        first = tl.load(qsl_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        lo = tl.where(first <= tile, mid, lo)
        hi = tl.where(first <= tile, hi, mid - 1)
    return lo


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, seq_lens_ptr, qsl_ptr,
    qk_scale, num_seqs, search_steps,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bts, stride_btb,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program ``(tile, kv_head)``: up to ``BLOCK_Q`` new tokens x ``GROUP`` heads of one sequence."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(qsl_ptr, tile, num_seqs, search_steps, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq).to(tl.int32)
    q_len = tl.load(qsl_ptr + seq + 1).to(tl.int32) - q_start
    ctx = tl.load(seq_lens_ptr + seq).to(tl.int32)
    q_block = tile - (q_start // BLOCK_Q + seq)

    rows = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + rows // GROUP  # new-token index within the sequence
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    pos = ctx - q_len + tok  # position of each row's token; it sees keys <= pos
    dims = tl.arange(0, DIM_P2)
    dim_ok = dims < HEAD_DIM

    q_rows = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :] * stride_qd, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # Keys this tile needs: up to its last token's position; none for a tile past the tokens.
    kv_end = tl.where(q_block * BLOCK_Q < q_len, ctx - q_len + tl.minimum(q_len, (q_block + 1) * BLOCK_Q), 0)
    m_i = tl.full([BLOCK_M], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_P2], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bts
    for start in range(0, kv_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < kv_end
        block = tl.load(bt_row + (keys // BLOCK_SIZE) * stride_btb, mask=key_ok, other=0).to(tl.int64)
        offset = keys % BLOCK_SIZE
        k_base = block * stride_kb + offset * stride_ks + kv_head * stride_kh
        k_mask = key_ok[None, :] & dim_ok[:, None]
        k = tl.load(k_ptr + k_base[None, :] + dims[:, None] * stride_kd, mask=k_mask, other=0.0)  # [DIM_P2, BLOCK_N]
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        s = tl.where(key_ok[None, :] & (keys[None, :] <= pos[:, None]), s, _NEG)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_base = block * stride_vb + offset * stride_vs + kv_head * stride_vh
        v_mask = key_ok[:, None] & dim_ok[None, :]
        v = tl.load(v_ptr + v_base[:, None] + dims[None, :] * stride_vd, mask=v_mask, other=0.0)  # [BLOCK_N, DIM_P2]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh
    o_ptrs = o_ptr + o_rows[:, None] + dims[None, :] * stride_od
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``[total_q, num_heads, head_dim]`` causal attention over the paged cache; one launch, no sync.

    Tile sizes come from shapes alone: ``BLOCK_M = 16`` query rows when ``total_q
    == batch`` (decode-like), else 64, at least the GQA group; ``BLOCK_N = 64``
    keys, 32 where a row of K is over 256 bytes (fp32 past 64 dims), which keeps
    shared memory under 100 KiB.
    """
    total_q, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    batch = seq_lens.shape[0]
    out = torch.empty_like(query)
    if total_q == 0 or batch == 0:
        return out
    group = num_heads // num_kv_heads
    block_m = max(16 if total_q == batch else 64, triton.next_power_of_2(group))
    block_q = block_m // group
    dim_p2 = max(16, triton.next_power_of_2(head_dim))
    seq_lens, query_start_loc = seq_lens.contiguous(), query_start_loc.contiguous()
    grid = (total_q // block_q + batch, num_kv_heads)
    with _on_device(query):
        _paged_attention_kernel[grid](
            query, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
            scale * _LOG2E, batch, max(1, batch.bit_length()),
            *query.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), *block_tables.stride(),
            BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=head_dim, DIM_P2=dim_p2,
            BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=64 if dim_p2 * query.element_size() <= 256 else 32,
            PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        )
    return out


def _on_device(t: torch.Tensor) -> contextlib.AbstractContextManager[object]:
    """Make ``t``'s GPU current for a launch (a no-op off CUDA, e.g. under TRITON_INTERPRET)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
