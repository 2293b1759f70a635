"""An engine process for the integration tests.

Run from the repository root::

    python -m tests.integrations.engine_worker DIR NAME --arch llama --seed 0

It builds ``tiny_model(arch, seed)``, registers ``NAME`` with the daemon at
``DIR`` and serves an ``Engine`` over the pool. Commands come as JSON lines on
stdin, events go to stdout as JSON lines:

- on start: ``{"event": "ready"}``;
- ``{"cmd": "generate", "prompts": [[ids...], ...], "new": N}`` ->
  ``{"event": "outputs", "outputs": [[ids...], ...], "preemptions": P}``;
- ``{"cmd": "close"}`` (or EOF): closes the engine, the pool and the client,
  prints ``{"event": "closed"}``.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvdaemon.client import KVClient
from kvdaemon.integrations.hf import Engine, kv_spec_for

from .models import tiny_model


def emit(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("name")
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=4)
    opts = parser.parse_args()
    model = tiny_model(opts.arch, opts.seed)
    client = KVClient(opts.dir)
    pool = client.register(opts.name, kv_spec_for(model, opts.block_size))
    engine = Engine(model, pool)
    emit("ready")
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "close":
            break
        outputs = engine.generate(command["prompts"], command["new"])
        emit("outputs", outputs=outputs, preemptions=engine.num_preemptions)
    engine.close()
    pool.close()
    client.close()
    emit("closed")


if __name__ == "__main__":
    main()
