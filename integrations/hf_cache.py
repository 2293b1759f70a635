"""``PagedCache``: a transformers ``Cache`` whose K/V live in a pool's blocks (``KVPool``, ``LocalPool``).

``model.generate(input_ids, cache=PagedCache(pool), ...)`` (``past_key_values=``
on a transformers that does not know ``cache=``) runs unchanged: each batch
row is one sequence of a ``BlockManager`` over the pool, and every layer's
``update`` writes the new K/V into that row's slots and returns the row's
whole K/V, gathered from its blocks, as
``[batch, num_kv_heads, length, head_dim]``: the same values ``DynamicCache``
returns, so attention (and its masks) see the same numbers.

Semantics:

- All rows have the same length: a left-padded batch stores its pad positions
  too (the model's attention mask hides them), as ``DynamicCache`` does. Token
  ids are not passed to ``update``, so prefix caching is off.
- The first layer to see a new length grows every row at once, all-or-nothing:
  the blocks for the whole batch are taken from the pool in one ``alloc``, so
  ``PoolExhausted`` leaves the cache and the pool as they were before the call.
  The later layers of the same forward reuse the same slots.
- ``reset()`` frees every block and leaves the cache empty and usable;
  ``close()`` does the same and refuses further updates. Both are idempotent;
  ``with PagedCache(pool) as cache:`` closes on exit. A cache collected without
  ``close()`` hands its blocks to the pool's ``free_later`` (freed by the pool's
  agent within a heartbeat; at once on a ``LocalPool``). The pool is the caller's.
- No gradients: a forward with grad enabled whose K/V require grad is
  ``BadRequest`` before anything is written (run it under ``torch.no_grad()``
  or ``torch.inference_mode()``, as ``generate`` does), so the pool's tensors
  never require grad.
- Unsupported (``BadRequest``): beam search (``reorder_cache``), cropping
  (assisted decoding), re-batching a non-empty cache, a pool whose K/V shape
  or dtype differs from what the model's layers give, or with fewer layers
  (checked as each layer first writes; a pool with more layers than the model
  works, its last ones unused). Models whose attention caches something other
  than per-head K/V (DeepSeek's MLA latent) do not fit a K/V pool: serve them
  with ``Engine``, which probes the model's layout.

Cost per layer and forward: one ``index_copy_`` per K and V for the new tokens
and one ``index_select`` per K and V over the row's blocks (a copy of
``batch * length`` rows, like ``DynamicCache``'s ``torch.cat``). Per forward,
once: a few tensor ops for the new tokens' slots; Python work per row only
when a block fills (every ``block_size`` tokens).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvdaemon.client.block_manager import BlockManager
from kvdaemon.errors import BadRequest, KVDaemonError, PoolExhausted

if TYPE_CHECKING:
    from kvdaemon.client.engine_pool import EnginePool


def _token_major(states: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, D]`` as ``[B * T, H, D]`` rows in (row, token) order; a view when ``T == 1``."""
    if states.shape[2] == 1:
        return states.select(2, 0)
    return states.transpose(1, 2).reshape(-1, states.shape[1], states.shape[3])


class _Reservation:
    """A ``BlockSource`` that hands out blocks taken from the pool beforehand in one ``alloc``.

    ``take(n)`` is the only call that can fail, and it changes nothing when it
    does; the ``BlockManager`` then draws exactly those blocks, so growing many
    sequences is all-or-nothing.
    """

    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.blocks_per_page = pool.blocks_per_page
        self._held: list[int] = []

    @property
    def held(self) -> list[int]:
        """Blocks reserved and not drawn yet."""
        return self._held

    def take(self, n: int) -> None:
        """Reserve ``n`` blocks from the pool; ``PoolExhausted`` with nothing taken."""
        self._held = self.pool.alloc(n) if n else []

    def release(self) -> None:
        """Give back whatever the manager did not draw (nothing, when counts agree)."""
        if self._held:
            self.pool.free(self._held)
            self._held = []

    def alloc(self, n: int) -> list[int]:
        if n > len(self._held):
            raise KVDaemonError(f"internal: {n} blocks drawn from a reservation of {len(self._held)}")
        blocks, self._held = self._held[:n], self._held[n:]
        return blocks

    def free(self, block_ids: list[int]) -> None:
        self.pool.free(block_ids)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        self.pool.copy_blocks(src, dst)


def _orphan_blocks(pool: EnginePool, manager: BlockManager, reservation: _Reservation) -> None:
    """A cache collected without ``close()``: its rows' blocks (and any reserved) go back
    through the pool's ``free_later`` (no lock taken here: a finalizer runs on any thread)."""
    ids, row, num_rows = list(reservation.held), 0, len(manager)
    while num_rows:
        if row in manager:
            ids += manager.block_table(row)
            num_rows -= 1
        row += 1
    free_later = getattr(pool, "free_later", None)
    if ids and free_later is not None:
        free_later(ids)


class PagedLayer(CacheLayerMixin):
    """One decoder layer's view of a ``PagedCache``: its length and its K/V tensors in the pool."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, cache: PagedCache, layer_idx: int) -> None:
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.length = 0
        self.k_cache: torch.Tensor
        self.v_cache: torch.Tensor
        self.k_slots: torch.Tensor
        self.v_slots: torch.Tensor

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Check the model's K/V against the pool's layout; bind the pool's tensors of this layer."""
        self.cache.check_states(key_states, value_states)
        pool = self.cache.pool
        self.device = key_states.device
        self.k_cache = pool.key_cache(self.layer_idx)
        self.v_cache = pool.value_cache(self.layer_idx)
        _, _, heads, dim = self.k_cache.shape
        self.k_slots = self.k_cache.view(-1, heads, dim)
        self.v_slots = self.v_cache.view(-1, heads, dim)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' K/V into their slots; the row's whole K/V, ``[B, H, length, D]``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        slots = self.cache.slots(start, end, key_states.shape[0])
        self.k_slots.index_copy_(0, slots, _token_major(key_states))
        self.v_slots.index_copy_(0, slots, _token_major(value_states))
        self.length = end
        return self.cache.gather(self.k_cache, end), self.cache.gather(self.v_cache, end)

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        """(kv_length, kv_offset) of the next forward: every cached token plus the new ones, from 0.

        Older transformers 5.x releases pass the new tokens' ``cache_position`` tensor instead of their count.
        """
        new = query_length if isinstance(query_length, int) else query_length.shape[0]
        return self.length + new, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        """No fixed maximum: the pool grows on demand (``-1``)."""
        return -1

    def get_max_cache_shape(self) -> int:
        """``get_max_length`` under its name in older transformers 5.x releases."""
        return -1

    def reset(self) -> None:
        """Forget this layer's length; the blocks are freed by ``PagedCache.reset``."""
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        """Only ``crop(0)`` (what greedy decoding may call) is accepted, as a no-op."""
        if tokens_to_remove != 0:
            raise BadRequest("PagedCache cannot be cropped (assisted decoding is not supported)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise BadRequest("PagedCache does not support beam search (reorder_cache)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.cache.check_empty("batch_repeat_interleave")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.cache.check_empty("batch_select_indices")


class PagedCache(Cache):
    """A transformers ``Cache`` over ``pool``'s blocks; see the module docstring."""

    def __init__(self, pool: EnginePool) -> None:
        layers = [PagedLayer(self, i) for i in range(pool.spec.num_layers)]
        super().__init__(layers=layers)
        self.pool = pool
        self.block_size = pool.block_size
        self.device = pool.key_cache(0).device
        self._reservation = _Reservation(pool)
        self.manager = BlockManager(self._reservation, enable_prefix_cache=False)
        self._closed = False
        self._clear()
        self._finalizer = weakref.finalize(self, _orphan_blocks, pool, self.manager, self._reservation)
        self._finalizer.atexit = False

    def _clear(self) -> None:
        self._rows = 0
        self._num_tokens = 0
        self._table = torch.empty(0, 0, dtype=torch.long, device=self.device)
        self._table_flat = self._table.view(-1)
        self._step: tuple[int, int, torch.Tensor] | None = None

    # -- lifecycle -------------------------------------------------------------

    def reset(self) -> None:
        """Free every row's blocks back to the pool; the cache is empty and usable again. O(blocks)."""
        for row in range(self._rows):
            self.manager.free_sequence(row)
        self._clear()
        for layer in self.layers:
            layer.reset()

    def close(self) -> None:
        """``reset()``, then refuse further updates. Idempotent."""
        self.reset()
        self._closed = True
        self._finalizer.detach()

    def __enter__(self) -> PagedCache:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    @property
    def num_blocks(self) -> int:
        """Blocks this cache holds in the pool (all rows)."""
        return self.manager.num_owned_blocks

    # -- transformers entry point ------------------------------------------------

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new K/V of ``layer_idx`` and return the layer's whole K/V (see ``PagedLayer.update``)."""
        if self._closed:
            raise BadRequest("PagedCache is closed")
        if not 0 <= layer_idx < len(self.layers):
            raise BadRequest(f"layer {layer_idx} is outside the pool's {len(self.layers)} layers")
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            raise BadRequest(  # the in-place write would make the pool's tensors require grad, for good
                "PagedCache records no gradients, but the K/V states require grad: run the model under "
                "torch.no_grad() or torch.inference_mode() (model.generate does)"
            )
        return self.layers[layer_idx].update(key_states, value_states)

    # -- shared by the layers ----------------------------------------------------

    def check_states(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """BadRequest unless K/V are ``[B, num_kv_heads, T, head_dim]`` of the pool's dtype and device."""
        spec, cache = self.pool.spec, self.pool.key_cache(0)
        want = (spec.num_kv_heads, spec.head_dim)
        for name, states in (("key", key_states), ("value", value_states)):
            if states.dim() != 4 or (states.shape[1], states.shape[3]) != want:
                raise BadRequest(
                    f"{name} states {list(states.shape)} do not fit the pool's layout "
                    f"[batch, {spec.num_kv_heads}, tokens, {spec.head_dim}]"
                )
            if states.dtype != cache.dtype or states.device != cache.device:
                raise BadRequest(
                    f"{name} states are {states.dtype} on {states.device}; the pool holds "
                    f"{cache.dtype} on {cache.device}"
                )

    def check_empty(self, operation: str) -> None:
        """BadRequest if any token is cached: ``operation`` would change the rows."""
        if self._num_tokens:
            raise BadRequest(f"PagedCache does not support {operation} on a non-empty cache")

    def slots(self, start: int, end: int, batch_size: int) -> torch.Tensor:
        """Slots of positions ``start .. end-1`` of every row, row-major, ``[batch * (end - start)]``.

        Grows every row to ``end`` tokens first when ``end`` is past them
        (all-or-nothing, see ``_grow``). Memoised for the current forward.
        """
        if self._rows and batch_size != self._rows:
            raise BadRequest(f"batch size changed from {self._rows} to {batch_size}; reset the cache first")
        step = self._step
        if step is not None and step[0] == start and step[1] == end:
            return step[2]
        if end > self._num_tokens:
            if start != self._num_tokens:
                raise BadRequest(f"a layer wrote positions {start}..{end} of rows holding {self._num_tokens}")
            self._grow(end, batch_size)
        size = self.block_size
        if end - start == 1:
            slots = self._table.select(1, start // size) * size + start % size
        else:
            positions = torch.arange(start, end, device=self.device)
            table = self._table.index_select(1, positions // size)
            slots = (table * size + positions % size).view(-1)
        self._step = (start, end, slots)
        return slots

    def gather(self, cache: torch.Tensor, length: int) -> torch.Tensor:
        """The first ``length`` tokens of every row of ``cache`` as a ``[B, H, length, D]`` view.

        One ``index_select`` of the rows' blocks into a fresh ``[B, blocks * block_size, H, D]``
        tensor, viewed head-major without a copy.
        """
        _, _, heads, dim = cache.shape
        rows = cache.index_select(0, self._table_flat)
        row_stride = rows.numel() // self._rows if self._rows else 0
        return rows.as_strided((self._rows, heads, length, dim), (row_stride, dim, heads * dim, 1))

    # -- growth ----------------------------------------------------------------

    def _grow(self, end: int, batch_size: int) -> None:
        """Extend every row to ``end`` tokens; PoolExhausted changes nothing."""
        old_blocks = self._table.shape[1]
        new_blocks = -(-end // self.block_size) - old_blocks
        try:
            self._reservation.take(batch_size * new_blocks)
        except PoolExhausted as exc:
            raise PoolExhausted(
                f"PagedCache: the pool cannot hold {batch_size} x {new_blocks} more blocks to grow "
                f"{batch_size} sequence(s) from {self._num_tokens} to {end} tokens "
                f"({self.num_blocks} blocks held): {exc.message}"
            ) from exc
        filler = [0] * (end - self._num_tokens)
        for row in range(batch_size):
            if self._rows:
                self.manager.append_tokens(row, filler)
            else:
                self.manager.add_sequence(row, filler)
        self._reservation.release()
        self._rows = batch_size
        self._num_tokens = end
        if new_blocks:
            fresh = [self.manager.block_table(row)[old_blocks:] for row in range(batch_size)]
            old = self._table.view(batch_size, old_blocks)
            self._table = torch.cat([old, torch.tensor(fresh, device=self.device)], dim=1)
            self._table_flat = self._table.view(-1)
