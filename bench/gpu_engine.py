"""GPU check of the engine: greedy outputs over CUDA daemon KV, and decode throughput against local KV.

``gpu_engine_check()`` is one of ``bench/gpu_check.py``'s checks: a daemon
process on the ``cuda`` backend, a tiny Llama (fp32, on the GPU, random
weights) served by ``Engine`` over a ``KVPool`` of that daemon; its outputs for
prompts of mixed lengths (with small chunks) must equal transformers'
``generate``. Then decode tokens/s of the same engine over daemon KV and over
a ``LocalPool`` (issue target: >= 0.9x). Raises ``AssertionError`` on a
mismatch; skipped (an error) without transformers.

``python bench/gpu_engine.py --cpu`` dry-runs it on the CPU (host backend).
Cost: a few seconds plus the daemon's start; well under 1 GiB of device memory.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

Figures = dict[str, float | int | str | bool]


def gpu_engine_check(device: str = "cuda", backend: str = "cuda") -> Figures:
    """The check; ``device="cpu", backend="host"`` dry-runs it without a GPU."""
    from daemon_proc import daemon_process  # imports kvdaemon.client (pyzmq)
    from engine import build_model, decode_rate  # imports transformers

    from kvdaemon.client.local_pool import LocalPool
    from kvdaemon.integrations.hf import Engine, kv_spec_for

    model = build_model().to(device)
    spec = kv_spec_for(model, 16)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1024, (n,), generator=generator).tolist() for n in (5, 77, 300, 16, 129)]
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
        expected.append(out[0, len(prompt):].tolist())
    batch = [torch.randint(3, 1024, (64,), generator=generator).tolist() for _ in range(64)]
    with daemon_process("1GiB", backend=backend) as client:
        pool = client.register("gpu-engine", spec)
        engine = Engine(model, pool, max_num_batched_tokens=64)
        got = engine.generate(prompts, 24)
        engine.close()
        matches = sum(g == e for g, e in zip(got, expected))
        assert matches == len(prompts), f"{len(prompts) - matches} of {len(prompts)} outputs differ from generate"
        daemon_rate = decode_rate(model, pool, batch, 128)
        pool.close()
    local_rate = decode_rate(model, LocalPool(spec, 64 * 12, device=device), batch, 128)
    return {
        "outputs_equal_generate": f"{matches}/{len(prompts)}",
        "decode_tokens_per_s_daemon": round(daemon_rate),
        "decode_tokens_per_s_local": round(local_rate),
        "daemon_over_local": round(daemon_rate / local_rate, 3),
    }


if __name__ == "__main__":
    dry_run = sys.argv[1:] == ["--cpu"]
    for key, value in (gpu_engine_check("cpu", "host") if dry_run else gpu_engine_check()).items():
        print(f"{key:<32} {value}")
