"""``VllmTenant``: the one kvdaemon tenant of a vLLM engine process, and what it supports.

The worker registers it (``register_tenant``) when vLLM asks how much KV
memory there is, before any KV is planned, and takes the pool's block 0 for
vLLM's null block at once (vLLM's warm-up reads it); the scheduler's block
pool, built later in the same process, finds it with ``current_tenant``. One engine is one
tenant: its pool has one joint segment per layer and ``grow_wait_s=0`` (a
grow the free pages cannot serve fails at once; the scheduler preempts or
waits while the daemon reclaims for the next try).

Supported: one GPU per engine, the engine core and its worker in one process
(tensor, pipeline, data and context parallel sizes 1, executor ``uni``), no
KV connector. Multi-GPU engines are a later step: one tenant per rank, with
grants that succeed on every rank or on none, so that the ranks' block tables
stay identical.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from kvdaemon.client import KVClient, KVSpec
from kvdaemon.errors import KVDaemonError, Unsupported
from kvdaemon.integrations.vllm.config import PluginConfig
from kvdaemon.integrations.vllm.engine_gate import EngineGate
from kvdaemon.integrations.vllm.free_queue import take_block_zero
from kvdaemon.integrations.vllm.headroom import Headroom

if TYPE_CHECKING:
    from kvdaemon.client import KVPool

log = logging.getLogger("kvdaemon.integrations.vllm")

_PARALLEL_SIZES = (
    "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
    "decode_context_parallel_size", "prefill_context_parallel_size",
)


class VllmTenant:
    """A registered engine: client, pool, headroom estimate and engine gate."""

    def __init__(self, config: PluginConfig, client: KVClient, pool: KVPool) -> None:
        self.config = config
        self.client = client
        self.pool = pool
        self.headroom = Headroom(pool, client)
        self.gate = EngineGate(pool)

    @property
    def spec(self) -> KVSpec:
        return self.pool.spec

    @property
    def kv_bytes(self) -> int:
        """Bytes of KV the pool's views span: what vLLM should plan its blocks for."""
        return self.pool.num_blocks * self.spec.block_bytes * self.spec.num_segments

    def check_num_blocks(self, num_blocks: int) -> None:
        """``Unsupported`` unless vLLM planned exactly the pool's blocks (block b = pool block b)."""
        if num_blocks != self.pool.num_blocks:
            raise Unsupported(
                f"vLLM planned {num_blocks} KV blocks but tenant {self.pool.name!r} holds "
                f"{self.pool.num_blocks}; do not set num_gpu_blocks_override with kvdaemon"
            )

    def attach_block_pool(self, block_pool: Any) -> None:
        """The scheduler's block pool: the gate lets the pool's agent reach it."""
        self.gate.block_pool = block_pool

    def close(self) -> None:
        self.pool.close()
        self.client.close()


_lock = threading.Lock()
_current: VllmTenant | None = None


def current_tenant() -> VllmTenant:
    """This process's tenant; ``Unsupported`` if the worker did not register one here."""
    if _current is None:
        raise Unsupported(
            "no kvdaemon tenant was registered in this process: kvdaemon's vLLM plugin needs the "
            "engine core and its worker in one process (one GPU, distributed_executor_backend='uni')"
        )
    return _current


def set_current_tenant(tenant: VllmTenant | None) -> VllmTenant | None:
    """Make ``tenant`` this process's tenant (``None``: none); returns the previous one."""
    global _current
    with _lock:
        previous, _current = _current, tenant
    return previous


def close_current_tenant() -> None:
    """Close this process's tenant, if any (vLLM's engine shut down: nothing reads its KV any
    more); a daemon already gone is logged, not raised, as a shutdown must finish."""
    tenant = set_current_tenant(None)
    if tenant is None:
        return
    try:
        tenant.close()
    except KVDaemonError as exc:
        log.warning("kvdaemon tenant %s: closing at engine shutdown: %s", tenant.config.tenant, exc)


def register_tenant(config: PluginConfig, spec: KVSpec) -> VllmTenant:
    """Register this process's tenant for ``spec`` (once; later calls return it if the spec matches)."""
    with _lock:
        existing = _current
    if existing is not None:
        if existing.spec != spec:
            raise Unsupported(f"tenant {config.tenant!r} is registered for {existing.spec}, not {spec}")
        return existing
    client = KVClient(config.dir)
    try:
        info = client.hello()
        max_bytes, min_bytes = config.limits(
            int(info["capacity_bytes"]), logical_page_bytes=spec.num_segments * int(info["page_size"]))
        pool = client.register(
            config.tenant, spec, max_bytes=max_bytes, min_bytes=min_bytes, weight=config.weight, grow_wait_s=0,
        )
    except BaseException:
        client.close()
        raise
    try:
        take_block_zero(pool)  # vLLM's null block, mapped before its warm-up reads it
    except BaseException:
        pool.close()
        client.close()
        raise
    tenant = VllmTenant(config, client, pool)
    pool.quiesce_hook, pool.resume_hook = tenant.gate.quiesce, tenant.gate.resume
    pool.reclaim_hook, pool.return_gate = tenant.gate.reclaim, tenant.gate.returning
    set_current_tenant(tenant)
    log.info(
        "vLLM engine registered as kvdaemon tenant %s: %d blocks of %d bytes per layer, %d layers",
        config.tenant, pool.num_blocks, spec.block_bytes, spec.num_layers,
    )
    return tenant


def check_parallel(vllm_config: Any) -> None:
    """``Unsupported`` unless the engine is one GPU, in one process, without a KV connector."""
    parallel = vllm_config.parallel_config
    over = {name: getattr(parallel, name) for name in _PARALLEL_SIZES if getattr(parallel, name) != 1}
    if over:
        sizes = ", ".join(f"{name}={value}" for name, value in over.items())
        raise Unsupported(
            f"kvdaemon's vLLM plugin runs engines on one GPU; this one has {sizes}. Multi-GPU "
            "engines (one tenant per rank, grants all-or-nothing across ranks) are not supported yet"
        )
    backend = parallel.distributed_executor_backend
    if backend != "uni":
        raise Unsupported(
            f"kvdaemon's vLLM plugin needs the engine core and its worker in one process "
            f"(distributed_executor_backend='uni'); this engine uses {backend!r}"
        )
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        raise Unsupported("kvdaemon's vLLM plugin does not support KV connectors (kv_transfer_config)")
