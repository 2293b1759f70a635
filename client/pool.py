"""``KVPool``: one tenant's KV cache over reserved virtual ranges, backed on demand.

Each segment is one reserved range of ``num_virtual_pages`` pages, viewed as a
tensor that never moves (``KVSpec.segment_shape``): in the default ``split``
layout K and V of every layer are separate segments
``[num_blocks, block_size, num_kv_heads, head_dim]`` (``key_cache(l)``,
``value_cache(l)``); in the ``joint`` layout (vLLM's) one segment per layer
holds a block's K and V together (``segment(l)``). Block ids and the tensors
stay valid for the life of the pool. Physical pages are mapped
under the views only while blocks need them:

- ``alloc(n)`` takes blocks from mapped pages (``BlockAllocator``: fullest page
  first); when too few are free it asks the daemon, in one grow, for the pages
  missing plus ``num_prefetch_pages`` ahead as far as its limit allows. If the
  limit or the daemon refuses, ``PoolExhausted`` is raised and nothing is
  allocated. A grow the free pages cannot serve waits for other tenants to give
  pages back up to ``grow_wait_s`` (``None``: the daemon's 2 s; ``0``: refuse at once).
- ``free(ids)`` returns blocks locally and never waits on the daemon; spare pages
  past ``num_spare_pages`` go back from the pool's agent thread at its next
  tick (``HEARTBEAT_S``), so a page freed and taken again at once (a cache
  eviction making room) never costs a round trip; pages the daemon asked back
  go at once.
- The agent answers the daemon (reclaim, sleep, wake, limit changes,
  revocation, restarts) even while the engine is idle; see ``client/README.md``
  for the threads, locks and hooks.

The pool's state is one ``PoolState`` (``pool.state``). After ``close()`` every
method raises ``PoolClosed``. Cost: ``alloc``/``free`` are O(blocks); while blocks are free and mapped they
take no lock (only the block gate, see ``pool_lock``) and no daemon round trip.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from kvdaemon.client.allocator import check_id_list
from kvdaemon.client.control import ControlChannel
from kvdaemon.client.lease import Lease
from kvdaemon.client.pool_agent import PoolAgent
from kvdaemon.client.pool_core import PoolCore
from kvdaemon.client.pool_state import PoolState
from kvdaemon.client.spec import KVSpec
from kvdaemon.errors import Asleep, BackendError, BadRequest, DaemonUnreachable, NoReply, PoolClosed, UnknownTenant

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvdaemon.client.pool")
WAKE_WAIT_S = 60.0  # ``wake()`` waits this long for its pages before saying it is still on its way
REJOIN_WAIT_S = 5.0  # ``wake()`` of a pool whose daemon restarted waits this long for it to re-join


class KVPool:
    """A registered tenant's paged KV cache (see the module docstring)."""

    def __init__(
        self,
        lease: Lease,
        spec: KVSpec,
        num_virtual_pages: int,
        num_spare_pages: int = 2,
        num_prefetch_pages: int = 1,
        auto_wake: bool = False,
        relink: Callable[[], Lease] | None = None,
        on_close: Callable[[KVPool], None] | None = None,
    ) -> None:
        self.core = PoolCore(lease, spec, num_virtual_pages, num_spare_pages, num_prefetch_pages)
        self.spec = spec
        self.name = lease.name
        self.auto_wake = auto_wake
        self.num_blocks = self.core.allocator.num_blocks
        self.block_size = spec.block_size
        self.blocks_per_page = self.core.allocator.blocks_per_page
        self.agent = PoolAgent(self.core, relink)
        self._gate = self.core.lock.gate  # the block gate's token slot (``PoolLock``)
        self._mapped = self.core.segments.pages  # the mapped logical pages (one dict for the pool's life)
        self._on_close = on_close
        self._caches: list[torch.Tensor] = []

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> None:
        """Reserve the ranges, build the tensor views, start the background agent."""
        import torch

        dtype = getattr(torch, self.spec.segment_dtype_name)
        view_bytes = self.num_blocks * self.spec.block_bytes
        shape = self.spec.segment_shape(self.num_blocks)
        segments = self.core.segments
        segments.reserve()
        try:  # whatever fails before the agent runs, the ranges go back
            self._caches = [segments.view(s, view_bytes, dtype).view(shape) for s in range(self.spec.num_segments)]
            self.agent.listen(self.core.lease)
            self.agent.start()
        except BaseException:
            self._caches = []
            segments.free_ranges()
            raise

    def close(self) -> None:
        """Give every page back, unregister, and free the ranges. Idempotent. A pool with
        pages a failed map left mapped (``SegmentMap.stuck``) closes its lease without
        unregistering: the daemon holds its pages until this process maps none.

        The tensors must not be used afterwards; every other method raises ``PoolClosed``.
        """
        core = self.core
        if core.state is PoolState.CLOSED:
            return
        self.agent.stop()
        try:
            with core.lock:
                core.cell.move(PoolState.CLOSED)
                self._drop_and_end_lease()
        finally:
            with core.lock:
                self._caches.clear()
                core.segments.free_ranges()
            if self._on_close is not None:
                self._on_close(self)

    def _drop_and_end_lease(self) -> None:
        """Unmap every page and unregister (lock held). Where the OS keeps some mapped (an unmap
        refused, or ``stuck`` pages), unregistering would free them while this process maps them:
        the pages that did unmap go back, and the lease ends without unregistering, so the daemon
        holds the rest (quarantined) until this process maps none."""
        core = self.core
        held = list(core.segments.pages)
        try:
            core.drop_all_pages()
        except BackendError as exc:
            log.error("pool %s: its pages could not all be unmapped at its close: %s", core.name, exc.message)
        mapped = set(core.segments.pages) | (core.segments.stuck.keys() - core.old_stuck)
        if not mapped:
            core.lease.close()
            return
        log.error("pool %s closes without unregistering: %d logical page(s) stay mapped here, which its daemon "
                  "keeps (quarantined) until this process maps none", core.name, len(mapped))
        core.give_back([lp for lp in held if lp not in mapped])
        core.lease.abandon()

    def __enter__(self) -> KVPool:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- state -----------------------------------------------------------------

    @property
    def state(self) -> PoolState:
        return self.core.state

    @property
    def sleep_mode(self) -> str | None:
        """``"warm"``/``"cold"`` while asleep (or going to sleep is decided), else ``None``: the
        mode the pool went to sleep in (a warm sleep the daemon makes cold meanwhile reads
        ``"warm"`` until the wake, which then counts a block loss: ``num_block_losses``)."""
        return {PoolState.ASLEEP_WARM: "warm", PoolState.ASLEEP_COLD: "cold"}.get(self.core.state)

    @property
    def lease(self) -> Lease:
        return self.core.lease

    def _check_open(self) -> None:
        if self.core.state is PoolState.CLOSED:
            raise PoolClosed(f"pool {self.name!r} is closed")

    # -- hooks and knobs (the engine sets them; the agent runs them) ------------

    @property
    def quiesce_hook(self) -> Callable[[], None] | None:
        return self.core.quiesce_hook

    @quiesce_hook.setter
    def quiesce_hook(self, hook: Callable[[], None] | None) -> None:
        self.core.quiesce_hook = hook
        self.agent.nudge()  # the daemon learns at once whether it may sleep this pool

    @property
    def resume_hook(self) -> Callable[[], None] | None:
        return self.core.resume_hook

    @resume_hook.setter
    def resume_hook(self, hook: Callable[[], None] | None) -> None:
        """Run by the agent once a sleep is decided or a move is done (not the move of a pool
        asleep, whose quiesce hook did not run either). The pool may be asleep when it runs:
        until it is awake no block's tensors may be touched (their pages are unmapped; see
        client/README.md, Hooks)."""
        self.core.resume_hook = hook

    @property
    def reclaim_hook(self) -> Callable[[int], int] | None:
        return self.core.reclaim_hook

    @reclaim_hook.setter
    def reclaim_hook(self, hook: Callable[[int], int] | None) -> None:
        self.core.reclaim_hook = hook

    @property
    def return_gate(self) -> Callable[[], AbstractContextManager[bool]] | None:
        return self.core.return_gate

    @return_gate.setter
    def return_gate(self, gate: Callable[[], AbstractContextManager[bool]] | None) -> None:
        """Entered by the agent around every return of spare pages it makes by itself (a
        reclaim's, a lowered limit's, the excess past the spare allowance); it yields whether
        pages may go now (False: they go at a later wake-up, or are owed). An engine that
        counts ``num_free_blocks`` and takes them later holds it across the two (client/README.md, Hooks)."""
        self.core.return_gate = gate

    @property
    def grow_wait_s(self) -> float | None:
        return self.core.grow_wait_s

    @grow_wait_s.setter
    def grow_wait_s(self, wait_s: float | None) -> None:
        """``None`` (the daemon's default) or seconds from 0 to the daemon's ``reclaim_wait_s``
        (``BadRequest`` else)."""
        self.core.grow_wait_s = check_wait_s(wait_s, self.core.most_wait_s)

    @property
    def num_block_losses(self) -> int:
        """Times every block was dropped (a cold sleep, waking empty after a daemon restart, or
        a wake that found a warm sleep made cold). Read it after every wake."""
        return self.core.num_block_losses

    # -- tensors ---------------------------------------------------------------

    def key_cache(self, layer: int) -> torch.Tensor:
        """K of ``layer``: ``[num_blocks, block_size, num_kv_heads, head_dim]``, fixed address."""
        self._check_open()
        return self._caches[self.spec.key_segment(layer)]

    def value_cache(self, layer: int) -> torch.Tensor:
        """V of ``layer``, same shape as ``key_cache``."""
        self._check_open()
        return self._caches[self.spec.value_segment(layer)]

    def segment(self, index: int) -> torch.Tensor:
        """Segment ``index``'s view (``spec.segment_shape``), fixed address; block b is row b."""
        self._check_open()
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self._caches):
            raise BadRequest(f"segment {index!r} is outside the pool's segments 0..{len(self._caches) - 1}")
        return self._caches[index]

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy K and V of every layer from blocks ``src`` to blocks ``dst``.

        Every id must be a block this pool handed out and not freed (so its pages
        are mapped): anything else, or ``src``/``dst`` not lists (or tuples) of
        ids, is ``BadRequest`` and nothing is copied. Asleep, the blocks' pages
        are not mapped: ``Asleep`` (nothing copied) unless the pool has
        ``auto_wake``, which wakes it first (as ``alloc`` does).
        """
        import torch

        self._check_open()
        check_id_list(src, "copy_blocks: src must be")
        check_id_list(dst, "copy_blocks: dst must be")
        if len(src) != len(dst):
            raise BadRequest(f"copy_blocks: {len(src)} sources for {len(dst)} destinations")
        if self.core.state.asleep:
            if not self.auto_wake:
                raise Asleep(f"copy_blocks: pool {self.name!r} is {self.core.state.value}; wake it first")
            self.wake()
        allocator = self.core.allocator
        for block in (*src, *dst):
            if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < self.num_blocks \
                    or not allocator.is_live(block):  # fmt: skip
                raise BadRequest(f"copy_blocks: block {block!r} is not a live block of pool {self.name!r}")
        device = self._caches[0].device
        src_t = torch.tensor(src, dtype=torch.long, device=device)
        dst_t = torch.tensor(dst, dtype=torch.long, device=device)
        for cache in self._caches:
            cache.index_copy_(0, dst_t, cache.index_select(0, src_t))

    # -- blocks ----------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Free blocks on mapped pages (more can be mapped on demand)."""
        return self.core.allocator.num_free

    @property
    def num_allocatable_blocks(self) -> int:
        """Free blocks ``alloc`` hands out now without a grow: the free ones, less those on pages
        mapped past a lowered limit (they stay free so the pages empty and go back). O(1)."""
        core = self.core
        return max(0, core.allocator.num_free - core.pages_over_limit() * core.allocator.blocks_per_page)

    @property
    def num_used_blocks(self) -> int:
        return self.core.allocator.num_live

    def scarce_free_blocks(self) -> int | None:
        """While the daemon has no memory to spare (it refused this pool a grow ahead of
        need within the last ``REFUSED_S`` and granted none since, or the pool recycles its
        cache: ``PoolCore.recycles``), the blocks free here without a round trip; ``None``
        otherwise. An engine then reuses its own cached
        blocks before taking the daemon's last free pages, which are kept for real need
        (``BlockManager``). O(1), no lock: a hint, as stale as the agent's last step
        (the refusal) or the last heartbeat reply (recycling)."""
        core = self.core
        return core.allocator.num_free if core.scarce() or core.recycles() else None

    @property
    def used_bytes(self) -> int:
        return self.core.allocator.num_live * self.spec.block_bytes * self.spec.num_segments

    @property
    def mapped_bytes(self) -> int:
        return self.core.mapped_bytes

    @property
    def backend(self) -> Any:
        """This process's virtual-memory backend the pool maps through."""
        return self.core.backend

    @property
    def page_bytes(self) -> int:
        """Bytes of one physical page (a logical page is one per segment)."""
        return self.core.page_bytes

    @property
    def num_virtual_pages(self) -> int:
        return self.core.num_virtual_pages

    @property
    def owed_pages(self) -> int:
        """Pages owed to the daemon, still in use: they go back as blocks are freed. Those an
        urgent reclaim asked for lapse ``pool_agent.OWED_S`` after the last ask; those mapped past
        the known limit are owed while they are (``PoolCore.owed_pages``)."""
        return self.core.owed_pages

    @property
    def max_bytes(self) -> int | None:
        """The limit the daemon last told this pool (``None`` if it never did)."""
        return self.core.max_bytes

    def alloc(self, num_blocks: int) -> list[int]:
        """``num_blocks`` block ids over mapped memory; ``PoolExhausted`` with nothing taken.

        A pool mapping pages past a lowered limit gives out only the free blocks
        beyond those pages' worth: the rest stay free so that the pages empty and
        go back (``PoolExhausted`` names the limit), as the ``Engine`` admits no
        request into them. Also raises ``Asleep`` (asleep without ``auto_wake``),
        ``DaemonUnreachable`` (the daemon is gone, or ``NoReply``: slow),
        ``PoolClosed``. When the blocks are free and mapped and the pool is within
        its limit it takes only the block gate (``PoolLock``).
        """
        gate = self._gate
        try:
            gate.pop()  # the block gate's token (``PoolLock.try_enter``, inlined)
        except IndexError:
            return self._alloc_locked(num_blocks)
        try:
            core = self.core
            allocator = core.allocator
            if (type(num_blocks) is int and 0 < num_blocks <= allocator.num_free  # 0: the slow path checks state
                    and len(self._mapped) <= core.max_pages):  # past a limit: the slow path counts
                return allocator.alloc(num_blocks)
        finally:
            gate.append(True)
        return self._alloc_locked(num_blocks)

    def _alloc_locked(self, num_blocks: int) -> list[int]:
        """The slow path: the lock held, growing (or waking) first when too few blocks are free."""
        if type(num_blocks) is not int or num_blocks < 0:
            raise BadRequest(f"cannot allocate {num_blocks!r} blocks")
        core = self.core
        with core.lock:
            if core.cell.ended:
                raise PoolClosed(f"pool {self.name!r} is {core.state.value}")
            if num_blocks > core.allocator.num_free:
                if core.state.asleep and self.auto_wake:
                    return self._alloc_after_wake(num_blocks)
                core.grow_for(num_blocks)
            core.check_limit_debt(num_blocks)
            return core.allocator.alloc(num_blocks)

    def keep_free(self, num_blocks: int, num_spare_blocks: int = 0, num_ahead_blocks: int = 0) -> None:
        """Keep about ``num_blocks`` blocks free and mapped for the engine's next steps.

        The agent maps pages ahead in the background when fewer are free (so
        ``alloc`` finds them without a round trip), and returns no spare page,
        also on a reclaim, that would leave fewer free. A lowered limit still
        binds. ``num_spare_blocks``: spare pages up to this many blocks are not
        returned at the agent's tick either (more than ``num_spare_pages``), but
        unlike the reserve a reclaim or the daemon's ask takes them and the agent
        does not map them ahead (an idle engine keeps its last step's pages while
        nobody needs them). ``num_ahead_blocks``: a floor the agent maps ahead
        too, *ahead of need* (requests that may arrive before the next step),
        kept at the tick like spare and given up to a reclaim like spare; the
        daemon grants it only from memory free above its low-water mark, asks
        no other tenant for it, and does not count its refusal as a shortage.
        While the pool recycles its cache (``PoolCore.recycles``) the agent is
        not woken here: its engine's allocations evict their own cached blocks
        first, and the agent makes the reserve from the cache at its tick (a
        reserve the cache cannot cover is grown by the allocation that needs it).
        The floor is mapped only once the reserve is free, so only then does a
        floor wake the agent.
        A reserve past the limit maps up to the limit. A count outside
        ``[0, num_blocks of the pool]`` raises ``BadRequest`` (nothing
        changed). Never waits; ``0`` (the default) keeps nothing back.
        """
        self._check_open()
        core = self.core
        for count in (num_blocks, num_spare_blocks, num_ahead_blocks):
            if type(count) is not int or not 0 <= count <= core.allocator.num_blocks:
                raise BadRequest(
                    f"cannot keep {count!r} blocks free: a count in [0, {core.allocator.num_blocks}] "
                    "(the pool's virtual capacity) is needed"
                )
        core.reserve_blocks, core.spare_blocks, core.ahead_blocks = num_blocks, num_spare_blocks, num_ahead_blocks
        free, agent = core.allocator.num_free, self.agent
        due = (free < num_blocks and agent.grow_due()) or (  # the floor only once the reserve is free
            num_blocks <= free < num_ahead_blocks and agent.grow_due(floor=True))
        if due and core.headroom_pages() > 0 and not core.recycles():
            agent.nudge()  # (at its limit there is nothing to map; after a refusal the agent waits)

    def _alloc_after_wake(self, num_blocks: int) -> list[int]:
        """Asleep with ``auto_wake``: wake (without the lock: the agent maps under it), then allocate."""
        core = self.core
        core.lock.release()
        try:
            self.wake()
        finally:
            core.lock.acquire()
        if num_blocks > core.allocator.num_free:
            core.grow_for(num_blocks)
        return core.allocator.alloc(num_blocks)

    def free(self, block_ids: list[int]) -> None:
        """Return blocks. Local: never waits on the daemon, never fails for valid ids.

        ``block_ids``: a list (or tuple) of ints, as ``alloc`` returns them.
        Raises ``BadRequest`` (nothing freed) for anything else (one int, ``None``,
        a tensor or array: pass ``.tolist()``) and for an id that is not
        allocated, ``PoolClosed`` after close. Takes only the block gate unless a
        lock holder has it.
        """
        if type(block_ids) is not list and not isinstance(block_ids, tuple):
            check_id_list(block_ids, "free() takes")
        core = self.core
        gate = self._gate
        try:
            gate.pop()  # the block gate's token (``PoolLock.try_enter``, inlined)
        except IndexError:
            with core.lock:
                self._free_held(block_ids)
        else:
            try:
                if core.cell.ended or core.sleeping_allocator is not None:
                    self._free_held(block_ids)
                else:
                    core.allocator.free(block_ids)
            finally:
                gate.append(True)
        if (core.asked_pages or len(self._mapped) > core.max_pages) and core.has_excess():
            self.agent.nudge()  # owed (``owed_pages``, inlined: plain reads on the fast path): now, not at the tick

    def free_later(self, block_ids: list[int]) -> None:
        """Hand blocks to the pool's agent to free at its next wake-up (within a heartbeat).
        Takes no lock and never raises: for a finalizer, which may run on any thread,
        inside a lock holder; ids already free, of a closed pool, or from before a loss of
        every block (a cold sleep) are dropped then."""
        self.core.orphaned.append((self.core.num_block_losses, list(block_ids)))

    def _free_held(self, block_ids: list[int] | tuple[int, ...]) -> None:
        """Free into the allocator that holds the blocks (the block gate held)."""
        core = self.core
        if core.cell.ended:
            raise PoolClosed(f"pool {self.name!r} is {core.state.value}")
        sleeping = core.sleeping_allocator  # warm sleep: the blocks live on
        (core.allocator if sleeping is None else sleeping).free(block_ids)

    def wake(self) -> None:
        """Wake this pool (its own lease asks the daemon); returns once its pages are mapped.

        A no-op when awake. Raises the daemon's error (``NoMemory``...), or
        ``NoReply`` if the pages did not arrive within ``WAKE_WAIT_S`` (the wake
        goes on). Call without holding anything the agent needs. When the
        daemon that put the pool to sleep is gone and another runs (it knows
        no such tenant), the agent re-joins that one now and the pool wakes
        empty (its warm copy died with the old daemon; a block loss), within
        ``REJOIN_WAIT_S``, else ``DaemonUnreachable``.
        """
        core = self.core
        if not (core.state.asleep or core.state is PoolState.SLEEP_PENDING):
            self._check_open()
            return
        num_wakes = core.cell.num_wakes
        try:
            core.lease.wake()
        except UnknownTenant as exc:
            self._wait_rejoined(exc)
            return
        if not self.wait_woken(num_wakes, WAKE_WAIT_S):
            raise NoReply(f"pool {self.name!r}: the daemon woke it, its pages are still on their way")
        if core.state.ended:
            raise PoolClosed(f"pool {self.name!r} is {core.state.value}")

    def _wait_rejoined(self, refusal: UnknownTenant) -> None:
        """The daemon running now never registered this pool: its own is gone. Have the agent
        re-join now (an asleep pool moves without its hooks: its engine holds no KV) and wait
        for it; ``DaemonUnreachable`` when it has not within ``REJOIN_WAIT_S``."""
        self.agent.nudge()
        if not self.wait_state(lambda state: not state.asleep, REJOIN_WAIT_S):
            raise DaemonUnreachable(
                f"pool {self.name!r}: the daemon that put it to sleep is gone and the one running has not "
                f"taken it back yet ({refusal.message}); it wakes empty once it has (its log says why not)"
            ) from refusal
        self._check_open()

    def sleep(self, mode: str = "warm") -> dict[str, Any]:
        """Put this pool to sleep on its owner's word (no quiesce hook needed: the caller
        promises not to touch the KV until it wakes). Returns once asleep here too (or woken
        again already: an engine's next step may wake it), within ``WAKE_WAIT_S``."""
        self._check_open()
        core = self.core
        lease, num_sleeps = core.lease, core.cell.num_sleeps
        channel = ControlChannel(lease.paths, lease.timeout_s)  # not the lease's: its agent answers on that
        try:
            result = channel.call("sleep", {"name": self.name, "mode": mode, "token": lease.token}, WAKE_WAIT_S)
        finally:
            channel.close()
        if str(result.get("state", "")).startswith("sleeping"):  # the daemon's word lands here a moment later
            self._wait_locked(lambda left: core.cell.wait_slept(num_sleeps, left), WAKE_WAIT_S)
        return result

    def note_activity(self) -> None:
        """Tell the daemon (at the agent's next heartbeat) that the engine is busy, so idle
        time (``kvdaemon wait --idle``, the idle policy) counts from its last step, not from
        its last block change. O(1), no lock, no round trip."""
        self._check_open()
        self.core.active = True

    def wait_state(self, accept: Callable[[PoolState], bool], timeout_s: float) -> bool:
        """Wait until the pool's state satisfies ``accept``; False on timeout (which counts the
        wait for the pool's lock, held by its agent while it maps a wake)."""
        return self._wait_locked(lambda left: self.core.cell.wait_for(accept, left), timeout_s)

    def wait_woken(self, num_wakes: int, timeout_s: float) -> bool:
        """Wait until the pool is awake or has woken more than ``num_wakes`` times in all
        (``core.cell.num_wakes``, read before asking for the wake: a sleep may follow the wake
        before this looks), or ended; False on timeout (the wait for the lock counted)."""
        return self._wait_locked(lambda left: self.core.cell.wait_woken(num_wakes, left), timeout_s)

    def _wait_locked(self, wait: Callable[[float], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        if not self.core.lock.acquire(timeout=max(0.0, timeout_s)):
            return False
        try:
            return wait(max(0.0, deadline - time.monotonic()))
        finally:
            self.core.lock.release()


def check_wait_s(wait_s: object, most_s: float = math.inf) -> float | None:
    """``wait_s`` as a grow's wait: ``None``, or a number in [0, ``most_s``]; else ``BadRequest``."""
    if wait_s is None:
        return None
    if (isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not math.isfinite(wait_s)
            or not 0 <= wait_s <= most_s):  # fmt: skip
        bound = "" if math.isinf(most_s) else f" (this daemon lets a grow wait at most {most_s:g} s)"
        raise BadRequest(f"grow_wait_s must be None or seconds from 0, got {wait_s!r}{bound}")
    return float(wait_s)
