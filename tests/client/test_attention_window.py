"""``paged_attention`` with a sliding window and a softcap against an explicit fp32 reference.

The reference computes, per sequence over its contiguous K/V, the scores
``q k^T * scale``, the softcap ``c * tanh(s / c)``, transformers' sliding-window
causal mask (position ``p`` sees keys ``p - w < k <= p``), softmax and the
weighted sum, all in fp32. Batches come from ``test_attention.make_batch``
(NaN-poisoned caches at shuffled block ids), so a window that reads outside a
sequence's blocks fails too.
"""

from __future__ import annotations

import pytest
import torch

from kvdaemon.client.attention import paged_attention
from kvdaemon.errors import BadRequest

from .test_attention import MIXED, TOLERANCE, PagedBatch, make_batch


def reference(batch: PagedBatch, window: int | None, softcap: float | None) -> torch.Tensor:
    """``[total_q, heads, dim]`` fp32 attention with the window and softcap applied explicitly."""
    group = batch.query.shape[1] // batch.k_cache.shape[2]
    scale = batch.query.shape[-1] ** -0.5
    queries = batch.query.float().split([q_len for _, q_len in batch.specs])
    outs = []
    for (ctx, q_len), q, k, v in zip(batch.specs, queries, batch.keys, batch.values):
        k, v = (t.float().repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
        scores = q.transpose(0, 1) @ k.transpose(-1, -2) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        key_pos, query_pos = torch.arange(ctx)[None, :], torch.arange(ctx - q_len, ctx)[:, None]
        mask = key_pos <= query_pos
        if window is not None:
            mask &= key_pos > query_pos - window
        outs.append((scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v).transpose(0, 1))
    return torch.cat(outs)


def assert_matches(batch: PagedBatch, window: int | None, softcap: float | None) -> None:
    out = paged_attention(*batch.args(), sliding_window=window, softcap=softcap)
    tol = TOLERANCE[batch.query.dtype]
    torch.testing.assert_close(out.float(), reference(batch, window, softcap), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 7, 16, 40, 1000])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_window_and_softcap_on_a_mixed_batch(dtype: torch.dtype, window: int, softcap: float | None) -> None:
    batch = make_batch(MIXED, block_size=16, num_heads=8, num_kv_heads=2, dtype=dtype)
    assert_matches(batch, window, softcap)


def test_softcap_alone_and_whole_prompts() -> None:
    assert_matches(make_batch([(33, 33), (5, 5)], block_size=4), None, 2.0)
    assert_matches(make_batch([(33, 33), (5, 5)], block_size=4), 9, None)


def test_decode_batch_where_the_window_binds_for_some_sequences_only() -> None:
    batch = make_batch([(3, 1), (12, 1), (12, 1), (50, 1)], block_size=4, num_heads=4, num_kv_heads=4)
    assert_matches(batch, 10, None)


def test_a_window_that_binds_changes_the_output() -> None:
    batch = make_batch([(40, 1), (30, 6)], block_size=8)
    assert not torch.allclose(paged_attention(*batch.args(), sliding_window=8), paged_attention(*batch.args()))


@pytest.mark.parametrize("window", [0, -3, 2.5, True, "8"])
def test_bad_windows_are_refused(window: object) -> None:
    with pytest.raises(BadRequest, match="sliding_window"):
        paged_attention(*make_batch([(20, 1)]).args(), sliding_window=window)  # type: ignore[arg-type]


@pytest.mark.parametrize("softcap", [0.0, -1.0, float("inf"), float("nan"), True])
def test_bad_softcaps_are_refused(softcap: object) -> None:
    with pytest.raises(BadRequest, match="softcap"):
        paged_attention(*make_batch([(20, 1)]).args(), softcap=softcap)  # type: ignore[arg-type]


def test_the_triton_path_refuses_a_window_or_softcap() -> None:
    args = make_batch([(20, 1)]).args()
    for options in ({"sliding_window": 4}, {"softcap": 30.0}):
        with pytest.raises(BadRequest, match="neither a sliding window nor a softcap"):
            paged_attention(*args, impl="triton", **options)  # type: ignore[arg-type]
