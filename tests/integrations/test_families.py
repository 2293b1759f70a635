"""The engine across transformers' decoder families: token-exact with ``generate``, or refused up front.

Every family of ``zoo.FAMILIES`` is built tiny and either served by ``Engine``
(over a ``LocalPool`` sized by ``kv_spec_for``) with outputs equal to the
model's own greedy ``generate``, or refused by ``kv_spec_for`` / ``Engine(...)``
with a ``BadRequest`` naming the family and the reason. The prompts (5-64
tokens) are longer than ``zoo.WINDOW``, and prefills run in chunks of at most
``BUDGET`` tokens, so sliding windows bind in prefill chunks and in decodes.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from kvdaemon.client.local_pool import LocalPool  # noqa: E402
from kvdaemon.errors import BadRequest  # noqa: E402
from kvdaemon.integrations import hf_attention, hf_engine, hf_probe  # noqa: E402
from kvdaemon.integrations.hf import Engine, kv_spec_for  # noqa: E402

from .models import random_prompts, reference_outputs  # noqa: E402
from .zoo import EXACT, REFUSED, WINDOW, tiny_family  # noqa: E402

HAS_CUDA_TRITON = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None

BLOCK = 4
BUDGET = 24
NEW = 8
LENGTHS = [5, 17, 40, 64]


def engine_for(model: Any, **engine_args: Any) -> Engine:
    pool = LocalPool(kv_spec_for(model, BLOCK), num_blocks=128, device=model.device)
    return Engine(model, pool, **engine_args)


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


def test_a_window_reaches_the_attention_only_where_it_binds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A window no shorter than the step's longest context is dropped (it leaves the Triton path open)."""
    seen: list[tuple[int, int | None]] = []
    real = hf_attention.paged_attention

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append((int(args[4].max()), kwargs["sliding_window"]))  # seq_lens
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_attention, "paged_attention", recording)
    with engine_for(tiny_family("mistral-window")) as engine:
        engine.generate(random_prompts([3, 20]), 4)
    assert {window for longest, window in seen if longest <= WINDOW} == {None}
    assert {window for longest, window in seen if longest > WINDOW} == {WINDOW}
    seen.clear()
    with engine_for(tiny_family("mistral")) as engine:  # a 4096-token window in 512 positions
        engine.generate(random_prompts([40]), 4)
    assert seen and {window for _, window in seen} == {None}


def test_without_a_window_on_its_path_triton_runs_within_the_window() -> None:
    """``impl="triton"`` caps ``max_model_len`` at the shortest window, and refuses more if asked."""
    windowed, plain = tiny_family("gemma2-window"), tiny_family("llama")
    layout = hf_probe.probe_layout(windowed)
    assert layout.sliding_windows == (WINDOW, None)
    assert hf_engine._max_model_len(windowed, None, layout, "triton") == WINDOW
    assert hf_engine._max_model_len(windowed, 6, layout, "triton") == 6
    assert hf_engine._max_model_len(windowed, None, layout, "auto") == 512
    assert hf_engine._max_model_len(plain, None, hf_probe.probe_layout(plain), "triton") == 512
    with pytest.raises(BadRequest, match="longer than the model's sliding window 8"):
        hf_engine._max_model_len(windowed, 100, layout, "triton")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA_TRITON, reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("family", ["llama", "gpt-neox", "mistral-window", "qwen2-window", "gemma2-window"])
@pytest.mark.parametrize("impl", ["auto", "triton"])
def test_gpu_family_is_served_token_exact_or_refused(family: str, impl: str) -> None:
    """On CUDA ``auto`` runs windows and softcaps on the torch path; ``triton`` runs within the window
    (``max_model_len`` capped) and refuses Gemma2, whose softcap it cannot compute."""
    model = tiny_family(family).cuda()
    if impl == "triton" and family.startswith("gemma2"):
        with pytest.raises(BadRequest, match="neither a sliding window nor a softcap"):
            engine_for(model, attention_impl=impl)
        return
    within_window = impl == "triton" and family.endswith("window")
    prompts = random_prompts([3, 5] if within_window else LENGTHS)
    new = 3 if within_window else NEW
    with engine_for(model, max_num_batched_tokens=BUDGET, attention_impl=impl) as engine:
        assert engine.max_model_len == (WINDOW if within_window else 512)
        assert engine.generate(prompts, new) == reference_outputs(model, prompts, new)
