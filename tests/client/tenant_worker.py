"""A tenant process for the client tests.

Run from the repository root::

    python -m tests.client.tenant_worker DIR NAME --tag T churn --rounds R --seed S
    python -m tests.client.tenant_worker DIR NAME --tag T hold --pages N

It leases ``NAME`` from the daemon at ``DIR``, reserves one range per segment of
``virtual_pages * page_size`` bytes, and maps every granted page at
``range_start[segment] + logical_page * page_size``. Each page it maps is
checked to read zero (a released page comes back hole-punched, so no bytes of
an earlier owner remain) and then filled with a pattern unique to
``(tag, logical page, segment, round)``.

Events go to stdout as one JSON object per line; commands come from stdin:

- ``churn``: prints ``ready``, waits for ``go``, then for ``--rounds`` rounds grows
  or shrinks by a few logical pages (seeded RNG), counting ``NoMemory`` and
  ``OverLimit`` refusals, and verifies every mapped page after every round.
  Prints ``done`` with its counts, waits for ``close``, gives everything back,
  prints ``closed``.
- ``hold``: grows ``--pages`` logical pages, prints ``ready``, then answers each
  ``verify`` line with ``verified``; ``close`` (or EOF) gives everything back.

A pattern mismatch prints ``mismatch`` and exits with status 3.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from kvdaemon.client import KVClient, KVSpec, Lease
from kvdaemon.cuda_vmm.backend import Backend, PhysicalPage
from kvdaemon.errors import NoMemory, OverLimit

EXIT_MISMATCH = 3
TAG_SHIFT = 20  # pattern word i of a page is (tag << TAG_SHIFT) + i; pages hold < 2**20 words


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def pattern_tag(tag: int, logical_page: int, segment: int, round_no: int) -> int:
    """A number unique to (tenant tag, logical page, segment, round) for tag/page/round < 4096."""
    return ((tag * 4096 + logical_page) * 64 + segment) * 4096 + round_no


class Mismatch(Exception):
    """A mapped page does not hold the pattern written into it."""


@dataclass
class Stats:
    grows: int = 0
    shrinks: int = 0
    no_memory: int = 0
    over_limit: int = 0
    verified_pages: int = 0


@dataclass
class Tenant:
    """One lease with its reserved ranges and the pattern round of each mapped page."""

    lease: Lease
    backend: Backend
    tag: int
    num_virtual_pages: int
    starts: list[int] = field(default_factory=list)
    mapped: dict[int, tuple[list[PhysicalPage], int]] = field(default_factory=dict)
    stats: Stats = field(default_factory=Stats)

    def __post_init__(self) -> None:
        size = self.num_virtual_pages * self.page_size
        self.starts = [self.backend.reserve(size) for _ in range(self.lease.num_segments)]
        self._index = torch.arange(self.page_size // 8, dtype=torch.int64)

    @property
    def page_size(self) -> int:
        return self.lease.page_size_bytes

    def _view(self, segment: int, logical_page: int) -> torch.Tensor:
        addr = self.starts[segment] + logical_page * self.page_size
        return self.backend.tensor(addr, self.page_size, torch.int64)

    def _expected(self, segment: int, logical_page: int, round_no: int) -> torch.Tensor:
        tag = pattern_tag(self.tag, logical_page, segment, round_no)
        return self._index + (tag << TAG_SHIFT)

    def write(self, logical_page: int, round_no: int) -> None:
        for segment in range(len(self.starts)):
            self._view(segment, logical_page).copy_(self._expected(segment, logical_page, round_no))
        pages, _ = self.mapped[logical_page]
        self.mapped[logical_page] = (pages, round_no)

    def grow(self, logical_pages: list[int], round_no: int) -> None:
        """Map, check zero and fill each granted page; NoMemory/OverLimit propagate."""
        granted = self.lease.grow(logical_pages)
        assert sorted(granted) == sorted(logical_pages), granted
        for lp, pages in granted.items():
            for segment, page in enumerate(pages):
                self.backend.map_page(self.starts[segment] + lp * self.page_size, page)
                if self._view(segment, lp).any():
                    raise Mismatch(f"fresh page {page.page_id} (lp {lp}, seg {segment}) not zero")
            self.mapped[lp] = (pages, round_no)
            self.write(lp, round_no)
        self.stats.grows += 1

    def shrink(self, logical_pages: list[int]) -> None:
        """Unmap and release locally, then give the logical pages back to the daemon."""
        for lp in logical_pages:
            pages, _ = self.mapped.pop(lp)
            for segment, page in enumerate(pages):
                self.backend.unmap(self.starts[segment] + lp * self.page_size, self.page_size)
                self.backend.release_page(page)
        assert self.lease.shrink(logical_pages) == len(logical_pages)
        self.stats.shrinks += 1

    def verify(self) -> int:
        """Check every mapped page against its pattern; return how many pages were checked."""
        for lp, (_, round_no) in self.mapped.items():
            for segment in range(len(self.starts)):
                expected = self._expected(segment, lp, round_no)
                if not torch.equal(self._view(segment, lp), expected):
                    raise Mismatch(f"lp {lp} segment {segment} lost its round-{round_no} pattern")
        checked = len(self.mapped) * len(self.starts)
        self.stats.verified_pages += checked
        return checked

    def close(self) -> None:
        if self.mapped:
            self.shrink(sorted(self.mapped))
        for start in self.starts:
            self.backend.free_range(start)
        self.lease.close()


def churn_round(tenant: Tenant, rng: random.Random, round_no: int, backoff: bool) -> bool:
    """One grow-or-shrink step; return True when the next round should shrink (after NoMemory)."""
    unmapped = [lp for lp in range(tenant.num_virtual_pages) if lp not in tenant.mapped]
    if unmapped and not backoff and rng.random() < 0.7:
        wanted = rng.sample(unmapped, min(rng.randint(1, 3), len(unmapped)))
        try:
            tenant.grow(wanted, round_no)
        except NoMemory:
            tenant.stats.no_memory += 1
            return True
        except OverLimit:
            tenant.stats.over_limit += 1
            return True
    elif tenant.mapped:
        tenant.shrink(rng.sample(sorted(tenant.mapped), min(rng.randint(1, 2), len(tenant.mapped))))
    if tenant.mapped:
        tenant.write(rng.choice(sorted(tenant.mapped)), round_no)  # rewrite one page each round
    return False


def probe_limit(tenant: Tenant, max_pages: int) -> None:
    """Ask for one logical page more than the limit allows: it must be refused whole."""
    try:
        tenant.grow(list(range(max_pages + 1)), 0)
    except OverLimit:
        tenant.stats.over_limit += 1
        return
    raise AssertionError(f"a grow of {max_pages + 1} logical pages passed a limit of {max_pages}")


def run_churn(tenant: Tenant, args: argparse.Namespace) -> None:
    emit("ready")
    expect_line("go")
    rng = random.Random(args.seed)
    if args.max_pages is not None:
        probe_limit(tenant, args.max_pages)
    backoff = False
    for round_no in range(1, args.rounds + 1):
        backoff = churn_round(tenant, rng, round_no, backoff)
        tenant.verify()
    emit("done", rounds=args.rounds, mapped_pages=len(tenant.mapped), **vars(tenant.stats))
    expect_line("close")
    tenant.close()
    emit("closed")


def run_hold(tenant: Tenant, args: argparse.Namespace) -> None:
    tenant.grow(list(range(args.pages)), 1)
    emit("ready", mapped_pages=len(tenant.mapped))
    for line in sys.stdin:
        command = line.strip()
        if command == "verify":
            emit("verified", pages=tenant.verify())
        elif command == "close":
            break
        else:
            raise SystemExit(f"unknown command {command!r}")
    tenant.close()
    emit("closed")


def expect_line(word: str) -> None:
    line = sys.stdin.readline().strip()
    if line != word:
        raise SystemExit(f"expected {word!r} on stdin, got {line!r}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir")
    parser.add_argument("name")
    parser.add_argument("--tag", type=int, required=True, help="tenant number in the pattern")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--virtual-pages", type=int, default=8)
    parser.add_argument("--max-pages", type=int, default=None, help="limit, in logical pages")
    modes = parser.add_subparsers(dest="mode", required=True)
    churn = modes.add_parser("churn")
    churn.add_argument("--rounds", type=int, default=40)
    churn.add_argument("--seed", type=int, default=0)
    hold = modes.add_parser("hold")
    hold.add_argument("--pages", type=int, default=2)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    client = KVClient(args.dir, timeout_s=10.0)
    spec = KVSpec(
        num_layers=args.layers, num_kv_heads=2, head_dim=64, block_size=16, dtype="float16"
    )
    page_size = client.hello()["page_size"]
    max_bytes = None
    if args.max_pages is not None:
        max_bytes = args.max_pages * spec.num_segments * page_size
    lease = client.lease(
        args.name, spec, num_virtual_pages=args.virtual_pages, max_bytes=max_bytes
    )
    tenant = Tenant(lease, client.backend(), args.tag, args.virtual_pages)
    try:
        (run_churn if args.mode == "churn" else run_hold)(tenant, args)
    except Mismatch as exc:
        emit("mismatch", message=str(exc))
        return EXIT_MISMATCH
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
