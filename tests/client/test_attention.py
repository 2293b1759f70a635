"""``paged_attention`` and ``store_kv`` against SDPA on contiguous K/V.

Every batch is written into a cache with shuffled block ids whose unused blocks,
unwritten tail slots and block-table padding (``-1``) would all poison the
output (NaN, or an index error) if read. The reference is
``scaled_dot_product_attention`` in fp32 over each sequence's contiguous K/V
(GQA by ``repeat_interleave``) with an explicit bottom-right causal mask.

The torch path runs here; the Triton path runs in the ``gpu`` tests (skipped
without CUDA and triton) and, where triton is installed, under its CPU
interpreter in a subprocess. Cost: about 10 s on two cores (plus 10 s for the
interpreter where triton is installed).
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvdaemon.client import torch_attention
from kvdaemon.client.attention import paged_attention, store_kv
from kvdaemon.errors import BadRequest

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA_TRITON = torch.cuda.is_available() and HAS_TRITON
REPO_ROOT = Path(__file__).resolve().parents[2]

# (context length including the new tokens, new tokens): decode ending mid-block
# and on a block boundary, a one-token context, chunked prefill over a prefix
# ending mid-block, whole prompts, and a sequence with no new tokens this step.
MIXED = [(37, 1), (100, 13), (16, 1), (1, 1), (33, 33), (20, 0), (64, 1), (50, 17), (5, 5), (70, 1)]
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


@dataclass
class PagedBatch:
    """A ragged batch written into a paged cache, plus its contiguous K/V for the reference."""

    specs: list[tuple[int, int]]
    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    keys: list[torch.Tensor]  # per sequence [ctx, num_kv_heads, head_dim]
    values: list[torch.Tensor]

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.query, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.query_start_loc)

    def to(self, device: str) -> PagedBatch:
        moved = {name: getattr(self, name).to(device) for name in
                 ("query", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc")}
        return PagedBatch(self.specs, keys=self.keys, values=self.values, **moved)


def make_batch(
    specs: list[tuple[int, int]],
    *,
    block_size: int = 16,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    dtype: torch.dtype = torch.float32,
    index_dtype: torch.dtype = torch.int32,
    seed: int = 0,
) -> PagedBatch:
    """Write ``specs`` (``(ctx, q_len)`` per sequence) into a NaN-filled cache at shuffled block ids."""
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(ctx / block_size) for ctx, _ in specs]
    num_blocks = sum(needed) + 3
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    v_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    block_tables = torch.full((len(specs), max(needed) + 1), -1, dtype=index_dtype)
    keys, values = [], []
    for s, (ctx, _) in enumerate(specs):
        block_tables[s, : needed[s]] = torch.tensor(ids[: needed[s]])
        ids = ids[needed[s]:]
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        pos = torch.arange(ctx)
        blocks = block_tables[s, pos // block_size].long()
        k_cache[blocks, pos % block_size] = k
        v_cache[blocks, pos % block_size] = v
        keys.append(k)
        values.append(v)
    starts = [0]
    for _, q_len in specs:
        starts.append(starts[-1] + q_len)
    query = torch.randn(starts[-1], num_heads, head_dim, generator=gen).to(dtype)
    return PagedBatch(
        specs, query, k_cache, v_cache, block_tables,
        torch.tensor([ctx for ctx, _ in specs], dtype=index_dtype),
        torch.tensor(starts, dtype=index_dtype), keys, values,
    )


def reference(batch: PagedBatch, scale: float | None = None) -> torch.Tensor:
    """fp32 SDPA per sequence over contiguous K/V, bottom-right causal; ``[total_q, heads, dim]``."""
    group = batch.query.shape[1] // batch.k_cache.shape[2]
    outs, start = [], 0
    for (ctx, q_len), k, v in zip(batch.specs, batch.keys, batch.values):
        q = batch.query[start : start + q_len].float().transpose(0, 1)
        start += q_len
        k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
        v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - q_len, ctx)[:, None]
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1))
    return torch.cat(outs)


def assert_close(out: torch.Tensor, batch: PagedBatch, scale: float | None = None) -> None:
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    tol = TOLERANCE[batch.query.dtype]
    torch.testing.assert_close(out.float().cpu(), reference(batch, scale), atol=tol, rtol=tol)


# --- paged_attention, torch path ---------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_mixed_batch_matches_sdpa(dtype: torch.dtype, block_size: int, group: int) -> None:
    batch = make_batch(MIXED, block_size=block_size, num_heads=2 * group, num_kv_heads=2, dtype=dtype)
    assert_close(paged_attention(*batch.args()), batch)


@pytest.mark.parametrize("chunk_bytes", [1, 64 * 1024, torch_attention.DECODE_CHUNK_BYTES])
def test_decode_batch_of_ragged_lengths(monkeypatch: pytest.MonkeyPatch, chunk_bytes: int) -> None:
    """Decode only, lengths all different: one sequence per chunk, a few, or one chunk."""
    monkeypatch.setattr(torch_attention, "DECODE_CHUNK_BYTES", chunk_bytes)
    specs = [(ctx, 1) for ctx in (300, 17, 1, 129, 64, 250, 31, 200)]
    batch = make_batch(specs, num_heads=8, num_kv_heads=2, seed=1)
    assert_close(paged_attention(*batch.args()), batch)


def test_prefill_only_and_custom_scale() -> None:
    batch = make_batch([(90, 90), (120, 40)], num_heads=4, num_kv_heads=4, seed=2)
    assert_close(paged_attention(*batch.args(), scale=0.3), batch, scale=0.3)


def test_int64_indices_fp16_and_odd_head_dim() -> None:
    batch = make_batch(MIXED[:5], head_dim=24, dtype=torch.float16, index_dtype=torch.int64, seed=3)
    assert_close(paged_attention(*batch.args()), batch)


def test_non_contiguous_query() -> None:
    batch = make_batch(MIXED, seed=4)
    wide = torch.cat([batch.query, torch.full_like(batch.query, float("nan"))], dim=-1)
    batch.query = wide[..., : batch.query.shape[-1]]
    assert not batch.query.is_contiguous()
    assert_close(paged_attention(*batch.args()), batch)


# --- store_kv --------------------------------------------------------------------------------


@pytest.mark.parametrize("contiguous", [True, False])
def test_store_kv_writes_exactly_the_named_slots(contiguous: bool) -> None:
    num_blocks, block_size, heads, dim = 6, 4, 2, 8
    if contiguous:
        k_cache = torch.full((num_blocks, block_size, heads, dim), float("nan"))
        v_cache = torch.full_like(k_cache, float("nan"))
    else:  # every other block of larger tensors: strided views
        k_cache = torch.full((2 * num_blocks, block_size, heads, dim), float("nan"))[::2]
        v_cache = torch.full((2 * num_blocks, block_size, heads, dim), float("nan"))[::2]
        assert not k_cache.is_contiguous()
    key, value = torch.randn(5, heads, dim), torch.randn(5, heads, dim)
    slots = torch.tensor([13, -1, 0, 23, -7])
    store_kv(key, value, k_cache, v_cache, slots)
    expect_k = torch.full((num_blocks * block_size, heads, dim), float("nan"))
    expect_v = expect_k.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expect_k[slot], expect_v[slot] = key[t], value[t]
    torch.testing.assert_close(k_cache.reshape(-1, heads, dim), expect_k, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(v_cache.reshape(-1, heads, dim), expect_v, equal_nan=True, atol=0, rtol=0)


def test_store_kv_then_attention_round_trip() -> None:
    """K/V written with store_kv at shuffled slots read back by paged_attention as by SDPA."""
    batch = make_batch(MIXED, seed=5)
    k_cache, v_cache = torch.zeros_like(batch.k_cache), torch.zeros_like(batch.v_cache)
    for s, (ctx, _) in enumerate(batch.specs):
        pos = torch.arange(ctx)
        slots = batch.block_tables[s, pos // 16].long() * 16 + pos % 16
        store_kv(batch.keys[s], batch.values[s], k_cache, v_cache, slots)
    batch.k_cache, batch.v_cache = k_cache, v_cache
    assert_close(paged_attention(*batch.args()), batch)


def test_store_kv_casts_to_the_cache_dtype_and_skips_all_padding() -> None:
    k_cache = torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(2, 1, 8)
    store_kv(key, key, k_cache, v_cache, torch.tensor([-1, -1]))
    assert not k_cache.any()
    store_kv(key, key, k_cache, v_cache, torch.tensor([5, -1], dtype=torch.int32))
    assert torch.equal(k_cache[1, 1], key[0].to(torch.bfloat16))


@pytest.mark.parametrize(
    "key_shape, slots",
    [((3, 2, 8), [0, 1, 24]), ((3, 3, 8), [0, 1, 2]), ((3, 2, 4), [0, 1, 2]), ((3, 2, 8), [0, 1]), ((2, 8), [0, 1])],
    ids=["slot-past-cache", "kv-heads", "head-dim", "slot-count", "rank"],
)
def test_store_kv_rejects(key_shape: tuple[int, ...], slots: list[int]) -> None:
    k_cache = torch.zeros(6, 4, 2, 8)
    key = torch.randn(key_shape)
    with pytest.raises(BadRequest):
        store_kv(key, key, k_cache, torch.zeros_like(k_cache), torch.tensor(slots))


def test_store_kv_rejects_float_slots_and_mismatched_caches() -> None:
    k_cache, key = torch.zeros(6, 4, 2, 8), torch.randn(2, 2, 8)
    with pytest.raises(BadRequest):
        store_kv(key, key, k_cache, torch.zeros_like(k_cache), torch.tensor([0.0, 1.0]))
    with pytest.raises(BadRequest):
        store_kv(key, key, k_cache, torch.zeros(6, 4, 2, 4), torch.tensor([0, 1]))


def test_store_kv_refuses_non_tensors_and_keys_that_are_not_real_floats() -> None:
    k_cache, v_cache, key = torch.zeros(6, 4, 2, 8), torch.zeros(6, 4, 2, 8), torch.randn(2, 2, 8)
    slots = torch.tensor([0, 1])
    calls = {
        "slot_mapping must be a torch.Tensor, got list": (key, key, k_cache, v_cache, [0, 1]),
        "k_cache must be a torch.Tensor, got NoneType": (key, key, None, v_cache, slots),
        "v_cache must be a torch.Tensor, got NoneType": (key, key, k_cache, None, slots),
        "key must be a torch.Tensor, got list": (key.tolist(), key, k_cache, v_cache, slots),
        "key must be a real floating dtype": (key.to(torch.complex64), key, k_cache, v_cache, slots),
        "value must be a real floating dtype": (key, key.long(), k_cache, v_cache, slots),
    }
    for message, args in calls.items():
        with pytest.raises(BadRequest, match=message):
            store_kv(*args)  # type: ignore[arg-type]
    assert not k_cache.any() and not v_cache.any(), "a refused write changed the cache"


@pytest.mark.parametrize("contiguous", [True, False])
def test_store_kv_of_keys_that_require_grad_leaves_the_caches_without_grad(contiguous: bool) -> None:
    """A forward run with grad enabled: the write records no history, so attention keeps working."""
    batch = make_batch([(8, 8)], block_size=4, num_heads=4, num_kv_heads=2, head_dim=8, seed=6)
    k_cache, v_cache = (torch.zeros(2 * batch.k_cache.shape[0], *batch.k_cache.shape[1:]) for _ in range(2))
    if not contiguous:  # every other block: the index_put_ path
        k_cache, v_cache = k_cache[::2], v_cache[::2]
    else:
        k_cache, v_cache = k_cache[: batch.k_cache.shape[0]], v_cache[: batch.k_cache.shape[0]]
    key = batch.keys[0].clone().requires_grad_()
    value = batch.values[0].clone().requires_grad_()
    pos = torch.arange(8)
    store_kv(key, value, k_cache, v_cache, batch.block_tables[0, pos // 4].long() * 4 + pos % 4)
    assert not k_cache.requires_grad and not v_cache.requires_grad
    assert not k_cache._base.requires_grad and not v_cache._base.requires_grad
    batch.k_cache, batch.v_cache = k_cache, v_cache
    out = paged_attention(*batch.args())  # prefill: failed in index_select on a cache that required grad
    assert not out.requires_grad
    assert_close(out, batch)


def test_duplicate_slots_hold_the_kv_of_one_of_their_tokens() -> None:
    """Not refused (no pass over the slots); the slot holds one of the rows written to it."""
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    key, value = torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    store_kv(key, value, k_cache, v_cache, torch.tensor([5, 2, 5]))
    assert torch.equal(k_cache[0, 2], key[1]) and torch.equal(v_cache[0, 2], value[1])
    assert any(torch.equal(k_cache[1, 1], key[t]) for t in (0, 2))
    assert any(torch.equal(v_cache[1, 1], value[t]) for t in (0, 2))


# --- paged_attention errors -------------------------------------------------------------------


def _broken(name: str) -> tuple[torch.Tensor, ...]:
    """The arguments of a valid small batch with one thing wrong, named by ``name``."""
    b = make_batch([(20, 1), (9, 3)], num_heads=8, num_kv_heads=2)
    q, kc, vc, bt, sl, qsl = b.args()
    broken = {
        "gqa": (q[:, :3], kc, vc, bt, sl, qsl),
        "head-dim": (q[..., :16], kc, vc, bt, sl, qsl),
        "query-dtype": (q.double(), kc, vc, bt, sl, qsl),
        "query-rank": (q[0], kc, vc, bt, sl, qsl),
        "v-cache-shape": (q, kc, vc[:, :8], bt, sl, qsl),
        "cache-rank": (q, kc[0], vc[0], bt, sl, qsl),
        "table-batch": (q, kc, vc, bt[:1], sl, qsl),
        "start-loc-length": (q, kc, vc, bt, sl, qsl[:2]),
        "start-loc-end": (q[:3], kc, vc, bt, sl, qsl),
        "start-loc-decreasing": (q, kc, vc, bt, sl, torch.tensor([0, 5, 4], dtype=torch.int32)),
        "new-tokens-past-context": (q, kc, vc, bt, torch.tensor([20, 2], dtype=torch.int32), qsl),
        "context-past-table": (q, kc, vc, bt[:, :1], sl, qsl),
        "block-id-past-cache": (q, kc, vc, torch.where(bt == bt[0, 0], kc.shape[0], bt), sl, qsl),
        "float-lengths": (q, kc, vc, bt, sl.float(), qsl),
    }
    return broken[name]


@pytest.mark.parametrize(
    "name",
    ["gqa", "head-dim", "query-dtype", "query-rank", "v-cache-shape", "cache-rank", "table-batch",
     "start-loc-length", "start-loc-end", "start-loc-decreasing", "new-tokens-past-context",
     "context-past-table", "block-id-past-cache", "float-lengths"],
)
def test_paged_attention_rejects(name: str) -> None:
    with pytest.raises(BadRequest):
        paged_attention(*_broken(name))


def test_paged_attention_names_an_argument_that_is_not_a_tensor() -> None:
    q, kc, vc, bt, sl, qsl = make_batch([(20, 1), (9, 3)]).args()
    calls = {
        "query": (q.tolist(), kc, vc, bt, sl, qsl), "k_cache": (q, None, vc, bt, sl, qsl),
        "v_cache": (q, kc, None, bt, sl, qsl), "block_tables": (q, kc, vc, bt.tolist(), sl, qsl),
        "seq_lens": (q, kc, vc, bt, [20, 9], qsl), "query_start_loc": (q, kc, vc, bt, sl, (0, 1, 4)),
    }
    for name, args in calls.items():
        with pytest.raises(BadRequest, match=f"^{name} must be a torch.Tensor, got "):
            paged_attention(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize("which", ["query", "k_cache", "v_cache"])
@pytest.mark.parametrize("specs", [[(20, 1)], [(9, 3)]], ids=["decode", "prefill"])
def test_paged_attention_refuses_grad_unless_it_is_off(which: str, specs: list[tuple[int, int]]) -> None:
    """It computes no gradients (the fused decode wrote an output without any): with grad enabled, an
    input that requires grad is refused; under no_grad or inference_mode the same call runs."""
    batch = make_batch(specs)
    setattr(batch, which, getattr(batch, which).clone().requires_grad_())
    with pytest.raises(BadRequest, match=f"computes no gradients, but {which} requires grad.*torch.no_grad"):
        paged_attention(*batch.args())
    with torch.no_grad():
        assert_close(paged_attention(*batch.args()), batch)
    with torch.inference_mode():
        out = paged_attention(*batch.args())
    assert not out.requires_grad
    assert_close(out, batch)


def test_impl_choice() -> None:
    batch = make_batch([(20, 1)])
    with pytest.raises(BadRequest):
        paged_attention(*batch.args(), impl="fast")  # type: ignore[arg-type]
    with pytest.raises(BadRequest):
        paged_attention(*batch.args(), impl="triton")  # CPU tensors: no Triton path
    assert_close(paged_attention(*batch.args(), impl="torch"), batch)


def test_importing_the_ops_does_not_import_triton() -> None:
    code = "import sys, kvdaemon.client.attention; print('triton' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"


# --- the Triton kernels under triton's CPU interpreter -----------------------------------------

INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import torch
    from kvdaemon.client import triton_attention
    from kvdaemon.client.attention import paged_attention, store_kv
    from tests.client.test_attention import MIXED, TOLERANCE, make_batch

    # fp32 and fp16 only: the interpreter's bf16 dot is wrong (not the kernel's).
    for dtype, block_size, heads, kv_heads, dim in [
        (torch.float32, 16, 8, 2, 32), (torch.float32, 1, 6, 2, 24), (torch.float16, 32, 8, 1, 64),
    ]:
        b = make_batch(MIXED, block_size=block_size, num_heads=heads, num_kv_heads=kv_heads,
                       head_dim=dim, dtype=dtype)
        ours = triton_attention.paged_attention(*b.args(), dim ** -0.5)
        torch.testing.assert_close(ours, paged_attention(*b.args(), impl="torch"),
                                   atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    k_cache = torch.full((4, 4, 2, 8), float("nan"))
    v_cache, expect = k_cache.clone(), k_cache.clone()
    key = torch.randn(3, 2, 8)
    triton_attention.store_kv(key, key, k_cache, v_cache, torch.tensor([6, -1, 13]))
    store_kv(key, key, expect, expect.clone(), torch.tensor([6, -1, 13]))
    torch.testing.assert_close(k_cache, expect, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, expect, equal_nan=True, atol=0, rtol=0)
    print("interpreter ok")
    """
)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernels_in_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", INTERPRETER_SCRIPT], cwd=REPO_ROOT, env=env,
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "interpreter ok" in result.stdout


# --- GPU: the Triton path against the torch path -----------------------------------------------

needs_gpu = pytest.mark.skipif(not HAS_CUDA_TRITON, reason="needs a CUDA GPU and triton")


GPU_CASES = [(d, b, g) for d in (torch.float32, torch.bfloat16) for b in (1, 16, 32) for g in (1, 4, 8)]


@pytest.mark.parametrize("dtype, block_size, group", GPU_CASES + [(torch.float16, 16, 4)])
@pytest.mark.gpu
@needs_gpu
def test_gpu_triton_matches_torch(dtype: torch.dtype, block_size: int, group: int) -> None:
    batch = make_batch(MIXED, block_size=block_size, num_heads=2 * group, num_kv_heads=2,
                       head_dim=64, dtype=dtype).to("cuda")
    ours = paged_attention(*batch.args(), impl="triton")
    torch.testing.assert_close(ours, paged_attention(*batch.args(), impl="torch"),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    assert_close(ours, batch)


@pytest.mark.gpu
@needs_gpu
def test_gpu_large_decode_batch() -> None:
    specs = [(ctx, 1) for ctx in torch.randint(1, 3000, (48,), generator=torch.Generator().manual_seed(7)).tolist()]
    batch = make_batch(specs, num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16).to("cuda")
    ours = paged_attention(*batch.args())  # auto: Triton
    torch.testing.assert_close(ours, paged_attention(*batch.args(), impl="torch"), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_gpu
def test_gpu_store_kv() -> None:
    k_cache = torch.full((8, 16, 4, 64), float("nan"), device="cuda", dtype=torch.bfloat16)
    v_cache, expect_k, expect_v = k_cache.clone(), k_cache.clone(), k_cache.clone()
    key = torch.randn(40, 4, 64, device="cuda")
    value = torch.randn(40, 4, 64, device="cuda")
    slots = torch.randperm(8 * 16, device="cuda")[:40]
    slots[::7] = -1
    store_kv(key, value, k_cache, v_cache, slots)  # auto: Triton
    torch_attention.store_kv(key, value, expect_k, expect_v, slots)
    torch.testing.assert_close(k_cache, expect_k, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, expect_v, equal_nan=True, atol=0, rtol=0)
