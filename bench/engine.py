"""Engine decode throughput with daemon KV against the same engine over plain torch KV.

One tiny Llama (4 layers, 8 query / 4 KV heads of 32, fp32, random weights) on
the CPU serves the same batch of requests twice per round:

- daemon: the KV lives in a ``KVPool`` of a daemon process (host backend),
  pages mapped on demand as the batch grows;
- local: the KV lives in a ``LocalPool`` (tensors allocated up front).

Each run prefills every prompt, then times the pure-decode steps (every
request adds one token per step). Rounds alternate the two modes; the figure
is the median decode tokens/s of each. Target: daemon >= 0.9x local.

Run: ``python bench/engine.py [--rounds 5] [--batch 32] [--new 96]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import transformers  # noqa: E402
from daemon_proc import daemon_process  # noqa: E402
from report import save, verdict  # noqa: E402

from kvdaemon.client.local_pool import LocalPool  # noqa: E402
from kvdaemon.integrations.hf import Engine, kv_spec_for  # noqa: E402

TARGET = 0.9
BLOCK = 16


def build_model(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def decode_rate(model: Any, pool: Any, prompts: list[list[int]], new: int) -> float:
    """Decode tokens per second of one run (prefill excluded)."""
    engine = Engine(model, pool, max_num_batched_tokens=4096)
    requests = [engine.add_request(p, new) for p in prompts]
    while any(r.first_token_s is None for r in requests):
        engine.step()
    num_before = sum(r.num_output_tokens for r in requests)
    t0 = time.perf_counter()
    while engine.has_unfinished:
        engine.step()
    elapsed = time.perf_counter() - t0
    tokens = sum(r.num_output_tokens for r in requests) - num_before
    engine.close()
    return tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=96)
    opts = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = build_model()
    spec = kv_spec_for(model, BLOCK)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1024, (opts.prompt,), generator=generator).tolist() for _ in range(opts.batch)]
    blocks = opts.batch * -(-(opts.prompt + opts.new) // BLOCK)
    rates: dict[str, list[float]] = {"daemon": [], "local": []}
    with daemon_process("1GiB", "--page-size", "256KiB") as client:
        for round_no in range(opts.rounds + 1):  # round 0 warms up both
            local = LocalPool(spec, blocks)
            daemon_pool = client.register(f"engine-{round_no}", spec)
            got = {"daemon": decode_rate(model, daemon_pool, prompts, opts.new),
                   "local": decode_rate(model, local, prompts, opts.new)}
            daemon_pool.close()
            if round_no:
                for mode, rate in got.items():
                    rates[mode].append(rate)
    daemon_rate, local_rate = statistics.median(rates["daemon"]), statistics.median(rates["local"])
    ratio = daemon_rate / local_rate
    print(f"engine decode, batch {opts.batch}, {opts.prompt}+{opts.new} tokens, {opts.rounds} rounds (median)")
    print(f"  daemon KV  {daemon_rate:9.0f} tokens/s   (runs: {', '.join(f'{r:.0f}' for r in rates['daemon'])})")
    print(f"  local KV   {local_rate:9.0f} tokens/s   (runs: {', '.join(f'{r:.0f}' for r in rates['local'])})")
    print(f"  ratio {ratio:.3f}x  target >= {TARGET}x  {verdict(ratio, TARGET, lower_is_better=False)}")
    save("engine", {"batch": opts.batch, "prompt": opts.prompt, "new": opts.new, "rounds": opts.rounds,
                    "daemon_tokens_per_s": daemon_rate, "local_tokens_per_s": local_rate, "ratio": ratio,
                    "target": TARGET, "runs": rates})


if __name__ == "__main__":
    main()
