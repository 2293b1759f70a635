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
- options (transformers' names): ``sliding_window=w`` lets the token at position
  ``p`` see only keys ``p - w < k <= p``; ``softcap=c`` caps scores as
  ``c * tanh(scores / c)`` before the softmax (Gemma2).

Dispatch: on CUDA tensors (fp32, bf16, fp16) both ops run the Triton kernels of
:mod:`kvdaemon.client.triton_attention` when ``triton`` imports (it is imported on
the first CUDA call, never before); everywhere else they run
:mod:`kvdaemon.client.torch_attention`. Both accumulate in fp32 for bf16/fp16.
A call with a sliding window or a softcap runs the torch path: ``"auto"`` picks
it, ``impl="triton"`` is refused (the kernels implement neither).
This module checks shapes, dtypes and devices (never a host sync); the torch
path also checks index values, the Triton path trusts them.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Literal

import torch

from kvdaemon.client import torch_attention
from kvdaemon.errors import BadRequest

Impl = Literal["auto", "torch", "triton"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
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

    ``key``/``value``: ``[num_tokens, num_kv_heads, head_dim]`` of a real floating
    dtype, cast to the cache dtype; ``slot_mapping``: ``[num_tokens]`` integers,
    ``block_id * block_size + offset``; a negative slot skips its token (padding).
    Exactly the named slots change. Slots should be distinct: a slot named twice
    is not refused (that check would cost a pass over the slots); what it then
    holds is unspecified among the K/V of the tokens naming it (torch's indexed
    writes and the Triton kernel do not order duplicates; on CUDA even a mix of
    those rows, and K and V from different tokens). The write records no
    autograd history, whatever ``key``/``value`` require: the caches never
    require grad. Raises ``BadRequest`` for an argument that is not a tensor,
    on a shape, dtype or device mismatch and, off the Triton path, on a slot
    past the cache.
    Cost: one indexed write of ``num_tokens`` rows per cache.
    """
    _check_tensors(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    _check_cache_pair(k_cache, v_cache)
    _, _, num_kv_heads, head_dim = k_cache.shape
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise BadRequest(f"{name} must be [num_tokens, {num_kv_heads}, {head_dim}], got {list(t.shape)}")
        if not t.dtype.is_floating_point:  # complex and integer K/V would be cast silently (complex: lossy)
            raise BadRequest(f"{name} must be a real floating dtype (cast to the cache's {k_cache.dtype}), "
                             f"got {t.dtype}")
    if key.shape[0] != value.shape[0] or slot_mapping.shape != (key.shape[0],):
        raise BadRequest(
            f"key {list(key.shape)}, value {list(value.shape)} and slot_mapping "
            f"{list(slot_mapping.shape)} disagree on num_tokens"
        )
    _check_index(slot_mapping, "slot_mapping")
    _check_devices(k_cache, key=key, value=value, slot_mapping=slot_mapping)
    triton_ops = _triton_ops() if k_cache.is_cuda and k_cache.dtype in _TRITON_DTYPES else None
    store = torch_attention.store_kv if triton_ops is None else triton_ops.store_kv
    if torch.is_grad_enabled():  # an in-place write of K/V that require grad would make the caches require it
        with torch.no_grad():
            store(key, value, k_cache, v_cache, slot_mapping)
    else:
        store(key, value, k_cache, v_cache, slot_mapping)


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
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of a ragged batch of new tokens over the paged cache.

    Shapes: ``query [total_q, num_heads, head_dim]``, caches ``[num_blocks,
    block_size, num_kv_heads, head_dim]``, ``block_tables [batch,
    max_blocks_per_seq]``, ``seq_lens [batch]``, ``query_start_loc [batch + 1]``
    (integers, see the module docstring). Returns ``[total_q, num_heads,
    head_dim]`` in the query's dtype; ``scale`` defaults to ``head_dim ** -0.5``.
    ``impl`` picks the path: ``"auto"`` (Triton on CUDA when it imports), or
    ``"torch"`` / ``"triton"`` to force one (``"triton"`` needs CUDA tensors).
    ``sliding_window`` (a positive int) and ``softcap`` (a positive float), see
    the module docstring; either one means the torch path.

    It computes no gradients: with grad enabled, a query or cache that requires
    grad is ``BadRequest`` (call it under ``torch.no_grad()`` or
    ``torch.inference_mode()``); the output never requires grad.

    Raises ``BadRequest`` for an argument that is not a tensor, on shape, dtype,
    device or GQA mismatches; the torch path also checks the index values
    (ragged offsets, lengths, block ids), the Triton path does not, to stay
    free of host syncs: an out-of-range block id
    there is a device fault. Cost: the Triton path reads each context's K/V once
    per tile of new tokens; the torch path copies it once more (see
    :mod:`kvdaemon.client.torch_attention`).
    """
    _check_attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    _check_options(sliding_window, softcap)
    if scale is None:
        scale = query.shape[-1] ** -0.5
    plain = sliding_window is None and softcap is None
    triton_ops = _pick_triton(query, impl, plain)
    if triton_ops is not None:
        return triton_ops.paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
    return torch_attention.paged_attention(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window, softcap
    )


def _pick_triton(query: torch.Tensor, impl: Impl, plain: bool = True) -> ModuleType | None:
    """The Triton module when ``impl``, the device and the options call for it, else ``None``.

    ``plain``: no sliding window and no softcap (the only attention the kernels compute).
    """
    if impl == "torch":
        return None
    if impl not in ("auto", "triton"):
        raise BadRequest(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    if not plain:
        if impl == "triton":
            raise BadRequest(
                "impl='triton' computes neither a sliding window nor a softcap; use impl='torch' "
                "(or 'auto', which picks it for such calls)"
            )
        return None
    triton_ops = _triton_ops() if query.is_cuda and query.dtype in _TRITON_DTYPES else None
    if impl == "triton" and triton_ops is None:
        raise BadRequest(f"impl='triton' needs CUDA tensors of one of {_TRITON_DTYPES} and an importable triton")
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


# --- validation -----------------------------------------------------------------------


def _check_attention_args(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    """Types, shapes, dtypes, devices and grad of ``paged_attention``'s arguments (no host sync)."""
    _check_tensors(query=query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                   seq_lens=seq_lens, query_start_loc=query_start_loc)
    _check_no_grad(query=query, k_cache=k_cache, v_cache=v_cache)
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


def _check_options(sliding_window: int | None, softcap: float | None) -> None:
    """``sliding_window`` a positive int, ``softcap`` a positive finite number, or ``None``."""
    if sliding_window is not None and (
        isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window <= 0
    ):
        raise BadRequest(f"sliding_window must be a positive integer or None, got {sliding_window!r}")
    if softcap is not None and (
        isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 < softcap < float("inf")
    ):
        raise BadRequest(f"softcap must be a positive number or None, got {softcap!r}")


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


def _check_tensors(**tensors: object) -> None:
    """Every argument a ``torch.Tensor``; else ``BadRequest`` naming the first that is not."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise BadRequest(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _check_no_grad(**tensors: torch.Tensor) -> None:
    """``BadRequest`` when grad is enabled and one of ``tensors`` requires it: the kernels record
    no autograd history (the fused decode writes its output in place), so a gradient would be wrong."""
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if t.requires_grad:
            raise BadRequest(
                f"paged_attention computes no gradients, but {name} requires grad: call it under "
                "torch.no_grad() or torch.inference_mode() (or pass a detached tensor)"
            )


def _check_index(t: torch.Tensor, name: str) -> None:
    if t.dtype not in _INDEX_DTYPES:
        raise BadRequest(f"{name} must be int32 or int64, got {t.dtype}")


def _check_devices(cache: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != cache.device:
            raise BadRequest(f"{name} is on {t.device}, the cache on {cache.device}")
