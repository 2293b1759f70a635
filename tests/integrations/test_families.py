"""The engine across transformers' decoder families: token-exact with ``generate``, or refused up front.

Every family of ``zoo.FAMILIES`` is built tiny and either served by ``Engine``
(over a ``LocalPool`` sized by ``kv_spec_for``) with outputs equal to the
model's own greedy ``generate``, or refused by ``kv_spec_for`` / ``Engine(...)``
with a ``BadRequest`` naming the family and the reason. The prompts (5-64
tokens) are longer than ``zoo.WINDOW``, and prefills run in chunks of at most
``BUDGET`` tokens, so sliding windows bind in prefill chunks and in decodes.
"""

from __future__ import annotations

from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

from kvdaemon.client.local_pool import LocalPool  # noqa: E402
from kvdaemon.errors import BadRequest  # noqa: E402
from kvdaemon.integrations import hf_attention  # noqa: E402
from kvdaemon.integrations.hf import Engine, kv_spec_for  # noqa: E402

from .models import random_prompts, reference_outputs  # noqa: E402
from .zoo import EXACT, REFUSED, tiny_family  # noqa: E402

BLOCK = 4
BUDGET = 24
NEW = 8
LENGTHS = [5, 17, 40, 64]


def engine_for(model: Any, **engine_args: Any) -> Engine:
    return Engine(model, LocalPool(kv_spec_for(model, BLOCK), num_blocks=128), **engine_args)


@pytest.mark.parametrize("family", EXACT)
def test_family_is_served_token_exact(family: str) -> None:
    model = tiny_family(family)
    prompts = random_prompts(LENGTHS)
    with engine_for(model, max_num_batched_tokens=BUDGET) as engine:
        outputs = engine.generate(prompts, NEW)
    assert outputs == reference_outputs(model, prompts, NEW)


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_family_is_refused_at_construction(family: str) -> None:
    model = tiny_family(family)
    implementation = model.config._attn_implementation
    with pytest.raises(BadRequest, match=REFUSED[family]) as refused:
        engine_for(model)
    assert type(model).__name__ in refused.value.message
    assert repr(model.config.model_type) in refused.value.message
    assert model.config._attn_implementation == implementation  # the probes left the model as it was


@pytest.mark.parametrize(
    "family, num_kv_heads, head_dim",
    [("gpt-neox", 4, 16), ("gpt2", 4, 16), ("gpt-bigcode", 1, 16), ("qwen3", 2, 16), ("deepseek-v3", 4, 16)],
)
def test_the_layout_is_what_attention_computes(family: str, num_kv_heads: int, head_dim: int) -> None:
    """GPT-NeoX's config says 2 KV heads (a field it ignores); its attention computes 4."""
    model = tiny_family(family)
    spec = kv_spec_for(model, BLOCK)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype_name) == (
        2, num_kv_heads, head_dim, "float32")


def test_an_encoder_decoder_is_refused_by_kv_spec_for() -> None:
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    with pytest.raises(BadRequest, match=r"T5ForConditionalGeneration \(model_type 't5'\).*encoder-decoder"):
        kv_spec_for(transformers.T5ForConditionalGeneration(config), BLOCK)


@pytest.mark.parametrize("family, dropped", [("mistral-window", "sliding_window"), ("gemma2-softcap", "softcap")])
def test_the_probe_refuses_a_paged_path_that_drops_an_option(
    monkeypatch: pytest.MonkeyPatch, family: str, dropped: str
) -> None:
    """A paged attention that ignored the window (or softcap) would be caught before any request."""
    real = hf_attention.paged_attention

    def without_option(*args: Any, **kwargs: Any) -> Any:
        kwargs[dropped] = None
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_attention, "paged_attention", without_option)
    with pytest.raises(BadRequest, match="logits through the paged attention differ"):
        engine_for(tiny_family(family))


def test_a_default_mistral_window_longer_than_the_model_runs() -> None:
    """Mistral's default 4096-token window cannot bind within its 512 positions: served, not refused."""
    model = tiny_family("mistral")
    assert kv_spec_for(model, BLOCK).num_kv_heads == 2
    with engine_for(model) as engine:
        assert engine.max_model_len == 512
