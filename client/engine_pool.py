"""``EnginePool``: what an engine needs of a pool of KV blocks.

``KVPool`` (daemon memory) and ``LocalPool`` (plain tensors) both satisfy it, so
``kvdaemon.integrations.hf.Engine`` runs over either. It extends the
``BlockManager``'s ``BlockSource`` (blocks: ``alloc``/``free``/``copy_blocks``)
with the per-layer K/V tensors, the layout, the sleep state the engine reads, and
the hooks it installs. Optional, read with ``getattr`` (a pool without it is
still one): ``scarce_free_blocks()``, while more blocks would come from memory the
pool's provider keeps for real need the blocks free now, else ``None``
(``KVPool``'s; the engine's ``BlockManager`` then reuses its own cached blocks
first). Importing this module imports neither torch nor the daemon client.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvdaemon.client.block_manager import BlockSource
from kvdaemon.client.spec import KVSpec

if TYPE_CHECKING:
    import torch


@runtime_checkable
class EnginePool(BlockSource, Protocol):
    """A paged KV cache an engine runs over (``KVPool``, ``LocalPool``).

    Blocks ``[0, num_blocks)`` of ``spec.block_size`` tokens; ``key_cache(layer)``
    and ``value_cache(layer)`` are ``[num_blocks, block_size, num_kv_heads,
    head_dim]`` tensors at fixed addresses. The engine sets the hooks and
    ``grow_wait_s`` and clears the hooks when it closes.
    """

    spec: KVSpec
    num_blocks: int
    sleep_mode: str | None
    """``None`` while awake; the engine calls ``wake()`` before a step otherwise."""
    num_block_losses: int
    """Times every block's contents were dropped (cold sleep): the engine recomputes then."""
    grow_wait_s: float | None
    owed_pages: int
    """Logical pages the daemon asked back for another tenant's need, still in use: they go
    back as their blocks are freed, so the engine admits no new request into them (until
    they lapse, ``pool_agent.OWED_S`` after the last ask)."""
    quiesce_hook: Callable[[], None] | None
    resume_hook: Callable[[], None] | None
    reclaim_hook: Callable[[int], int] | None

    def key_cache(self, layer: int) -> torch.Tensor:
        """K of ``layer``."""
        ...

    def value_cache(self, layer: int) -> torch.Tensor:
        """V of ``layer``, same shape as ``key_cache``."""
        ...

    def wake(self) -> None:
        """Return once the pool is awake; raises (``Asleep``, ``NoMemory``...) if it cannot be yet."""
        ...

    def note_activity(self) -> None:
        """The engine ran a step over the pool: it is busy, whatever its blocks do."""
        ...

    def keep_free(self, num_blocks: int, num_spare_blocks: int = 0, num_ahead_blocks: int = 0) -> None:
        """A hint: the engine's next steps will take about ``num_blocks`` blocks (a pool may
        map them ahead and keep them from others), up to ``num_spare_blocks`` spare ones
        may stay mapped until someone else needs them, and ``num_ahead_blocks`` may be
        mapped ahead of need while memory is plentiful, given up like spare ones; a fixed
        pool ignores it."""
        ...
