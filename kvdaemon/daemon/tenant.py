"""A tenant as the daemon sees it: one registered engine instance.

A tenant holds *logical pages*: logical page p is the p-th page-sized slice of
every one of its ``num_segments`` segments, so holding it means holding
``num_segments`` physical pages. ``mapped_bytes`` is therefore
``len(logical) * num_segments * page_size_bytes``.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from kvdaemon.cuda_vmm.backend import PhysicalPage
from kvdaemon.errors import BadRequest
from kvdaemon.wire.dtypes import DTYPE_BYTES
from kvdaemon.wire.protocol import Args

if TYPE_CHECKING:
    from kvdaemon.daemon.sleep import PendingSleep
    from kvdaemon.daemon.swap import WarmCopy

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
MAX_SEGMENTS = 4096
STATES = ("active", "sleeping-warm", "sleeping-cold")


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

    def to_wire(self) -> dict[str, object]:
        return {
            "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "block_size": self.block_size, "dtype": self.dtype,
            "num_segments": self.num_segments,
        }


def check_name(name: str) -> str:
    if not NAME_PATTERN.fullmatch(name):
        raise BadRequest(
            f"tenant name {name!r} must be 1-128 characters of letters, digits and ._:- "
            "starting with a letter or digit"
        )
    return name


@dataclass
class Tenant:
    """Daemon-side record of one tenant. Mutated only by the service loop."""

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
    routing_id: bytes = b""
    state: str = "active"
    logical: dict[int, list[PhysicalPage]] = field(default_factory=dict)
    used_bytes: int = 0
    limit_revision: int = 0
    limit_values: tuple[int, int, float] = (0, 0, 1.0)
    last_active: float = field(default_factory=time.monotonic)
    registered_at: float = field(default_factory=time.monotonic)
    leased: bool = False
    warm: WarmCopy | None = None  # the page bytes of a warm sleeper
    pending_sleep: PendingSleep | None = None  # asked to sleep, not yet quiesced

    @property
    def logical_page_bytes(self) -> int:
        """Bytes one logical page costs: one physical page per segment."""
        return self.spec.num_segments * self.page_size_bytes

    @property
    def mapped_bytes(self) -> int:
        return len(self.logical) * self.logical_page_bytes

    def touch(self) -> None:
        self.last_active = time.monotonic()

    def status(self) -> dict[str, object]:
        """The tenant's row of ``status --json`` (DESIGN.md §13)."""
        return {
            "name": self.name,
            "pid": self.pid,
            "state": self.state,
            "mapped_bytes": self.mapped_bytes,
            "used_bytes": self.used_bytes,
            "max_bytes": self.max_bytes,
            "min_bytes": self.min_bytes,
            "weight": self.weight,
            "idle_seconds": round(time.monotonic() - self.last_active, 3),
            "host_bytes": 0 if self.warm is None else self.warm.host_bytes,
            "num_segments": self.spec.num_segments,
            "limit_revision": self.limit_revision,
        }
