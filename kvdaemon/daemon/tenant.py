"""A tenant as the daemon sees it (one registered engine instance), and the table of them.

A tenant holds *logical pages*: logical page p is the p-th page-sized slice of
every one of its ``num_segments`` segments, so holding it means holding
``num_segments`` physical pages. ``mapped_bytes`` is therefore
``len(logical) * num_segments * page_size_bytes``.

States (``TenantState``): ``active`` (may hold pages and grow),
``sleeping-warm`` (no pages; its bytes kept in host memory), ``sleeping-cold``
(no pages, nothing kept). A sleep asked but not yet quiesced is
``pending_sleep`` on an active tenant (``saving`` once it quiesced and its
warm copy runs); a warm wake whose copy runs is ``waking`` on a sleeper, which
then holds the pages the copy fills, not yet sent to it.

Nothing here reads a clock: times are passed in by the service, so tests drive
them. Mutated only by the service loop.
"""

from __future__ import annotations

import enum
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvdaemon.cuda_vmm.backend import PhysicalPage
from kvdaemon.errors import BadRequest, UnknownTenant
from kvdaemon.wire.dtypes import DTYPE_BYTES
from kvdaemon.wire.protocol import MAX_INT, Args
from kvdaemon.wire.sizes import format_bytes

from kvdaemon.daemon.policies import Limits, OwnLimits
from kvdaemon.daemon.reclaim_debt import ReclaimDebt

if TYPE_CHECKING:
    from kvdaemon.daemon.copies import CopyJob
    from kvdaemon.daemon.reply import PendingReply
    from kvdaemon.daemon.swap import WarmCopy

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
MAX_SEGMENTS = 4096
SLEEP_REFUSED_S = 60.0  # after a tenant refused a sleep for a reason of its own, the daemon asks again no sooner
VICTIM_IDLE_S = 5.0  # reclaim sleeps only a tenant idle this long (a busy engine says so every second)


class TenantState(str, enum.Enum):
    """A tenant's state as ``status`` shows it (the value is the wire and CLI spelling)."""

    ACTIVE = "active"
    SLEEPING_WARM = "sleeping-warm"
    SLEEPING_COLD = "sleeping-cold"

    @classmethod
    def sleeping(cls, mode: str) -> TenantState:
        """The state of a tenant asleep in ``mode`` (``warm`` or ``cold``)."""
        return cls.SLEEPING_WARM if mode == "warm" else cls.SLEEPING_COLD

    @property
    def mode(self) -> str | None:
        """``warm``/``cold`` for a sleeper, ``None`` when active."""
        return {TenantState.SLEEPING_WARM: "warm", TenantState.SLEEPING_COLD: "cold"}.get(self)


@dataclass(frozen=True)
class WireSpec:
    """The KV layout a tenant registered with, validated."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    num_segments: int

    @classmethod
    def parse(cls, args: Args) -> WireSpec:
        num_layers = args.int("num_layers", 1, MAX_SEGMENTS // 2)
        num_segments = args.int("num_segments", 1, MAX_SEGMENTS, default=2 * num_layers)
        dtype = args.str("dtype", 32)
        if dtype not in DTYPE_BYTES:
            raise BadRequest(f"dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        return cls(
            num_layers=num_layers,
            num_kv_heads=args.int("num_kv_heads", 1, 1 << 16),
            head_dim=args.int("head_dim", 1, 1 << 16),
            block_size=args.int("block_size", 1, 1 << 16),
            dtype=dtype,
            num_segments=num_segments,
        )


    def describe(self) -> str:
        """``32 layers x 8 KV heads x 128, block 16, bfloat16, 64 segments``."""
        return (f"{self.num_layers} layers x {self.num_kv_heads} KV heads x {self.head_dim}, "
                f"block {self.block_size}, {self.dtype}, {self.num_segments} segments")  # fmt: skip


def check_name(name: str) -> str:
    if not NAME_PATTERN.fullmatch(name):
        shown = repr(name) if len(name) <= 60 else f"{name[:40]!r}... ({len(name)} characters)"
        raise BadRequest(
            f"tenant name {shown} must be 1-128 characters of letters, digits and ._:- "
            "starting with a letter or digit"
        )
    return name


@dataclass
class PendingSleep:
    """A sleep asked of a tenant that has not quiesced yet."""

    sleep_id: int
    mode: str
    waiter: PendingReply | None  # the caller's reply; None for the daemon's own sleeps
    deadline: float
    why: str = "asked by an admin"  # who asked, for the log
    victim: bool = False  # asked by reclaim for another tenant's grow (``victims_slept`` once done)
    saving: CopyJob | None = None  # the tenant quiesced: its warm copy runs
    answers: list[PendingReply] = field(default_factory=list)  # its sleep_ready(s), answered at the end


@dataclass
class PendingWake:
    """A warm wake whose copy back runs: the callers are answered when it ends."""

    job: CopyJob  # fills the pages the wake took (``logical``), sent when it ends
    waiters: list[PendingReply]
    why: str  # who asked, for the log


@dataclass(eq=False)  # compared by identity: a field-by-field == would cost O(fields) per test
class Tenant:
    """Daemon-side record of one tenant (see the module docstring)."""

    tenant_id: int
    name: str
    token: str
    pid: int
    spec: WireSpec
    page_size_bytes: int
    num_virtual_pages: int
    max_bytes: int
    min_bytes: int
    weight: float
    registered_at: float  # the service's clock when it registered
    sleepable: bool = False  # its engine can be quiesced: the daemon may sleep it on its own
    sleep_refused_at: float = float("-inf")  # when it last refused a sleep for a reason of its own
    state: TenantState = TenantState.ACTIVE
    logical: dict[int, list[PhysicalPage]] = field(default_factory=dict)
    used_bytes: int = 0
    limit_revision: int = 0
    leased: bool = False
    warm: WarmCopy | None = None  # the page bytes of a warm sleeper
    pending_sleep: PendingSleep | None = None  # asked to sleep, not yet quiesced
    waking: PendingWake | None = None  # a warm wake's copy back runs
    last_sleep: tuple[int, dict[str, Any]] | None = None  # (sleep_id, result): replayed on retry
    registered_wall: float = field(default_factory=time.time)
    last_active: float = 0.0
    registered_by: bytes = b""  # the control connection (routing id) that registered it
    heard_at: float = 0.0  # the service's clock at its last request with its token (a pool's agent
    # heartbeats at least every ``IDLE_HEARTBEAT_S``, so a long silence is a stopped or hung process)
    peak_mapped_bytes: int = 0
    num_refused_grows: int = 0
    starved_at: float = float("-inf")  # when a grow of it last found too few pages free
    starved_pages: int = 0  # the physical pages that grow needed at least
    told_free_at: float = float("-inf")  # when it was last told pages are free again (``free`` notice)
    num_sleeps: int = 0
    num_grown_pages: int = 0  # logical pages granted by grows, ever
    num_shrunk_pages: int = 0  # logical pages given back by shrinks, ever
    last_refusal: str = ""  # why the last grow was refused, in words
    refused_at: float | None = None  # when a grow was last refused (the service's clock)
    sleep_unanswered_at: float | None = None  # when a sleep was last cancelled, not quiesced in time
    engine_active_at: float = 0.0  # when a heartbeat last said its engine worked (or it registered, woke)
    own: OwnLimits | None = None  # what it asked for itself; default: the limits it has
    own_limit_logged_at: float = float("-inf")  # its last own limit change logged (monotonic)
    num_own_limits_unlogged: int = 0  # its own changes since then, told with the next line
    debt: ReclaimDebt = field(default_factory=ReclaimDebt)  # what urgent reclaims asked of it

    def __post_init__(self) -> None:
        self.last_active = self.heard_at = self.engine_active_at = self.registered_at
        if self.own is None:
            self.own = OwnLimits(self.max_bytes, self.min_bytes, self.weight)

    @property
    def logical_page_bytes(self) -> int:
        """Bytes one logical page costs: one physical page per segment."""
        return self.spec.num_segments * self.page_size_bytes

    @property
    def copying(self) -> str:
        """What copy of its pages runs, in words ("" when none): its pages stay put meanwhile."""
        kind = self.copy_kind
        if kind is None:
            return ""
        return {"restoring": "waking (its KV being copied back)",
                "saving": "going to sleep (its KV being copied to host memory)"}[kind]  # fmt: skip

    @property
    def copy_kind(self) -> str | None:
        """``saving`` (its warm sleep's copy to host memory runs), ``restoring`` (its wake's copy
        back runs), else ``None``: the ``copying`` of ``status``."""
        if self.waking is not None:
            return "restoring"
        if self.pending_sleep is not None and self.pending_sleep.saving is not None:
            return "saving"
        return None

    @property
    def mapped_bytes(self) -> int:
        return len(self.logical) * self.logical_page_bytes

    @property
    def reclaimable_pages(self) -> int:
        """Physical pages it could give back above ``min_bytes``; logical page 0 stays (pinned)."""
        keep = max(self.min_bytes, self.logical_page_bytes if 0 in self.logical else 0)
        return max(0, self.mapped_bytes - keep) // self.page_size_bytes

    def may_be_slept(self, now: float) -> bool:
        """The idle policy may ask it to sleep: it can quiesce, answers (``answers_sleeps``) and
        has not refused a sleep within ``SLEEP_REFUSED_S`` (a reclaim does not wait for that:
        ``may_be_victim``). O(1)."""
        return self.sleepable and self.answers_sleeps() and now - self.sleep_refused_at >= SLEEP_REFUSED_S

    def may_be_victim(self, now: float, idle_s: float = VICTIM_IDLE_S) -> bool:
        """Reclaim may sleep it for another tenant's need: it can quiesce and answers, holds no
        guarantee, has no sleep pending, and its engine has been idle ``idle_s`` (its pool's grows
        and returns, answering reclaim, are not the engine's work; sleeping a busy engine
        for another busy one only passes the memory back and forth, each wake taking it back
        by the next reclaim: busy tenants keep their shares instead). O(1)."""
        return (self.sleepable and self.answers_sleeps() and self.min_bytes == 0 and self.pending_sleep is None
                and now - self.engine_active_at >= idle_s)  # fmt: skip

    def answers_sleeps(self) -> bool:
        """False after a sleep it did not quiesce for in time until it is heard from again: a
        stopped or hung process, asked again, would only hold the memory wanted for another
        ``quiesce timeout``. O(1)."""
        return self.sleep_unanswered_at is None or self.heard_at > self.sleep_unanswered_at

    def touch(self, now: float) -> None:
        self.last_active = now

    def note_engine_active(self, now: float) -> None:
        """Its engine stepped or its blocks changed (a heartbeat says so): busy, for idle time
        and for reclaim (``may_be_victim``: its pool's own grows and returns do not count)."""
        self.last_active = self.engine_active_at = now

    def note_mapped(self) -> None:
        self.peak_mapped_bytes = max(self.peak_mapped_bytes, self.mapped_bytes)

    def note_grown(self, num_pages: int) -> None:
        """A grow granted ``num_pages`` logical pages (counted for the log's summaries)."""
        self.num_grown_pages += num_pages

    def note_shrunk(self, num_pages: int) -> None:
        """A shrink gave back ``num_pages`` logical pages."""
        self.num_shrunk_pages += num_pages
        self.debt.give(num_pages)

    def note_refused(self, code: str, num_pages: int, free_bytes: int, now: float) -> None:
        """A grow of ``num_pages`` logical pages (its minimum) was refused with ``code``."""
        self.num_refused_grows += 1
        self.refused_at = now
        wanted = format_bytes(num_pages * self.logical_page_bytes)
        if code == "OVER_LIMIT":
            why = f"{format_bytes(self.mapped_bytes)} mapped, limit {format_bytes(self.max_bytes)}"
        else:
            why = f"{format_bytes(free_bytes)} free in the pool"
        self.last_refusal = f"a grow of {wanted} refused ({code}: {why})"

    def note_refused_by_pool(self, num_grows: int, now: float) -> None:
        """``num_grows`` grows its pool refused itself, past the limit it was told (a heartbeat
        says so, at most a second late): counted with the daemon's own refusals."""
        self.num_refused_grows = min(self.num_refused_grows + num_grows, MAX_INT)  # status must encode
        self.refused_at = now
        self.last_refusal = (f"{num_grows} grow(s) refused by its pool, past the limit it knew then "
                             f"(limit now {format_bytes(self.max_bytes)}, {format_bytes(self.mapped_bytes)} mapped)")

    def current_limits(self) -> Limits:
        return Limits(self.max_bytes, self.min_bytes, self.weight)

    def limits(self) -> dict[str, Any]:
        """The ``limit`` map of ``register``'s reply and of a ``limit`` notice."""
        return {"max_bytes": self.max_bytes, "min_bytes": self.min_bytes, "weight": self.weight,
                "revision": self.limit_revision}  # fmt: skip

    def status(self, now: float) -> dict[str, object]:
        """The tenant's row of ``status --json`` (DESIGN.md §13, plus detail fields)."""
        return {
            "name": self.name,
            "pid": self.pid,
            "state": self.state.value,
            "mapped_bytes": self.mapped_bytes,
            "used_bytes": min(self.used_bytes, self.mapped_bytes),  # its heartbeat lags a grow or sleep
            "max_bytes": self.max_bytes,
            "min_bytes": self.min_bytes,
            "weight": self.weight,
            "idle_seconds": round(now - self.last_active, 3),
            "silent_seconds": round(now - self.heard_at, 3),
            "host_bytes": 0 if self.warm is None else self.warm.host_bytes,
            "num_segments": self.spec.num_segments,
            "limit_revision": self.limit_revision,
            "registered_at": round(self.registered_wall, 3),
            "peak_mapped_bytes": self.peak_mapped_bytes,
            "refused_grows": self.num_refused_grows,
            "refused_seconds_ago": None if self.refused_at is None else round(max(0.0, now - self.refused_at), 3),
            "sleeps": self.num_sleeps,
            "over_limit_bytes": max(0, self.mapped_bytes - self.max_bytes),
            "sleepable": self.sleepable,
            "sleep_pending": None if self.pending_sleep is None else self.pending_sleep.mode,
            "copying": self.copy_kind,
            "reclaim_owed_bytes": self.debt.owed_pages * self.logical_page_bytes,
            "unpaid_reclaims": self.debt.num_unpaid,
            "attached": self.leased,
        }


MAX_TENANTS = 1024  # registered at once: a register past it is refused (``Conflict``)
MAX_UNATTACHED = 64  # registered but not yet attached, in all: past it, one of the connection holding most goes
MAX_UNATTACHED_PER_CONN = 8  # ... and from one control connection: past it, its own oldest goes


class Tenants:
    """The registered tenants, by name and by id. O(1) lookups."""

    def __init__(self) -> None:
        self._by_name: dict[str, Tenant] = {}
        self._by_id: dict[int, Tenant] = {}
        self._next_id = 1
        self.version = 0  # bumped by ``changed``

    def __iter__(self) -> Iterator[Tenant]:
        return iter(list(self._by_name.values()))

    def __len__(self) -> int:
        return len(self._by_name)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def next_id(self) -> int:
        tenant_id, self._next_id = self._next_id, self._next_id + 1
        return tenant_id

    def add(self, tenant: Tenant) -> None:
        self._by_name[tenant.name] = tenant
        self._by_id[tenant.tenant_id] = tenant
        self.changed()

    def remove(self, tenant: Tenant) -> None:
        del self._by_name[tenant.name]
        del self._by_id[tenant.tenant_id]
        self.changed()

    def changed(self) -> None:
        """A tenant came, went, or changed its state, lease, weight or minimum: what is
        computed over all of them (``Shares.fair_pages_all``) is computed again."""
        self.version += 1

    def find(self, name: str) -> Tenant | None:
        """The tenant called ``name``, or ``None``."""
        return self._by_name.get(name)

    def named(self, name: str) -> Tenant:
        """The tenant called ``name``; ``UnknownTenant`` when none is."""
        tenant = self._by_name.get(name)
        if tenant is None:
            raise UnknownTenant(f"no tenant named {name!r}")
        return tenant

    def get(self, tenant_id: int) -> Tenant | None:
        return self._by_id.get(tenant_id)

    def unattached(self) -> list[Tenant]:
        """Tenants whose handle channel is not attached yet, oldest registration first.
        O(tenants log tenants)."""
        return sorted((t for t in self._by_name.values() if not t.leased), key=lambda t: t.registered_at)

    def guaranteed_bytes(self, other_than: Tenant | None = None) -> int:
        """The sum of ``min_bytes`` over tenants other than ``other_than``."""
        return sum(t.min_bytes for t in self._by_name.values() if t is not other_than)
