"""Sleep and wake of a pool, run by its agent thread when the daemon asks.

Sleep (``sleep_pool``), in the order that keeps both sides agreeing:

1. a pool without a quiesce hook cannot know that its user is not touching the
   KV, so unless the pool's owner asked for the sleep itself it answers
   ``sleep_ready(refused)`` and nothing changes;
2. the engine's quiesce hook returns (its step is done, and it takes no other
   until the resume hook runs);
3. holding the pool's lock: a warm sleeper first gives its spare pages back
   (pages without a block, but logical page 0: nothing to save on them); every
   page is unmapped (handles kept), the state
   is ``SLEEP_PENDING``, and the daemon is told ``sleep_ready``. The pool waits
   for the daemon's decision as long as the daemon lives, however long a warm
   save takes: a timeout is not a decision;
4. accepted: the handles are released, and grows still waiting for their
   reply are dropped (the daemon took what they granted back with the rest); a
   warm pool keeps its allocator aside (block ids stay valid), a cold one drops it. Refused (the daemon cancelled the
   sleep) or the daemon died: the same pages are mapped back, nothing lost.

Wake (``wake_pool``): the daemon's grant is imported and mapped at the same
logical pages (same addresses); a warm pool gets its allocator back (with any
page granted late before the sleep as a spare page), a cold one a fresh one.
Pages this process cannot import or map (the OS out of memory) go back to the
daemon, and the pool wakes without its blocks (``num_block_losses``), so both
sides count the same pages; a refused sleep's map back does the same.
From the unmap at the sleep to the wake (or the map back of a refused sleep), the
pool holds the part of its process's cap on memory mappings that its pages made
(``SegmentMap.hold``), so the other pools of the process cannot take the room its
wake needs (the host backend's cap: ``vm.max_map_count``).

Cost: one unmap and one map per page and segment, one round trip each way.
"""

from __future__ import annotations

import logging

from kvdaemon.client.pool_core import PoolCore
from kvdaemon.client.pool_state import PoolState
from kvdaemon.cuda_vmm.backend import PhysicalPage
from kvdaemon.errors import BackendError, DaemonUnreachable, KVDaemonError
from kvdaemon.wire.messages import SleepNotice, WakeNotice

log = logging.getLogger("kvdaemon.client.pool")


def sleep_pool(core: PoolCore, notice: SleepNotice) -> None:
    """Answer the daemon's sleep ``notice`` (see the module docstring)."""
    if core.quiesce_hook is None and not notice.by_owner:
        log.warning("pool %s: cannot be put to sleep without a quiesce hook; refused", core.name)
        core.lease.sleep_ready(notice.sleep_id, refused=True)
        return
    if core.quiesce_hook is not None:
        core.quiesce_hook()
    try:
        _sleep_quiesced(core, notice)
    finally:
        if core.resume_hook is not None:
            core.resume_hook()


def _sleep_quiesced(core: PoolCore, notice: SleepNotice) -> None:
    with core.lock:
        if core.state is not PoolState.ACTIVE:
            core.lease.sleep_ready(notice.sleep_id, refused=True, why=f"the pool is {core.state.value}")
            return
        core.free_stuck()
        num_stuck = core.num_stuck_counted()  # a dead daemon's are not this one's to free
        if num_stuck:  # the daemon frees a sleeper's pages: none may stay mapped here
            log.warning("pool %s: sleep %d refused: %d page(s) a failed map left mapped could not be unmapped",
                        core.name, notice.sleep_id, num_stuck)
            core.lease.sleep_ready(notice.sleep_id, refused=True, why=f"{num_stuck} page(s) a failed map left mapped")
            return
        if notice.mode == "warm":
            core.return_all_spare()  # empty pages are not worth a copy to host memory
        allocator = core.allocator
        made = core.segments.mappings_made()
        try:
            pages = core.segments.unmap_all()
        except BackendError as exc:  # nothing was unmapped (``unmap_pages`` maps its runs back)
            log.warning("pool %s: sleep %d refused: its pages could not be unmapped (%s)",
                        core.name, notice.sleep_id, exc.message)
            core.lease.sleep_ready(notice.sleep_id, refused=True,
                                   why=f"its pages could not be unmapped ({exc.message})")
            return
        core.segments.hold(made)  # room under the process's map cap to map them back (refused, or a warm wake)
        core.allocator = core.new_allocator()
        core.cell.move(PoolState.SLEEP_PENDING)
        try:
            core.lease.sleep_ready(notice.sleep_id)
        except KVDaemonError as exc:
            core.segments.release_hold()
            whole = _map_back(core, pages, f"back after sleep {notice.sleep_id} was not done")
            if whole:
                core.allocator = allocator
            else:
                _lose_blocks(core)
            gone = isinstance(exc, DaemonUnreachable)
            core.cell.move(PoolState.DETACHED if gone else PoolState.ACTIVE)
            log.warning("pool %s: sleep %d not done (%s); %s", core.name, notice.sleep_id, exc,
                        "pages mapped back" if whole else "the pages that could be are mapped back, its blocks lost")
            return
        core.segments.release([page for lp_pages in pages.values() for page in lp_pages])
        if core.lease.abandon_outstanding_grows():  # granted before the sleep: released with the rest
            log.info("pool %s: grows outstanding at its sleep are dropped", core.name)
        core.asked_pages = 0  # every page went back
        if notice.mode == "warm":
            core.sleeping_allocator = allocator
            core.cell.move(PoolState.ASLEEP_WARM)
        else:
            core.segments.release_hold()  # a cold wake maps what it is granted, as a grow does
            core.num_block_losses += 1
            core.cell.move(PoolState.ASLEEP_COLD)
    log.info("pool %s is asleep (%s)", core.name, notice.mode)


def wake_pool(core: PoolCore, notice: WakeNotice) -> None:
    """Map the daemon's wake grant at the same logical pages and resume (module docstring).

    The pool ends active whatever this process could map: pages it could not
    import or map go back to the daemon, and a warm pool that lost any of its
    pages loses its blocks as a cold one does (``num_block_losses``), so the
    daemon and the pool agree on what is mapped. Only a lease lost meanwhile
    leaves it asleep (``pool_reconnect`` takes it from there)."""
    with core.lock:
        if not core.state.asleep:
            log.warning("pool %s: a wake notice while %s; ignored", core.name, core.state.value)
            return
        losses_before = core.num_block_losses
        try:
            granted = core.lease.receive_pages(notice.grant_id, notice.logical_pages) if notice.logical_pages else {}
        except KVDaemonError as exc:
            if core.lease.lost.is_set():
                raise  # asleep still, holding its room under the map cap: the reconnect takes it on
            core.segments.release_hold()  # nothing to map: the room goes back to the process
            log.error("pool %s: the %d page(s) of its wake could not be taken in (%s); they go back to the daemon",
                      core.name, len(notice.logical_pages), exc.message)
            core.give_back(list(notice.logical_pages))
            granted, whole = {}, False
        else:
            core.segments.release_hold()  # held since the sleep: room for these mappings
            whole = _map_back(core, granted, "at its wake")
        # The wake notice's mode decides: the daemon may have made a warm sleep cold meanwhile
        # (`kvdaemon sleep --cold`), and then the blocks of the old allocator are gone.
        if whole and notice.mode == "warm" and core.sleeping_allocator is not None:
            core.allocator = core.sleeping_allocator
            for lp in granted:
                if not core.allocator.is_mapped(lp):  # granted late before the sleep, saved with the rest
                    core.allocator.add_page(lp)  # mapped again: a spare page
        elif core.sleeping_allocator is not None:
            _lose_blocks(core)
        else:
            _fresh_allocator(core)
        lost = core.num_block_losses != losses_before
        core.sleeping_allocator = None
        core.cell.move(PoolState.ACTIVE)
    log.info("pool %s is awake (%s)%s", core.name, notice.mode, ", its blocks lost" if lost else "")


def _map_back(core: PoolCore, pages: dict[int, list[PhysicalPage]], why: str) -> bool:
    """Map ``pages`` at their logical pages (``PoolCore.map_or_give_back``: what cannot be
    mapped goes back to the daemon); True when every one is mapped."""
    try:
        core.map_or_give_back(pages, why)
    except BackendError:
        return False
    return True


def _lose_blocks(core: PoolCore) -> None:
    """Drop every block (their pages are not all mapped, or a cold wake): a fresh allocator
    over the pages mapped now, counted in ``num_block_losses`` as a cold sleep counts it."""
    core.num_block_losses += 1
    _fresh_allocator(core)


def _fresh_allocator(core: PoolCore) -> None:
    core.allocator = core.new_allocator()
    for lp in core.segments.pages:
        core.allocator.add_page(lp)
