"""``LocalPool``: a paged KV cache in plain torch tensors, with no daemon behind it.

It is an ``EnginePool``, as ``KVPool`` is (``alloc``/``free``,
``key_cache``/``value_cache``, ``copy_blocks``, the hooks, ``wake``), over
tensors allocated up front, so the same engine runs on either. It is the
baseline ``bench/multitenant.py`` measures the daemon's KV against, and lets
engine tests run without a daemon.

Invariants: every block id in ``[0, num_blocks)`` is either free (in the free
list, once) or allocated; ``alloc`` is all-or-nothing. It never sleeps.

Cost: memory for all ``num_blocks`` is taken at construction; ``alloc(n)`` and
``free(ids)`` are O(n) list operations with no lock (one engine thread).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvdaemon.client.allocator import check_id_list
from kvdaemon.client.spec import KVSpec
from kvdaemon.errors import BadRequest, PoolExhausted


class LocalPool:
    """``num_blocks`` blocks of ``spec`` in plain tensors on ``device``; see the module docstring."""

    def __init__(self, spec: KVSpec, num_blocks: int, device: str | torch.device = "cpu") -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise BadRequest(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.spec = spec
        self.name = "local"
        self.num_blocks = num_blocks
        self.block_size = spec.block_size
        self.blocks_per_page = 1  # no pages: every block stands alone
        self.quiesce_hook: Callable[[], None] | None = None
        self.resume_hook: Callable[[], None] | None = None
        self.reclaim_hook: Callable[[int], int] | None = None
        self.grow_wait_s: float | None = None
        self.sleep_mode: str | None = None  # never asleep
        self.num_block_losses = 0  # never loses its blocks
        self.owed_pages = 0  # no daemon asks anything back
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        dtype = getattr(torch, spec.dtype_name)
        self._caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_segments)]
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._allocated = bytearray(num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def key_cache(self, layer: int) -> torch.Tensor:
        return self._caches[2 * self._layer(layer)]

    def value_cache(self, layer: int) -> torch.Tensor:
        return self._caches[2 * self._layer(layer) + 1]

    def _layer(self, layer: int) -> int:
        if not 0 <= layer < self.spec.num_layers:
            raise BadRequest(f"layer {layer} is outside the pool's {self.spec.num_layers} layers")
        return layer

    def _is_live(self, block_id: object) -> bool:
        """Whether ``block_id`` is an int id of an allocated block (a bool is not an id)."""
        return type(block_id) is int and 0 <= block_id < self.num_blocks and bool(self._allocated[block_id])

    def alloc(self, num_blocks: int) -> list[int]:
        """``num_blocks`` free block ids; ``PoolExhausted`` with nothing taken when short."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise BadRequest(f"cannot allocate {num_blocks!r} blocks")
        if num_blocks > len(self._free):
            raise PoolExhausted(f"local pool has {len(self._free)} free blocks, {num_blocks} wanted")
        taken = self._free[len(self._free) - num_blocks:]
        del self._free[len(self._free) - num_blocks:]
        for block_id in taken:
            self._allocated[block_id] = 1
        return taken

    def free(self, block_ids: list[int]) -> None:
        """Return blocks (a list or tuple of ints); BadRequest (nothing freed) for anything else
        and on an unknown, repeated or free id."""
        check_id_list(block_ids, "free() takes")
        seen = set()
        for block_id in block_ids:
            if not self._is_live(block_id) or block_id in seen:
                raise BadRequest(f"block {block_id!r} is not allocated in this pool")
            seen.add(block_id)
        for block_id in block_ids:
            self._allocated[block_id] = 0
        self._free.extend(block_ids)

    def free_later(self, block_ids: list[int]) -> None:
        """Free blocks now, dropping ids that are not allocated (a finalizer's call: never raises)."""
        live = [b for b in dict.fromkeys(block_ids) if self._is_live(b)]
        self.free(live)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy K and V of every layer from ``src[i]`` to ``dst[i]``; BadRequest (nothing copied)
        unless both are lists (or tuples) of allocated ids of equal length."""
        check_id_list(src, "copy_blocks: src must be")
        check_id_list(dst, "copy_blocks: dst must be")
        if len(src) != len(dst):
            raise BadRequest(f"copy_blocks: {len(src)} sources for {len(dst)} destinations")
        for block_id in (*src, *dst):
            if not self._is_live(block_id):
                raise BadRequest(f"copy_blocks: block {block_id!r} is not an allocated block of this pool")
        if not src:
            return
        index_src = torch.tensor(src, device=self._caches[0].device)
        index_dst = torch.tensor(dst, device=self._caches[0].device)
        for cache in self._caches:
            cache.index_copy_(0, index_dst, cache.index_select(0, index_src))

    def keep_free(self, num_blocks: int, num_spare_blocks: int = 0, num_ahead_blocks: int = 0) -> None:
        """Nothing to do: every block is allocated up front."""

    def wake(self) -> None:
        """Never asleep: nothing to do."""

    def note_activity(self) -> None:
        """No daemon to tell: nothing to do."""
