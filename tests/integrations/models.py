"""Factories for the transformers tests: tiny random models, prompts, reference generations."""

from __future__ import annotations

from typing import Any

import torch
import transformers

VOCAB = 256


def tiny_model(arch: str = "llama", seed: int = 0) -> Any:
    """A 2-layer model with GQA (4 query heads, 2 KV heads, head_dim 16) and random weights; no EOS."""
    torch.manual_seed(seed)
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape))
    model.generation_config.eos_token_id = None  # every run generates exactly the tokens asked
    model.generation_config.pad_token_id = 0
    return model.eval()


def random_prompts(lengths: list[int], seed: int = 1, prefix: list[int] | None = None) -> list[list[int]]:
    """Random token ids (never 0..2) of ``lengths``, each after ``prefix`` if given."""
    generator = torch.Generator().manual_seed(seed)
    head = list(prefix or [])
    return [head + torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def reference_outputs(model: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' own greedy ``generate`` of each prompt alone (SDPA, default cache)."""
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs
