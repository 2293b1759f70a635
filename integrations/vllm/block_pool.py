"""``pooled_block_pool_class``: vLLM's ``BlockPool`` with its free queue backed by a kvdaemon pool.

The class is vLLM's own with four changes, so vLLM's prefix hashing, KV
events and metrics run unchanged:

- the free queue is a ``PooledFreeQueue`` over the tenant's pool; the null
  block (block 0) is the pool's block 0, taken when the tenant registered;
- ``ensure_free(n)``, called by the coordinator right after it computed a
  request's block need, maps pages ahead so that vLLM's own free check sees
  blocks it can really have: when the daemon refuses, the free count drops to
  what is mapped and vLLM's ``allocate_slots`` returns None (the scheduler
  preempts or waits) instead of failing later;
- ``get_usage`` is held / (held + what can be had), not a share of the
  virtual capacity; ``reset_prefix_cache`` succeeds when vLLM holds no block
  (vLLM's own check compares free blocks with the virtual capacity) and then
  gives the formerly cached blocks back to the pool;
- ``release_free(n)`` gives up to n unheld blocks back to the pool (spare ones
  first, then cached ones, oldest first, their hashes dropped through vLLM's
  eviction so events and metrics see it): the answer to a daemon reclaim;
  ``release_spare()`` gives back the blocks taken ahead but not used, at the
  end of each ``schedule``.

The class is made from the ``BlockPool`` the gate resolved, once per process.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import TYPE_CHECKING, Any

from kvdaemon.integrations.vllm.free_queue import PooledFreeQueue
from kvdaemon.integrations.vllm.tenant import current_tenant

if TYPE_CHECKING:
    from kvdaemon.integrations.vllm.tenant import VllmTenant

log = logging.getLogger("kvdaemon.integrations.vllm")


@cache
def pooled_block_pool_class(block_pool_cls: type) -> type:
    """vLLM's ``block_pool_cls`` with its blocks in the process's kvdaemon tenant."""

    class PooledBlockPool(block_pool_cls):  # type: ignore[misc, valid-type]
        """vLLM's BlockPool over the tenant's kvdaemon pool (see the module docstring)."""

        def __init__(self, num_gpu_blocks: int, *args: Any, **kwargs: Any) -> None:
            tenant = current_tenant()
            tenant.check_num_blocks(num_gpu_blocks)
            super().__init__(num_gpu_blocks, *args, **kwargs)
            self.tenant: VllmTenant = tenant
            # vLLM's null block is block 0 (the gate checked), which the tenant holds for good.
            self.free_block_queue = PooledFreeQueue(tenant.pool, tenant.headroom, self.blocks)
            tenant.attach_block_pool(self)

        def ensure_free(self, num_blocks: int) -> None:
            self.free_block_queue.ensure_free(num_blocks)

        def get_usage(self) -> float:
            queue = self.free_block_queue
            held = queue.num_held - 1  # the null block is held for good
            total = held + queue.num_free_blocks
            return held / total if total > 0 else 0.0

        def reset_prefix_cache(self) -> bool:
            queue = self.free_block_queue
            with queue.counting_unheld():
                done = super().reset_prefix_cache()
            if done:
                cached = queue.pop_cached(len(queue.cached))
                queue.give_back([block.block_id for block in cached])
            return done

        def release_spare(self) -> None:
            queue = self.free_block_queue
            queue.give_back(queue.pop_spare(len(queue.spare)))

        def release_free(self, num_blocks: int) -> int:
            queue = self.free_block_queue
            ids = queue.pop_spare(num_blocks)
            for block in queue.pop_cached(num_blocks - len(ids)):
                self._maybe_evict_cached_block(block)
                ids.append(block.block_id)
            queue.give_back(ids)
            return len(ids)

    PooledBlockPool.__name__ = PooledBlockPool.__qualname__ = "PooledBlockPool"
    return PooledBlockPool
