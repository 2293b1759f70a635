"""The protocol catalogue: every op a client may ask and every notice the daemon sends.

Requests travel on the control channel (ZeroMQ, see ``kvdaemon.wire.protocol``)
as ``{"id", "op", "args"}``; notices travel on a tenant's handle channel as
``{"notice", "args"}``, in order with the grant frames of that tenant.

Ops (``args`` fields; ``token`` means the tenant's own token is required):

============  =====================================================================
hello         version -> pid, backend, device, page_size, capacity_bytes, version
register      name, spec, num_virtual_pages, max_bytes?, min_bytes, weight, pid,
              sleepable -> tenant_id, token, page_size, num_segments, limit (a
              ``LimitNotice`` map)
grow          tenant, token, logical_pages (candidates, in order; at most 4096), min_pages?,
              wait_s?, ahead? (ahead of need: only pages free above the low-water
              mark, no reclaim, no wait) -> grant_id, pages [[lp, [page ids]]]
              (``min_pages`` <= n <= len(logical_pages), the first n candidates),
              max_bytes
shrink        tenant, token, logical_pages (at most 4096) -> num_released, mapped_bytes
heartbeat     tenant, token, used_bytes?, sleepable?, active? -> state, max_bytes, free_bytes,
              fair_bytes (its fair share), ahead_bytes (what a grow ahead of need could take),
              now (the daemon's clock, as a reclaim notice's ``expires_at`` reads it)
unregister    tenant, token -> num_released
status        -> the ``status --json`` object
set_limit     name, max_bytes?, min_bytes?, weight?, revision?, max?, min? (size text:
              "8GiB", "40%", "none"), weight "none"?, reset?, token? -> result
              (applied/stored), revision, changed, registered, limit, policy, clamped
              (no token: the operator's policy of the name, registered or not; see
              ``kvdaemon.daemon.limits``)
sleep         name, mode, token? -> state, num_released, host_bytes (answered once
              the tenant quiesced, or refused)
sleep_ready   tenant, token, sleep_id, refused?, why? (a refusal's reason, when not for
              want of a quiesce hook) -> the same result as ``sleep``
wake          name, token? -> state, mapped_bytes
shutdown      -> {}
============  =====================================================================

Every notice has a dataclass here with ``to_wire`` (daemon side) and a parser,
``parse_notice`` (client side), which validates every field: a client trusts
nothing it did not check, even from its daemon.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from kvdaemon.errors import BadRequest
from kvdaemon.wire.protocol import MAX_INT, MAX_VIRTUAL_PAGES, Args
from kvdaemon.wire.sizes import format_bytes

OPS = (
    "hello", "register", "grow", "shrink", "heartbeat", "unregister", "status", "set_limit",
    "sleep", "sleep_ready", "wake", "shutdown",
)
SLEEP_MODES = ("warm", "cold")
MAX_WHY_CHARS = 200  # a refused sleep's reason (``sleep_ready``'s ``why``), at most
MAX_WAKE_PAGES = 8192  # logical pages one wake notice names: 5 bytes each at most, within a frame
MAX_CLOCK_S = 1e15  # a clock reading in seconds (``CLOCK_MONOTONIC``) beyond any machine's uptime


@dataclass(frozen=True)
class Notice:
    """Base of every notice: ``kind`` names it on the wire."""

    kind: ClassVar[str] = ""

    def to_wire(self) -> dict[str, Any]:
        return {"notice": self.kind, "args": asdict(self)}


@dataclass(frozen=True)
class ReclaimNotice(Notice):
    """Give back up to ``num_pages`` logical pages (spare first, then cache-only).

    ``urgent`` (another tenant's real need, or a lowered limit): what cannot go
    now is *owed*, returned as its blocks are freed, and the engine admits no
    new request into it. Not urgent (the daemon keeping memory free ahead of
    need): only what can go now. ``expires_at`` (the daemon's ``CLOCK_MONOTONIC``, where it
    says): past it nobody waits on the ask any more (its debt lapsed), so a tenant that reads
    it later (stopped, starved) lets it go instead of shedding pages nobody needs now."""

    kind: ClassVar[str] = "reclaim"
    num_pages: int
    urgent: bool = True
    expires_at: float | None = None

    @classmethod
    def parse(cls, args: Args) -> ReclaimNotice:
        return cls(args.int("num_pages", 1, MAX_INT), args.bool("urgent", True),
                   args.opt_float("expires_at", -MAX_CLOCK_S, MAX_CLOCK_S))


@dataclass(frozen=True)
class FreeNotice(Notice):
    """Pages are free again since a grow of this tenant was refused: ``num_pages`` physical
    pages it may take now; ask again (a hint: a grow may still be refused)."""

    kind: ClassVar[str] = "free"
    num_pages: int

    @classmethod
    def parse(cls, args: Args) -> FreeNotice:
        return cls(args.int("num_pages", 1, MAX_INT))


@dataclass(frozen=True)
class RevokedNotice(Notice):
    """The daemon ended this lease: unmap everything, allocate nothing more."""

    kind: ClassVar[str] = "revoked"
    why: str

    @classmethod
    def parse(cls, args: Args) -> RevokedNotice:
        return cls(args.str("why", 1024))


@dataclass(frozen=True)
class SleepNotice(Notice):
    """Quiesce, unmap, and answer ``sleep_ready(sleep_id)``; ``by_owner``: asked by this tenant."""

    kind: ClassVar[str] = "sleep"
    mode: str
    sleep_id: int
    by_owner: bool = False

    @classmethod
    def parse(cls, args: Args) -> SleepNotice:
        return cls(_mode(args), args.int("sleep_id", 1), args.bool("by_owner"))


@dataclass(frozen=True)
class SleepCancelledNotice(Notice):
    """Sleep ``sleep_id`` was given up by the daemon (the tenant did not quiesce in time)."""

    kind: ClassVar[str] = "sleep_cancelled"
    sleep_id: int

    @classmethod
    def parse(cls, args: Args) -> SleepCancelledNotice:
        return cls(args.int("sleep_id", 1))


@dataclass(frozen=True)
class WakeNotice(Notice):
    """Awake again: map grant ``grant_id`` at ``logical_pages`` (the same addresses as before).

    The grant's page ids travel in its own frames (at most ``MAX_FDS_PER_FRAME``
    pages each) and its logical pages in notices of at most ``MAX_WAKE_PAGES``
    each (``parts``), sent back to back after those frames: ``first_index`` is
    where a notice's pages start in the whole list, ``num_logical_pages`` the
    whole grant's count, so every notice fits in one handle frame however large
    the tenant is. The client maps once they add up (``WakeJoin``).
    """

    kind: ClassVar[str] = "wake"
    mode: str
    grant_id: int
    logical_pages: list[int] = field(default_factory=list)
    num_logical_pages: int = -1  # the whole grant's; -1: this notice's own count
    first_index: int = 0

    def __post_init__(self) -> None:
        if self.num_logical_pages < 0:
            object.__setattr__(self, "num_logical_pages", len(self.logical_pages))

    @classmethod
    def parts(cls, mode: str, grant_id: int, logical_pages: list[int]) -> list[WakeNotice]:
        """The notices naming ``logical_pages`` in order, ``MAX_WAKE_PAGES`` a notice (one if none)."""
        total = len(logical_pages)
        return [
            cls(mode, grant_id, logical_pages[start : start + MAX_WAKE_PAGES], total, start)
            for start in range(0, max(total, 1), MAX_WAKE_PAGES)
        ]

    @classmethod
    def parse(cls, args: Args) -> WakeNotice:
        lps = args.int_list("logical_pages", 0, MAX_VIRTUAL_PAGES - 1, MAX_WAKE_PAGES)
        total = args.int("num_logical_pages", len(lps), MAX_VIRTUAL_PAGES, default=len(lps))
        first = args.int("first_index", 0, total - len(lps), default=0)
        return cls(_mode(args), args.int("grant_id", 0), lps, total, first)


class WakeJoin:
    """One wake's notices (``WakeNotice.parts``) joined back into the whole; O(1) a page.

    Starts from the first part (``first_index`` 0); ``add`` takes the next one
    and raises ``BadRequest`` (nothing added) for anything but the next part of
    this wake: another grant, mode or count, pages out of order, a page named
    twice. ``whole()`` once ``complete``.
    """

    def __init__(self, first: WakeNotice) -> None:
        if first.first_index != 0:
            raise BadRequest(f"a wake of grant {first.grant_id} starting at page {first.first_index}")
        self.first = first
        self.pages = list(first.logical_pages)
        self._seen = set(self.pages)

    @property
    def complete(self) -> bool:
        return len(self.pages) == self.first.num_logical_pages

    def add(self, part: WakeNotice) -> None:
        first = self.first
        if (part.grant_id, part.mode, part.num_logical_pages, part.first_index) != (
            first.grant_id, first.mode, first.num_logical_pages, len(self.pages)
        ):  # fmt: skip
            raise BadRequest(
                f"a wake notice of grant {part.grant_id} from page {part.first_index} where the next "
                f"part of grant {first.grant_id} from page {len(self.pages)} was due"
            )
        new = set(part.logical_pages)
        if not new.isdisjoint(self._seen):
            raise BadRequest(f"the parts of wake grant {first.grant_id} name a page twice")
        self._seen |= new
        self.pages += part.logical_pages

    def whole(self) -> WakeNotice:
        return WakeNotice(self.first.mode, self.first.grant_id, self.pages, len(self.pages))


@dataclass(frozen=True)
class LimitNotice(Notice):
    """The tenant's limits as of ``revision`` (also the ``limit`` field of ``register``'s reply)."""

    kind: ClassVar[str] = "limit"
    max_bytes: int
    min_bytes: int
    weight: float
    revision: int

    @classmethod
    def parse(cls, args: Args) -> LimitNotice:
        return cls(
            args.int("max_bytes", 0, MAX_INT), args.int("min_bytes", 0, MAX_INT),
            args.float("weight", 0.0, float("inf")), args.int("revision", 0, MAX_INT),
        )


def limit_revision(limit: dict[str, Any]) -> int:
    """The ``revision`` of a ``limit`` map (a register or attach reply's, a ``set_limit``
    reply's); 0 without one (a daemon's first limits). O(1)."""
    revision = limit.get("revision")
    return revision if isinstance(revision, int) and not isinstance(revision, bool) else 0


def describe_clamp(clamp: dict[str, Any]) -> str:
    """``max 20.0 GiB clamped to 1.00 GiB (above the capacity)`` from a reply's ``clamped`` entry."""
    return (f"{clamp['field']} {format_bytes(int(clamp['requested_bytes']))} clamped to "
            f"{format_bytes(int(clamp['applied_bytes']))} ({clamp['reason']})")  # fmt: skip


def checked_limit(told: object) -> dict[str, Any] | None:
    """A reply's ``limit`` map as a pool may use it: ``max_bytes`` and ``revision`` (0 if
    absent) within a ``limit`` notice's bounds; None when it is not a map or they are not. O(1)."""
    if not isinstance(told, dict):
        return None
    args = Args(told)
    try:
        return {"max_bytes": args.int("max_bytes", 0, MAX_INT), "revision": args.int("revision", 0, MAX_INT, 0)}
    except BadRequest:
        return None


@dataclass(frozen=True)
class ShutdownNotice(Notice):
    """The daemon is stopping: keep serving from what is mapped; re-register when it is back."""

    kind: ClassVar[str] = "shutdown"


_NOTICES: dict[str, Any] = {
    cls.kind: cls
    for cls in (ReclaimNotice, FreeNotice, RevokedNotice, SleepNotice, SleepCancelledNotice,
                WakeNotice, LimitNotice, ShutdownNotice)  # fmt: skip
}


def parse_notice(body: dict[str, Any]) -> Notice:
    """The typed notice of a handle-channel frame; ``BadRequest`` for anything malformed."""
    kind = body.get("notice")
    cls = _NOTICES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise BadRequest(f"unknown notice {str(kind)[:64]!r}")
    if cls is ShutdownNotice:
        return ShutdownNotice()
    return cls.parse(Args(body.get("args")))


def parse_grant_pages(raw: object) -> list[list[Any]]:
    """Check a grant's ``pages`` field: ``[[lp, [page ids]], ...]`` of non-negative integers."""
    if not isinstance(raw, list):
        raise BadRequest("grant pages must be a list")
    for item in raw:
        if (
            not isinstance(item, list) or len(item) != 2 or not _is_index(item[0])
            or not isinstance(item[1], list) or not all(_is_index(p) for p in item[1])
        ):  # fmt: skip
            raise BadRequest(f"malformed grant entry {str(item)[:64]}")
    return raw


def _mode(args: Args) -> str:
    mode = args.str("mode", 8)
    if mode not in SLEEP_MODES:
        raise BadRequest(f"a sleep mode is one of {SLEEP_MODES}, got {mode!r}")
    return mode


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
