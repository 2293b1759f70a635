"""Surviving a daemon restart: a pool re-registers and moves its pages to the new daemon.

While no daemon runs, the pool's pages stay mapped (this process holds their
handles), so the engine keeps reading and writing its KV; only growing fails.
When a daemon answers on the same directory again, the agent (``try_reconnect``):

1. registers the tenant again (same name, spec, virtual size, limits) and
   attaches a new lease (``relink``);
2. grows exactly the logical pages mapped here from the new daemon, so its
   accounting equals what the pool maps: page returns and grows the old daemon
   never confirmed are forgotten with it;
3. for each page and segment copies the bytes into the new page and swaps it
   in at the same address (``SegmentMap.move``), under the pool's lock and with
   the engine held between steps (the quiesce and resume hooks; not for a pool
   asleep, whose engine touches no KV and may be the one waiting in a wake for
   this move), so block ids, addresses and bytes are unchanged;
4. releases the old pages (the dead daemon's memory goes back to the OS).

A pool asleep when its daemon died wakes empty (its warm copy died with the
daemon; counted in ``num_block_losses``). If the new daemon has too little
room, the pool keeps its old pages and tries again on the next tick; after
``MOVES_BEFORE_EMPTY`` such tries, or at once when the new daemon's limit for
it is below what it maps (``OverLimit``: an operator's word, not a wait), it
joins the new daemon *empty*: every block dropped (a block loss, which the
engine recomputes), its old pages released.

A daemon that refuses the pool for as long as it runs is never joined, and
never asked again (``Unjoinable``): one whose pages are of another size (a
``Conflict``; the pool's layout is built on its page size, so a ``hello``
after the refusal checks that this, not a name taken, was why), one that
finds the request itself bad for it (``BadRequest``: a logical page past its
capacity) or one of another protocol (``VersionMismatch``). The pool says so
once per daemon, as a warning naming what to do, and serves from what it maps;
it asks again only when another daemon starts on the directory (its control
socket is bound anew), so an operator who restarts the daemon right gets the
pool back without restarting the engine. Every other refusal (a name taken
meanwhile: it may be freed) is tried again on each tick, said once per reason.
Cost: one page copy per page and segment; one ``stat`` per tick while the
daemon running is one that refused the pool for good.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from kvdaemon.client.control import ControlChannel
from kvdaemon.client.lease import Grant, Lease
from kvdaemon.client.pool_core import PoolCore
from kvdaemon.client.pool_state import PoolState
from kvdaemon.errors import BadRequest, Conflict, DaemonUnreachable, KVDaemonError, OverLimit, VersionMismatch
from kvdaemon.wire.paths import DaemonPaths
from kvdaemon.wire.protocol import PROTOCOL_VERSION
from kvdaemon.wire.sizes import format_bytes

log = logging.getLogger("kvdaemon.client.pool")
MOVES_BEFORE_EMPTY = 10  # refused moves (one per agent tick) before the pool joins empty


Instance = tuple[int, int, int]  # a daemon bound at a directory: its control socket's device, inode, ctime


def bound_daemon(paths: DaemonPaths) -> Instance | None:
    """Which daemon is bound at ``paths`` now, ``None`` while none is. Each start binds its
    control socket anew (a new file), so this differs for every daemon started there, a pid
    that repeats (a container's, an in-process daemon's) or a dead one's socket left behind
    notwithstanding. One ``stat``."""
    try:
        info = os.stat(paths.control_socket)
    except OSError:
        return None
    return info.st_dev, info.st_ino, info.st_ctime_ns


class Unjoinable:
    """The daemon that refused a pool for as long as it runs (``instance``, ``None`` while
    none did): the pool asks it nothing more (see the module docstring). O(1)."""

    def __init__(self) -> None:
        self.instance: Instance | None = None


def try_reconnect(
    core: PoolCore, relink: Callable[[], Lease], listen: Callable[[Lease], None], unjoinable: Unjoinable,
) -> bool:
    """One attempt; True once the pool is registered with a live daemon again. ``listen``
    routes a lease's notices to the agent (``PoolAgent.listen``); ``unjoinable``: the pool's
    record of the daemon that refused it for good, which is not asked again (one ``stat``)."""
    paths = core.lease.paths
    instance = bound_daemon(paths)
    if unjoinable.instance is not None and instance == unjoinable.instance:
        return False
    try:
        lease = relink()
    except DaemonUnreachable as exc:
        log.debug("pool %s: no new daemon yet: %s", core.name, exc)
        return False
    except KVDaemonError as exc:  # a daemon runs but refuses us (the name taken...): say why
        why = _for_good(core, exc)
        if why is None:
            if exc.message != core.relink_error:
                log.warning("pool %s: re-registering failed, retrying: %s", core.name, exc)
        elif instance is not None and bound_daemon(paths) == instance:  # the daemon asked is still the one bound
            unjoinable.instance = instance
            log.warning("pool %s: the daemon at %s cannot take it for as long as it runs (%s); the pool serves "
                        "from the %d logical page(s) it maps and asks again only when a daemon starts there anew",
                        core.name, paths.root, why, len(core.segments.pages))  # fmt: skip
        # else another daemon took the directory meanwhile: the next tick asks it
        core.relink_error = exc.message
        return False
    unjoinable.instance = None
    listen(lease)  # its notices reach the agent (queued till the move ends; dropped if it fails)
    hooks = not core.state.asleep  # asleep, its engine holds no KV (and may be waiting in a wake)
    if hooks and core.quiesce_hook is not None:
        core.quiesce_hook()
    try:
        with core.lock:
            if core.num_refused_moves >= MOVES_BEFORE_EMPTY:
                _join_empty(core, lease)
            else:
                _move_pages(core, lease)
    except KVDaemonError as exc:  # the new registration ends; the next tick tries again
        lease.close()
        core.num_refused_moves = MOVES_BEFORE_EMPTY if isinstance(exc, OverLimit) else core.num_refused_moves + 1
        if exc.message != core.relink_error:
            log.warning("pool %s: moving pages to the new daemon failed: %s", core.name, exc)
        core.relink_error = exc.message
        return False
    finally:
        if hooks and core.resume_hook is not None:
            core.resume_hook()
    log.warning("pool %s: re-joined the daemon at %s, %d logical page(s) moved", core.name, paths.root,
                len(core.segments.pages))  # as loud as the warning that it was gone
    return True


def _for_good(core: PoolCore, refusal: KVDaemonError) -> str | None:
    """Why the daemon that answered ``refusal`` to the pool's registration will refuse it for
    as long as it runs, and what to do; ``None`` for one that may change (a name taken: it may
    be freed) or when unsure (the ``hello`` went unanswered: a timeout is not a decision).
    A ``Conflict`` costs one ``hello``."""
    if not refusal.from_daemon:
        return None
    if isinstance(refusal, (BadRequest, VersionMismatch)):  # the same request gets the same answer there
        return refusal.message
    if isinstance(refusal, Conflict):
        theirs, ours = _page_size(core), core.page_bytes
        if theirs is not None and theirs != ours:
            return (f"its pages are of {format_bytes(theirs)}, the pool's KV is laid out on pages of "
                    f"{format_bytes(ours)}: restart "
                    f"the daemon with --page-size {ours}")
    return None


def _page_size(core: PoolCore) -> int | None:
    """The page size of the daemon at the pool's directory (one ``hello`` on a channel of its
    own, closed after), ``None`` when it does not answer or say."""
    channel = ControlChannel(core.lease.paths, core.lease.timeout_s)
    try:
        info = channel.call("hello", {"version": PROTOCOL_VERSION})
    except KVDaemonError:
        return None
    finally:
        channel.close()
    page = info.get("page_size") if isinstance(info, dict) else None
    return page if type(page) is int else None


def _join_empty(core: PoolCore, lease: Lease) -> None:
    """Take ``lease`` (a fresh registration: nothing granted) with nothing mapped: every block
    and the old pages dropped (lock held)."""
    log.warning("pool %s: joins the new daemon empty, its %d logical page(s) dropped (%s): the engine "
                "recomputes what it held", core.name, len(core.segments.pages), core.relink_error)
    core.drop_all_pages()
    core.backend.prune_imports()
    core.num_block_losses += 1
    _switch(core, lease)


def _move_pages(core: PoolCore, lease: Lease) -> None:
    """Grow the mapped logical pages from ``lease``, copy them over, switch leases (lock held)."""
    lps = sorted(core.segments.pages)
    granted: Grant = {}
    try:
        for start in range(0, len(lps), core.max_grant_pages):  # one handle frame per grant
            granted.update(lease.grow(lps[start:start + core.max_grant_pages]))  # may wait for others
    except KVDaemonError:
        for pages in granted.values():  # imported, never mapped: the unregister frees them there
            core.segments.release(pages)
        raise
    staging = core.backend.reserve(core.page_bytes)
    try:
        for lp in lps:
            core.segments.move(lp, granted[lp], staging)
    finally:
        core.backend.free_range(staging)
    core.backend.prune_imports()
    if core.state.asleep:
        log.warning("pool %s: asleep when its daemon died; it wakes empty", core.name)
        core.allocator = core.new_allocator()
        core.sleeping_allocator = None
        core.segments.release_hold()  # its warm pages died with the daemon: nothing to map back
        core.num_block_losses += 1
    _switch(core, lease)


def _switch(core: PoolCore, lease: Lease) -> None:
    """Make ``lease`` the pool's, forgetting what the dead daemon was owed or owed us."""
    old, core.lease = core.lease, lease
    old.abandon()
    core.pending_return.clear()  # the new daemon never granted those
    core.old_stuck = set(core.segments.stuck)  # ... nor these: never given back to it, nor counted
    core.asked_pages = 0  # ... nor asked for any
    core.relink_error, core.num_refused_moves = None, 0
    core.set_limit(lease.limit, fresh=True)
    if core.state is not PoolState.ACTIVE:
        core.cell.move(PoolState.ACTIVE)
