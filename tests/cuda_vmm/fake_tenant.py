"""A tenant process for the system tests on the fake CUDA driver (``test_fake_system.py``).

Run from the repository root, in the fake driver's environment::

    python -m tests.cuda_vmm.fake_tenant DIR NAME --tag T [--spare N] [--prefetch N]

It registers ``NAME`` with the daemon at ``DIR`` through ``KVClient.register``
(one layer, fp32, 256 blocks per 2 MiB page) and serves JSON-line commands on
stdin, answering each with one JSON line on stdout:

- ``{"cmd": "alloc", "n": N}``: allocates N blocks (retrying a refusal for up to
  a minute, while other tenants give pages back), counts those holding any
  non-zero byte (fresh pages must read zero), then fills block ``b`` of segment
  ``s`` with ``tag * 100000 + 2 * b + s``. Answers ``blocks`` and ``num_nonzero``,
  or ``error`` (the exception) if the pool refused.
- ``{"cmd": "free", "n": N}``: zeroes, then frees, the N blocks allocated last
  (all if N < 0); so a block that reads non-zero at ``alloc`` holds bytes this
  tenant never wrote.
- ``{"cmd": "forget"}``: drops the blocks it holds from its books (after a cold
  sleep took them), without freeing them.
- ``{"cmd": "verify"}``: checks the pattern of every held block: ``ok``, ``num_blocks``.
- ``{"cmd": "info"}``: ``mapped_bytes``, ``used_bytes``, ``sleep_mode`` (``None``
  when awake), the caches' ``data_ptrs`` and ``devices``.
- ``{"cmd": "pointers"}``: asks the driver about every cache's ``data_ptr`` as
  Triton's launcher does (``CudaBackend.device_pointer``): ``failed`` lists
  the segments whose pointer is not mapped.
- ``{"cmd": "close"}`` (or EOF): closes the pool and the client; ``closed``.

Like an engine between steps, the tenant serves one command at a time under
a lock that the pool's ``quiesce_hook`` takes and its ``resume_hook`` gives
back: no command touches the KV while the pool sleeps or moves its pages to
a restarted daemon. Only the public client API is used (``KVClient``,
``KVSpec``, ``KVPool`` and its hooks).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import Any

import torch

from kvdaemon.client import KVClient, KVPool, KVSpec
from kvdaemon.errors import KVDaemonError, PoolExhausted

SPEC = KVSpec(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")
ALLOC_DEADLINE_S = 60.0  # refused allocs are retried until then: other tenants may be slow to give pages back


def caches(pool: KVPool) -> list[torch.Tensor]:
    """Every segment's tensor, in segment order (K then V of each layer)."""
    out = []
    for layer in range(pool.spec.num_layers):
        out += [pool.key_cache(layer), pool.value_cache(layer)]
    return out


def expected(tag: int, blocks: list[int], segment: int) -> torch.Tensor:
    return torch.tensor([tag * 100000 + 2 * b + segment for b in blocks], dtype=torch.float32)


class Tenant:
    """One registered pool, the blocks it holds, and the pattern they carry."""

    def __init__(self, pool: KVPool, tag: int) -> None:
        self.pool, self.tag = pool, tag
        self.blocks: list[int] = []

    def alloc(self, n: int) -> dict[str, Any]:
        deadline = time.monotonic() + ALLOC_DEADLINE_S
        while True:
            try:
                fresh = self.pool.alloc(n)
                break
            except PoolExhausted as exc:
                if time.monotonic() > deadline:
                    return {"error": f"{type(exc).__name__}: {exc}"}
            except KVDaemonError as exc:
                return {"error": f"{type(exc).__name__}: {exc}"}
        index = torch.tensor(fresh)
        num_nonzero = 0
        for segment, cache in enumerate(caches(self.pool)):
            rows = cache[index].flatten(1)
            num_nonzero += int((rows != 0).any(dim=1).sum())
            cache[index] = expected(self.tag, fresh, segment).view(-1, 1, 1, 1).expand_as(cache[index])
        self.blocks += fresh
        return {"blocks": fresh, "num_nonzero": num_nonzero}

    def free(self, n: int) -> dict[str, Any]:
        count = len(self.blocks) if n < 0 else n
        gone, self.blocks = self.blocks[len(self.blocks) - count:], self.blocks[: len(self.blocks) - count]
        if gone:
            index = torch.tensor(gone)
            for cache in caches(self.pool):
                cache[index] = 0
        self.pool.free(gone)
        return {"freed": len(gone)}

    def forget(self) -> dict[str, Any]:
        num_blocks, self.blocks = len(self.blocks), []
        return {"forgot": num_blocks}

    def verify(self) -> dict[str, Any]:
        ok = True
        if self.blocks:
            index = torch.tensor(self.blocks)
            for segment, cache in enumerate(caches(self.pool)):
                rows = cache[index].flatten(1)
                want = expected(self.tag, self.blocks, segment).view(-1, 1)
                ok = ok and bool((rows == want).all())
        return {"ok": ok, "num_blocks": len(self.blocks)}

    def info(self) -> dict[str, Any]:
        return {
            "mapped_bytes": self.pool.mapped_bytes, "used_bytes": self.pool.used_bytes,
            "sleep_mode": self.pool.sleep_mode,
            "data_ptrs": [c.data_ptr() for c in caches(self.pool)],
            "devices": [str(c.device) for c in caches(self.pool)],
        }

    def pointers(self) -> dict[str, Any]:
        failed = []
        for segment, cache in enumerate(caches(self.pool)):
            try:
                self.pool.backend.device_pointer(cache.data_ptr())
            except KVDaemonError as exc:
                failed.append({"segment": segment, "error": str(exc)})
        return {"failed": failed, "num_segments": len(caches(self.pool))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("name")
    parser.add_argument("--tag", type=int, default=1)
    parser.add_argument("--spare", type=int, default=2)
    parser.add_argument("--prefetch", type=int, default=1)
    opts = parser.parse_args()
    client = KVClient(opts.dir)
    pool = client.register(opts.name, SPEC, num_spare_pages=opts.spare, num_prefetch_pages=opts.prefetch)
    tenant = Tenant(pool, opts.tag)
    busy = threading.Lock()  # held while a command runs, and from quiesce to resume
    pool.quiesce_hook, pool.resume_hook = busy.acquire, busy.release
    print(json.dumps({"event": "ready", "num_blocks": pool.num_blocks,
                      "blocks_per_page": pool.blocks_per_page}), flush=True)
    handlers = {"alloc": lambda c: tenant.alloc(c["n"]), "free": lambda c: tenant.free(c["n"]),
                "verify": lambda c: tenant.verify(), "forget": lambda c: tenant.forget(), "info": lambda c: tenant.info(),
                "pointers": lambda c: tenant.pointers()}
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "close":
            break
        with busy:
            answer = handlers[command["cmd"]](command)
        print(json.dumps(answer), flush=True)
    pool.close()
    client.close()
    print(json.dumps({"event": "closed"}), flush=True)


if __name__ == "__main__":
    main()
