"""The decoder families of the installed transformers, tiny: what the family tests run.

Every model has 2 layers, hidden size 64, 4 query heads (2 KV heads where the
family has GQA), a 256-token vocabulary and random weights; building one takes
milliseconds once transformers imported its modeling module. ``EXACT`` lists
the families the engine must serve token-exact, ``REFUSED`` those it must refuse
at construction, each with a pattern of the reason. Falcon and Bloom are refused
where the installed transformers computes their attention inline, and served
where its modeling module calls it through ``ALL_ATTENTION_FUNCTIONS`` (Falcon
does from 5.25 on): read from the module's source, not from our probe.
Variants ``*-window`` set a sliding window of ``WINDOW`` tokens, shorter than
the test prompts, so it binds; ``gemma2-softcap`` a softcap that binds.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch
import transformers

from .models import VOCAB

WINDOW = 8
SOFTCAP = 1.0
"""Below the tiny models' attention scores, so the cap binds; Gemma2's default 50 does not here."""

INIT_STD = 0.2
"""Weights 10x transformers' default scale: attention is peaked, not a near-uniform average, so a
wrong scale, mask, window or softcap changes the outputs (at 0.02 most of them would not)."""

_INIT: dict[str, Any] = dict(initializer_range=INIT_STD, init_std=INIT_STD)  # OPT names it init_std
_SHAPE: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0, **_INIT,
)
_GPT_SHAPE: dict[str, Any] = dict(
    vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=512, bos_token_id=1, eos_token_id=2, **_INIT,
)
_MOE: dict[str, Any] = dict(num_experts_per_tok=2, moe_intermediate_size=32)

# name -> (config class, its arguments)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", _SHAPE),
    "qwen2": ("Qwen2Config", _SHAPE),
    "qwen2-window": ("Qwen2Config", {**_SHAPE, "use_sliding_window": True, "sliding_window": WINDOW,
                                     "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", {**_SHAPE, "head_dim": 16}),
    "olmo2": ("Olmo2Config", _SHAPE),
    "granite": ("GraniteConfig", _SHAPE),
    "gemma": ("GemmaConfig", {**_SHAPE, "head_dim": 16}),
    "opt": ("OPTConfig", {**_SHAPE, "ffn_dim": 128, "word_embed_proj_dim": 64}),
    "cohere": ("CohereConfig", _SHAPE),
    "mixtral": ("MixtralConfig", {**_SHAPE, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2-moe": ("Qwen2MoeConfig", {**_SHAPE, **_MOE, "num_experts": 4, "shared_expert_intermediate_size": 32}),
    "qwen3-moe": ("Qwen3MoeConfig", {**_SHAPE, **_MOE, "num_experts": 4, "head_dim": 16}),
    "mistral": ("MistralConfig", _SHAPE),  # window 4096: longer than any sequence here
    "mistral-window": ("MistralConfig", {**_SHAPE, "sliding_window": WINDOW}),
    "stablelm": ("StableLmConfig", _SHAPE),  # its layers drop the forward's kwargs
    "gpt-neox": ("GPTNeoXConfig", _SHAPE),  # no GQA, whatever num_key_value_heads says
    "phi": ("PhiConfig", _SHAPE),
    "phi3": ("Phi3Config", _SHAPE),
    "gpt2": ("GPT2Config", _GPT_SHAPE),
    "gptj": ("GPTJConfig", {**_GPT_SHAPE, "rotary_dim": 8}),
    "gpt-bigcode": ("GPTBigCodeConfig", _GPT_SHAPE),  # multi-query: one KV head
    "gemma2": ("Gemma2Config", {**_SHAPE, "head_dim": 16}),  # soft-capped, alternating windows
    "gemma2-window": ("Gemma2Config", {**_SHAPE, "head_dim": 16, "sliding_window": WINDOW}),
    "gemma2-softcap": ("Gemma2Config", {**_SHAPE, "head_dim": 16, "attn_logit_softcapping": SOFTCAP}),
    "gemma3-window": ("Gemma3TextConfig", {**_SHAPE, "head_dim": 16, "sliding_window": WINDOW}),
    "cohere2-window": ("Cohere2Config", {**_SHAPE, "sliding_window": WINDOW}),
    "deepseek-v3": ("DeepseekV3Config", {**_SHAPE, **_MOE, "n_routed_experts": 4, "q_lora_rank": None,
                                         "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                                         "v_head_dim": 16, "first_k_dense_replace": 2}),
    "falcon": ("FalconConfig", _SHAPE),
    "bloom": ("BloomConfig", {"vocab_size": VOCAB, "hidden_size": 64, "n_layer": 2, "n_head": 4, **_INIT}),
    "gpt-oss": ("GptOssConfig", {**_SHAPE, "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16}),
    "llama4-chunked": ("Llama4TextConfig", {**_SHAPE, "head_dim": 16, "intermediate_size_mlp": 128,
                                            "num_local_experts": 2, "attention_chunk_size": WINDOW}),
    "jamba": ("JambaConfig", {**_SHAPE, "num_experts": 2, "attn_layer_period": 2, "attn_layer_offset": 1,
                              "expert_layer_period": 2, "expert_layer_offset": 1, "use_mamba_kernels": False}),
}



def dispatches(family: str) -> bool:
    """Whether the installed transformers' ``modeling_<family>`` calls attention through
    ``ALL_ATTENTION_FUNCTIONS`` (the registry the engine's paged attention joins)."""
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(module)


INLINE = "does not dispatch through transformers' AttentionInterface"
REFUSED: dict[str, str] = {
    **{family: INLINE for family in ("falcon", "bloom") if not dispatches(family)},
    "gpt-oss": "uses sinks",
    "llama4-chunked": "logits through the paged attention differ",  # chunked attention: caught by the probe
    "jamba": r"attention ran in layers \[1\]",  # hybrid: Mamba layers between attention layers
}
EXACT = sorted(set(FAMILIES) - set(REFUSED))


def tiny_family(name: str, seed: int = 0) -> Any:
    """The tiny random-weight model of family ``name`` in eval mode; no EOS, pad id 0."""
    config_class, arguments = FAMILIES[name]
    config = getattr(transformers, config_class)(**arguments)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = None  # every run generates exactly the tokens asked
    model.generation_config.pad_token_id = 0
    return model.eval()
