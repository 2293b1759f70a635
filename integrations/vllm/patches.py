"""``install``: what the plugin changes in vLLM, all at once and only after the gate passed.

Scheduler side (the engine-core process):

- ``kv_cache_coordinator.BlockPool`` -> the pooled block pool, which the
  coordinator builds;
- ``KVCacheCoordinator.get_num_blocks_to_allocate``: after computing a
  request's need, the block pool maps pages for it (or learns the daemon
  refuses) before vLLM compares the need with the free count;
- ``Scheduler.schedule`` / ``update_from_output`` / ``finish_requests`` /
  ``reset_prefix_cache`` and ``EngineCore.step`` / ``step_with_batch_queue``
  run inside the engine gate;
- ``EngineCore.shutdown``: once vLLM's own teardown is done, the process's
  tenant closes (its pages back, unregistered: the daemon logs a clean exit, not
  a lease that ended without an unregister).

Worker side (the same process):

- ``Worker.determine_available_memory``: registers the tenant and answers with
  the pool's size, after vLLM's own profiling run;
- ``Worker.initialize_from_config`` scopes the real KV allocation, during which
  ``allocate_kv_cache`` (as the model runners call it) builds pool views;
- ``WorkerBase.get_supported_kv_cache_layouts`` keeps the layouts a pool
  segment per layer can hold.

Each wrapper passes through untouched for objects that are not the
plugin's (another block pool, a scheduler without a pooled pool). Installing
twice changes nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from kvdaemon.integrations.vllm.block_pool import pooled_block_pool_class
from kvdaemon.integrations.vllm.config import PluginConfig
from kvdaemon.integrations.vllm.gate import WRAPPED, VllmSurface
from kvdaemon.integrations.vllm.layout import pooled_layouts
from kvdaemon.integrations.vllm.tenant import close_current_tenant, current_tenant
from kvdaemon.integrations.vllm.worker import (
    available_kv_bytes, in_real_allocation, pool_kv_cache_views, real_allocation,
)

def install(surface: VllmSurface, config: PluginConfig) -> bool:
    """Patch vLLM (see the module docstring); False if it was already patched."""
    if getattr(surface.scheduler_cls.schedule, WRAPPED, False):
        return False
    pooled = pooled_block_pool_class(surface.block_pool_cls)
    setattr(pooled, WRAPPED, True)
    surface.coordinator_module.BlockPool = pooled
    _wrap(surface.coordinator_cls, "get_num_blocks_to_allocate", _ensuring_free)
    _wrap(surface.scheduler_cls, "schedule", _gated(needs_memory=True))
    for name in ("update_from_output", "finish_requests", "reset_prefix_cache"):
        _wrap(surface.scheduler_cls, name, _gated(needs_memory=False))
    for name in ("step", "step_with_batch_queue"):
        _wrap(surface.engine_core_cls, name, _engine_gated)
    _wrap(surface.engine_core_cls, "shutdown", _closing_tenant)
    _wrap(surface.worker_cls, "determine_available_memory", _sizing(surface, config))
    _wrap(surface.worker_cls, "initialize_from_config", _allocating)
    _wrap(surface.worker_base_cls, "get_supported_kv_cache_layouts", _filtering(surface))
    allocate = _allocate(surface)
    for module in surface.runner_modules:
        module.allocate_kv_cache = allocate
    return True


def _wrap(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(cls, name)
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, WRAPPED, True)
    setattr(cls, name, wrapper)


def gate_of(scheduler: Any) -> Any:
    """The engine gate of a scheduler whose block pool is pooled, else None."""
    block_pool = getattr(getattr(scheduler, "kv_cache_manager", None), "block_pool", None)
    tenant = getattr(block_pool, "tenant", None)
    return None if tenant is None else tenant.gate


def _ensuring_free(original: Callable[..., int]) -> Callable[..., int]:
    def get_num_blocks_to_allocate(self: Any, *args: Any, **kwargs: Any) -> int:
        num_blocks = original(self, *args, **kwargs)
        ensure_free = getattr(self.block_pool, "ensure_free", None)
        if ensure_free is not None:
            ensure_free(num_blocks)
        return num_blocks

    return get_num_blocks_to_allocate


def _gated(needs_memory: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def scheduler_call(self: Any, *args: Any, **kwargs: Any) -> Any:
            gate = gate_of(self)
            if gate is None:
                return original(self, *args, **kwargs)
            with gate.hold(self, needs_memory=needs_memory):
                return original(self, *args, **kwargs)

        return scheduler_call

    return make


def _engine_gated(original: Callable[..., Any]) -> Callable[..., Any]:
    def engine_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        gate = gate_of(getattr(self, "scheduler", None))
        if gate is None:
            return original(self, *args, **kwargs)
        with gate.hold():
            return original(self, *args, **kwargs)

    return engine_step


def _closing_tenant(original: Callable[..., Any]) -> Callable[..., Any]:
    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        finally:
            close_current_tenant()

    return shutdown


def _sizing(surface: VllmSurface, config: PluginConfig) -> Callable[[Callable[..., int]], Callable[..., int]]:
    def make(original: Callable[..., int]) -> Callable[..., int]:
        def determine_available_memory(self: Any) -> int:
            tenant = available_kv_bytes(surface, config, self)
            original(self)  # vLLM's profiling run: it compiles the model
            return tenant.kv_bytes

        return determine_available_memory

    return make


def _allocating(original: Callable[..., Any]) -> Callable[..., Any]:
    def initialize_from_config(self: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> Any:
        with real_allocation():
            return original(self, kv_cache_config, *args, **kwargs)

    return initialize_from_config


def _filtering(surface: VllmSurface) -> Callable[[Callable[..., list[str]]], Callable[..., list[str]]]:
    def make(original: Callable[..., list[str]]) -> Callable[..., list[str]]:
        def get_supported_kv_cache_layouts(self: Any) -> list[str]:
            return pooled_layouts(surface, original(self))

        return get_supported_kv_cache_layouts

    return make


def _allocate(surface: VllmSurface) -> Callable[..., dict[str, Any]]:
    original = surface.allocate_kv_cache

    @functools.wraps(original)
    def allocate_kv_cache(
        kv_cache_config: Any, device: Any, layout: Any, kernel_block_sizes: list[int] | None = None,
    ) -> dict[str, Any]:
        if not in_real_allocation():
            return original(kv_cache_config, device, layout, kernel_block_sizes)
        return pool_kv_cache_views(surface, current_tenant(), kv_cache_config, device, layout, kernel_block_sizes)

    setattr(allocate_kv_cache, WRAPPED, True)
    return allocate_kv_cache
