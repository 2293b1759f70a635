"""The worker side: vLLM's KV cache tensors become views over the tenant's pool segments.

- ``available_kv_bytes``: when vLLM asks how much KV memory there is, the
  worker registers the tenant for the model's KV layout and answers with the
  bytes the pool's views span, so that vLLM plans exactly the pool's blocks
  (block id b of vLLM = block b of the pool). vLLM's profiling run still runs
  (it compiles the model).
- ``pool_kv_cache_views``: the real KV allocation (the one inside
  ``Worker.initialize_from_config``) maps nothing and allocates nothing: each
  layer's cache is vLLM's own ``create_kv_cache_views`` over that layer's
  segment, so a block's bytes are exactly the pool's block, K and V laid out
  as vLLM's layout says. The profiling pass's small cache (outside
  ``initialize_from_config``) is vLLM's own allocation.

Pages under the views are mapped on demand by the scheduler's block pool
(same process); fresh pages read as zeros.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvdaemon.errors import Unsupported
from kvdaemon.integrations.vllm.config import PluginConfig
from kvdaemon.integrations.vllm.gate import VllmSurface
from kvdaemon.integrations.vllm.layout import check_layout, kv_spec_for
from kvdaemon.integrations.vllm.tenant import VllmTenant, check_parallel, register_tenant

_scope = threading.local()


def available_kv_bytes(surface: VllmSurface, config: PluginConfig, worker: Any) -> VllmTenant:
    """Check the engine, register its tenant and set vLLM's KV memory to the pool's size."""
    check_parallel(worker.vllm_config)
    tenant = register_tenant(config, kv_spec_for(surface, worker.get_kv_cache_spec()))
    worker.cache_config.kv_cache_memory_bytes = tenant.kv_bytes
    return tenant


@contextmanager
def real_allocation() -> Iterator[None]:
    """Within (on this thread), ``allocate_kv_cache`` builds views over the pool."""
    _scope.active = True
    try:
        yield
    finally:
        _scope.active = False


def in_real_allocation() -> bool:
    return getattr(_scope, "active", False)


def pool_kv_cache_views(
    surface: VllmSurface,
    tenant: VllmTenant,
    kv_cache_config: Any,
    device: Any,
    layout: Any,
    kernel_block_sizes: list[int] | None = None,
) -> dict[str, Any]:
    """vLLM's per-layer KV cache views, each over its layer's pool segment (see the module docstring)."""
    import torch

    check_layout(layout)
    tenant.check_num_blocks(kv_cache_config.num_blocks)
    names = [name for tensor in kv_cache_config.kv_cache_tensors for name in tensor.layers]
    if len(names) != tenant.spec.num_segments:
        raise Unsupported(
            f"vLLM places {len(names)} KV layers but tenant {tenant.pool.name!r} has "
            f"{tenant.spec.num_segments} segments"
        )
    groups = {
        name: (group_id, group.kv_cache_spec)
        for group_id, group in enumerate(kv_cache_config.kv_cache_groups)
        for name in group.layer_names
    }
    want = torch.device(device)
    views: dict[str, Any] = {}
    for index, name in enumerate(names):
        group_id, spec = groups[name]
        raw = tenant.pool.segment(index).view(-1)
        if raw.device.type != want.type or (want.index is not None and raw.device.index != want.index):
            raise Unsupported(
                f"the daemon's pages are on {raw.device} but vLLM runs on {want}: "
                "start the daemon on the engine's device"
            )
        placement = surface.kv_cache_tensor_cls(
            size=raw.numel(), layers=[name], layer_stride=raw.numel(),
            block_stride=spec.page_size_bytes, offset=0,
        )
        kernel_block_size = None
        if kernel_block_sizes is not None and group_id < len(kernel_block_sizes):
            kernel_block_size = kernel_block_sizes[group_id]
        (views[name],) = surface.create_kv_cache_views(
            raw, spec, kv_cache_config.num_blocks, layout, placement, kernel_block_size=kernel_block_size,
        )
    return views
