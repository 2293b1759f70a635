"""transformers greedy generation: ``PagedCache`` (daemon-backed) against the default cache.

One model (a Llama config with random weights, fp32, GQA), the same prompts,
the same run. Two cases: one prompt, and a left-padded batch of prompts of
different lengths. Each side generates ``--new-tokens`` tokens greedily (no EOS
stop, so both sides do the same number of steps); runs alternate between the
sides and the best of ``--repeats`` is kept, so drift hits both alike. The
tokens of both sides are compared too (they must be equal).

- ``default``: ``model.generate`` with its own ``DynamicCache``;
- ``paged``: ``model.generate(past_key_values=PagedCache(pool))`` over the pool
  of a tenant of a real daemon process; a fresh cache per run, closed after it
  (its blocks go back to the pool), the pool's pages mapped by a warm-up run.

Target: paged tokens/s >= 0.9x default in every case.
Run: ``python bench/overhead.py`` (under a minute on 2 idle cores; other load on the
machine shows up as noise in the ratio, so run it on a quiet machine).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from daemon_proc import daemon_process  # noqa: E402
from report import save, verdict  # noqa: E402

import torch  # noqa: E402

from kvdaemon.client import KVPool, KVSpec  # noqa: E402

TARGET = 0.9
CASES = {"batch1": (1, 128, 128), "batch4-padded": (4, 48, 128)}
"""name: (prompts, shortest prompt, longest prompt); lengths spread evenly, left-padded."""


def build_model(layers: int, hidden: int) -> Any:
    """A Llama with random weights: ``hidden`` wide, head_dim 64, 2 query heads per KV head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads = hidden // 64
    config = LlamaConfig(
        vocab_size=8192, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=2048, eos_token_id=None, pad_token_id=0, bos_token_id=1,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def prompts(batch: int, shortest: int, longest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts with lengths spread from ``longest`` down to ``shortest``."""
    generator = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, 8192, (batch, longest), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(batch):
        pad = (longest - shortest) * row // max(1, batch - 1)
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    return ids, mask


def timed(model: Any, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int,
          pool: KVPool | None) -> tuple[float, torch.Tensor]:
    """Seconds of one greedy ``generate`` and its output; a fresh PagedCache when ``pool`` is given."""
    from kvdaemon.integrations.hf import PagedCache

    kwargs: dict[str, Any] = {"attention_mask": mask, "max_new_tokens": new_tokens, "do_sample": False}
    cache = PagedCache(pool) if pool is not None else None
    if cache is not None:
        kwargs["past_key_values"] = cache
    start = time.perf_counter()
    out = model.generate(ids, **kwargs)
    seconds = time.perf_counter() - start
    if cache is not None:
        cache.close()
    return seconds, out


def run_case(model: Any, pool: KVPool, case: tuple[int, int, int], new_tokens: int,
             repeats: int) -> dict[str, Any]:
    """Best tokens/s of each side over ``repeats`` alternating runs, after one warm-up each."""
    ids, mask = prompts(*case)
    best = {"default": float("inf"), "paged": float("inf")}
    outputs: dict[str, torch.Tensor] = {}
    for round_ in range(repeats + 1):
        for side, side_pool in (("default", None), ("paged", pool)):
            seconds, outputs[side] = timed(model, ids, mask, new_tokens, side_pool)
            if round_:
                best[side] = min(best[side], seconds)
    tokens = case[0] * new_tokens
    return {
        "tokens_per_second": {side: tokens / seconds for side, seconds in best.items()},
        "ratio": best["default"] / best["paged"],
        "same_tokens": bool(torch.equal(outputs["default"], outputs["paged"])),
        "blocks_in_use_after": pool.num_used_blocks,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*past_key_values.* is deprecated", category=FutureWarning)
    model = build_model(args.layers, args.hidden)
    config = model.config
    spec = KVSpec(num_layers=args.layers, num_kv_heads=config.num_key_value_heads,
                  head_dim=config.hidden_size // config.num_attention_heads,
                  block_size=args.block_size, dtype=torch.float32)
    figures: dict[str, Any] = {}
    with daemon_process("512MiB") as client:
        pool = client.register("bench", spec)
        for name, case in CASES.items():
            figures[name] = run_case(model, pool, case, args.new_tokens, args.repeats)
        pool.close()
    print(f"model: Llama {args.layers} layers, hidden {args.hidden}, fp32, "
          f"{torch.get_num_threads()} threads; {args.new_tokens} new tokens, block size {args.block_size}")
    print(f"{'case':>14} {'default':>12} {'paged':>12}   paged/default   same tokens")
    worst = min(result["ratio"] for result in figures.values())
    for name, result in figures.items():
        rates = result["tokens_per_second"]
        print(f"{name:>14} {rates['default']:8.1f} t/s {rates['paged']:8.1f} t/s   "
              f"{result['ratio']:11.3f}x   {result['same_tokens']}")
    print(f"worst paged/default: {worst:.3f}x   target >= {TARGET}x   "
          f"{verdict(worst, TARGET, lower_is_better=False)}")
    path = save("overhead", {
        "model": {"arch": "llama", "layers": args.layers, "hidden": args.hidden, "dtype": "float32",
                  "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim},
        "new_tokens": args.new_tokens, "block_size": args.block_size, "threads": torch.get_num_threads(),
        "cases": {name: {"prompts": case[0], "shortest": case[1], "longest": case[2], **figures[name]}
                  for name, case in CASES.items()},
        "worst_ratio": round(worst, 3), "target_ratio": TARGET,
    })
    print(f"wrote {path}")
    return 0 if all(result["same_tokens"] for result in figures.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
