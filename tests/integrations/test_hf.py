"""PagedCache against transformers' default cache: same greedy tokens, blocks back, clean exhaustion."""

from __future__ import annotations

import gc
import itertools
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from kvdaemon.client import KVClient, KVPool, KVSpec, PoolExhausted  # noqa: E402
from kvdaemon.client.local_pool import LocalPool  # noqa: E402
from kvdaemon.errors import BadRequest  # noqa: E402
from kvdaemon.integrations.hf import PagedCache  # noqa: E402

from tests.conftest import wait_until  # noqa: E402
from .conftest import PAGE_BYTES  # noqa: E402
from .models import VOCAB  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")

NEW_TOKENS = 20


def spec_of(model: Any, block_size: int, dtype: torch.dtype = torch.float32) -> KVSpec:
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    return KVSpec(num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
                  head_dim=head_dim, block_size=block_size, dtype=dtype)


def left_padded(lengths: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of ``lengths``, left-padded with id 0, and their attention mask."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), width), generator=generator)
    mask = torch.ones_like(ids)
    for row, length in enumerate(lengths):
        ids[row, :width - length] = 0
        mask[row, :width - length] = 0
    return ids, mask


def greedy(model: Any, ids: torch.Tensor, mask: torch.Tensor, cache: PagedCache | None = None,
           new_tokens: int = NEW_TOKENS) -> Any:
    kwargs: dict[str, Any] = {} if cache is None else {"past_key_values": cache}
    return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                          output_scores=True, return_dict_in_generate=True, **kwargs)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


_names = itertools.count()


def register(client: KVClient, spec: KVSpec, **kwargs: Any) -> KVPool:
    return client.register(f"hf-{next(_names)}", spec, **kwargs)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("lengths", [[11], [13, 5, 9, 1]], ids=["batch1", "padded-batch4"])
def test_greedy_tokens_equal_the_default_cache(
    client: KVClient, model: Any, block_size: int, lengths: list[int]
) -> None:
    ids, mask = left_padded(lengths)
    expected = greedy(model, ids, mask)
    pool = register(client, spec_of(model, block_size))
    cache = PagedCache(pool)
    got = greedy(model, ids, mask, cache)
    assert got.sequences.tolist() == expected.sequences.tolist()
    for ours, theirs in zip(got.scores, expected.scores):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    stored = ids.shape[1] + NEW_TOKENS - 1  # the last token's K/V is never computed
    assert cache.get_seq_length() == stored
    assert pool.num_used_blocks == cache.num_blocks == len(lengths) * blocks_for(stored, block_size)
    cache.close()
    assert pool.num_used_blocks == 0, "every block goes back to the pool on close"
    pool.close()


def test_reset_frees_blocks_and_the_cache_is_reusable(client: KVClient, model: Any) -> None:
    pool = register(client, spec_of(model, 4))
    cache = PagedCache(pool)
    greedy(model, *left_padded([7, 3]), cache)
    cache.reset()
    assert pool.num_used_blocks == 0 and cache.get_seq_length() == 0
    ids, mask = left_padded([6, 10, 2], seed=2)  # another batch size after the reset
    assert greedy(model, ids, mask, cache).sequences.tolist() == greedy(model, ids, mask).sequences.tolist()
    cache.close()
    cache.close()  # idempotent
    assert pool.num_used_blocks == 0
    with pytest.raises(BadRequest, match="closed"):
        cache.update(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16), 0)
    pool.close()


def test_a_cache_dropped_without_close_gives_its_blocks_back(client: KVClient, model: Any) -> None:
    pool = register(client, spec_of(model, 4))
    local = LocalPool(spec_of(model, 4), num_blocks=64)
    for source in (pool, local):
        for _ in range(3):  # the one-liner: a fresh cache per call, never closed
            greedy(model, *left_padded([7, 3]), PagedCache(source))
        gc.collect()
    assert local.num_used_blocks == 0  # at once
    wait_until(lambda: pool.num_used_blocks == 0, 5, "the collected caches' blocks stayed allocated")
    kept = PagedCache(pool)
    greedy(model, *left_padded([5]), kept)
    used = pool.num_used_blocks
    with pytest.raises(BadRequest, match="beam search"):  # refused after its prefill took blocks
        model.generate(left_padded([5])[0], max_new_tokens=3, num_beams=2, do_sample=False,
                       past_key_values=PagedCache(pool))  # fmt: skip
    gc.collect()
    wait_until(lambda: pool.num_used_blocks == used, 5, "the refused cache's blocks stayed allocated")
    kept.close()
    assert pool.num_used_blocks == 0
    pool.close()


def generate_in_two_parts(client: KVClient, model: Any, between: Any = None) -> None:
    """5 tokens, then ``between(pool)``, then 7 more from the same cache: equal to 12 at once."""
    ids, mask = left_padded([9, 4])
    expected = greedy(model, ids, mask, new_tokens=12).sequences
    pool = register(client, spec_of(model, 4))
    with PagedCache(pool) as cache:
        first = greedy(model, ids, mask, cache, new_tokens=5).sequences
        if between is not None:
            between(pool)
        more_mask = torch.cat([mask, torch.ones(2, 5, dtype=mask.dtype)], dim=1)
        second = greedy(model, first, more_mask, cache, new_tokens=7).sequences
    assert second.tolist() == expected.tolist()
    assert pool.num_used_blocks == 0
    pool.close()


def test_generation_continues_from_a_filled_cache(client: KVClient, model: Any) -> None:
    generate_in_two_parts(client, model)


def test_generation_continues_across_a_warm_sleep(client: KVClient, model: Any) -> None:
    def sleep_and_wake(pool: KVPool) -> None:
        assert client.sleep(pool.name, "warm")["state"] == "sleeping-warm"
        assert pool.mapped_bytes == 0  # every page went back to the daemon
        client.wake(pool.name)
        assert pool.wait_state(lambda state: state.value == "active", 5)

    generate_in_two_parts(client, model, sleep_and_wake)


def kv(batch: int, tokens: int, spec: KVSpec) -> torch.Tensor:
    return torch.randn(batch, spec.num_kv_heads, tokens, spec.head_dim)


def test_pool_exhaustion_raises_and_changes_nothing(client: KVClient) -> None:
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)
    logical_page = spec.num_segments * PAGE_BYTES
    pool = register(client, spec, max_bytes=logical_page, num_spare_pages=0, num_prefetch_pages=0)
    capacity = pool.blocks_per_page  # blocks one logical page holds: all the limit allows
    cache = PagedCache(pool)
    keys = kv(4, 16 * (capacity // 4) - 3, spec)  # 4 rows, just short of filling the page
    for layer in range(spec.num_layers):
        cache.update(keys, keys, layer)
    held = pool.num_used_blocks
    assert held == capacity
    with pytest.raises(PoolExhausted, match=r"PagedCache: the pool cannot hold 4 x 1 more blocks"):
        cache.update(kv(4, 4, spec), kv(4, 4, spec), 0)
    assert pool.num_used_blocks == held == cache.num_blocks
    assert [cache.get_seq_length(layer) for layer in range(2)] == [keys.shape[2]] * 2
    new = kv(4, 3, spec)  # still fits the last blocks: the cache stays usable
    for layer in range(spec.num_layers):
        got_keys, _ = cache.update(new, new, layer)
        assert torch.equal(got_keys, torch.cat([keys, new], dim=2))
    cache.close()
    assert pool.num_used_blocks == 0
    pool.close()


def test_exhaustion_during_generate_is_a_clear_error(client: KVClient, model: Any) -> None:
    spec = spec_of(model, 16)
    pool = register(client, spec, max_bytes=spec.num_segments * PAGE_BYTES)
    ids, mask = left_padded([100] * 4)  # 4 x 7 blocks fit one page of 32; 4 x 9 do not
    cache = PagedCache(pool)
    with pytest.raises(PoolExhausted, match="PagedCache: the pool cannot hold 4 x 1 more blocks"):
        greedy(model, ids, mask, cache, new_tokens=40)
    assert cache.get_seq_length() == 128 and pool.num_used_blocks == 4 * 8
    cache.close()
    assert pool.num_used_blocks == 0
    pool.close()


def test_a_pool_that_does_not_fit_the_model_is_refused(client: KVClient, model: Any) -> None:
    pool = register(client, spec_of(model, 4, dtype=torch.float16))
    cache = PagedCache(pool)
    with pytest.raises(BadRequest, match="float16"):
        greedy(model, *left_padded([5]), cache)
    assert pool.num_used_blocks == 0
    wrong_heads = torch.zeros(1, 3, 2, 16, dtype=torch.float16)
    with pytest.raises(BadRequest, match="layout"):
        cache.update(wrong_heads, wrong_heads, 0)
    cache.close()
    pool.close()


def test_unsupported_operations_are_refused(client: KVClient, model: Any) -> None:
    pool = register(client, spec_of(model, 4))
    with PagedCache(pool) as cache:
        greedy(model, *left_padded([5]), cache, new_tokens=2)
        with pytest.raises(BadRequest, match="beam search"):
            cache.reorder_cache(torch.tensor([0]))
        with pytest.raises(BadRequest, match="cropped"):
            cache.crop(-1)
        with pytest.raises(BadRequest, match="batch size changed"):
            cache.update(torch.zeros(2, 2, 1, 16), torch.zeros(2, 2, 1, 16), 0)
    pool.close()


def test_a_forward_with_grad_is_refused_before_it_writes(client: KVClient, model: Any) -> None:
    """The in-place write of K/V that require grad made the pool's tensors require grad for good
    (and kept every forward's graph alive); refused, and the same forward under no_grad runs."""
    pool = register(client, spec_of(model, 4))
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with PagedCache(pool) as cache:
        with pytest.raises(BadRequest, match=r"records no gradients.*torch\.no_grad\(\)"):
            model(input_ids=ids, past_key_values=cache)
        assert cache.num_blocks == 0 and pool.num_used_blocks == 0
        assert not pool.key_cache(0).requires_grad and not pool.value_cache(1).requires_grad
        with torch.no_grad():
            out = model(input_ids=ids, past_key_values=cache).logits
            expected = model(input_ids=ids).logits
        torch.testing.assert_close(out, expected)
        assert cache.num_blocks == 2 and not pool.key_cache(0).requires_grad
    assert pool.num_used_blocks == 0
    pool.close()
