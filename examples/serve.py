"""Serve a small transformers model as one tenant of a running kvdaemon.

    python examples/serve.py NAME [--arch llama|qwen2] [--rounds 3] [--requests 16] [--pause-s 10]

The model is built from a config with random weights (no download), so its
text is noise, but its KV traffic is real: every round submits ``--requests``
prompts of 128-384 tokens at once and generates 64 tokens for each with
continuous batching; the engine's KV lives in the daemon. Between rounds the
process idles for ``--pause-s`` seconds: that is the time to run ``kvdaemon
status``, ``kvdaemon sleep NAME`` or ``kvdaemon wake NAME`` from another
shell. A round that finds the pool asleep wakes it first.
"""

from __future__ import annotations

import argparse
import random
import signal
import statistics
import sys
import time

import torch
import transformers

from kvdaemon.client import KVClient, KVPool
from kvdaemon.heap import freeze_heap
from kvdaemon.integrations.hf import Engine, kv_spec_for

MiB = 1 << 20
IDLE_STEP_S = 0.005  # between steps that ran nothing, so waiting costs no CPU


def build_model(arch: str, seed: int) -> transformers.PreTrainedModel:
    """A 4-layer model with GQA (8 query / 4 KV heads of 32), random weights, fp32, no EOS."""
    torch.manual_seed(seed)
    shape = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048)
    if arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    model.generation_config.eos_token_id = None
    return model.eval()


def serve_round(engine: Engine, pool: KVPool, rng: random.Random, num_requests: int) -> str:
    """Submit ``num_requests`` prompts at once, run them to the end; one line of figures."""
    was_asleep = pool.sleep_mode
    started = time.perf_counter()
    requests = [
        engine.add_request([rng.randrange(3, 1024) for _ in range(rng.randint(128, 384))], 64)
        for _ in range(num_requests)
    ]
    while engine.has_unfinished:
        engine.step()
        if not engine.last_num_scheduled_tokens:  # nothing could run (no memory, or no daemon): wait
            time.sleep(IDLE_STEP_S)
    elapsed = time.perf_counter() - started
    ttfts = [r.ttft_s for r in requests if r.ttft_s is not None]
    tokens = sum(r.num_output_tokens for r in requests)
    woke = f" (woke from {was_asleep} sleep)" if was_asleep else ""
    return (f"{num_requests} requests in {elapsed:.1f} s{woke}: TTFT mean {statistics.fmean(ttfts):.2f} s, "
            f"max {max(ttfts):.2f} s, {tokens / elapsed:.0f} tokens/s, "
            f"{pool.mapped_bytes / MiB:.1f} MiB mapped, {engine.num_preemptions} preemptions so far")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name")
    parser.add_argument("--arch", choices=["llama", "qwen2"], default="llama")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--pause-s", type=float, default=10.0)
    parser.add_argument("--dir", default=None, help="the daemon's directory (default: $KVDAEMON_DIR)")
    opts = parser.parse_args()
    model = build_model(opts.arch, opts.seed)
    freeze_heap()  # start-up is done: no full collection walks the model mid-forward
    rng = random.Random(opts.seed)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `kill`: unregister on the way out
    with KVClient(opts.dir) as client, client.register(opts.name, kv_spec_for(model, block_size=16)) as pool:
        with Engine(model, pool) as engine:
            for round_no in range(1, opts.rounds + 1):
                print(f"[{opts.name}] round {round_no}: {serve_round(engine, pool, rng, opts.requests)}", flush=True)
                if round_no < opts.rounds:
                    print(f"[{opts.name}] idle for {opts.pause_s:.0f} s", flush=True)
                    time.sleep(opts.pause_s)


if __name__ == "__main__":
    main()
