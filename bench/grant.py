"""Grant cost through the daemon against mapping the same pages in-process.

1. A 1 GiB grow: a tenant with 16 layers (32 segments) asks the daemon for 16
   logical pages (512 pages of 2 MiB): the request, the daemon creating and
   exporting the pages, the fds crossing the handle channel, the imports, and
   the client mapping them into its segments as a pool does (a run of pages that
   follow each other in the file at a time). Baseline, same run: the same 512
   pages created and mapped in this process with the backend alone, a page at a
   time (and, printed beside it, in one mmap). Target: ≤ 2× the baseline.
2. One-page grant round trip: a tenant with one segment grows by one page
   (request, fd, import, map), p50 and p99 over many grants. Baseline, same
   run: a bare ZeroMQ DEALER/ROUTER echo between two processes (the floor of
   any control op). Target: grant p50 <= 1.5x the echo's p50.

The daemon runs as a real separate process (``kvdaemon start --foreground``)
on the host backend.  Run: ``python bench/grant.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from daemon_proc import daemon_process  # noqa: E402
from report import median_us, percentile_us, save, verdict  # noqa: E402

from kvdaemon.client import KVClient, KVSpec, Lease  # noqa: E402
from kvdaemon.client.segments import SegmentMap  # noqa: E402
from kvdaemon.cuda_vmm import HostBackend  # noqa: E402

GiB = 1 << 30
PAGE_BYTES = 2 << 20
GROW_TARGET = 2.0
ECHO_RATIO_TARGET = 1.5


class MappedTenant:
    """A lease plus one reserved range per segment, mapping what it is granted as a pool does
    (``SegmentMap.map_many``: a run of pages that follow each other in the file at a time)."""

    def __init__(self, lease: Lease, num_virtual_pages: int) -> None:
        self.lease = lease
        self.segments = SegmentMap(lease.backend, lease.num_segments, num_virtual_pages, PAGE_BYTES)
        self.segments.reserve()

    def grow(self, logical_pages: list[int]) -> None:
        self.segments.map_many(self.lease.grow(logical_pages))

    def shrink_all(self) -> None:
        held = list(self.segments.pages)
        self.segments.drop_pages(held)
        self.lease.shrink(held)

    def close(self) -> None:
        self.segments.free_ranges()
        self.lease.close()


def single_segment_lease(client: KVClient, name: str, num_virtual_pages: int) -> Lease:
    """A tenant with one segment, so that one logical page is one physical page."""
    wire = KVSpec(num_layers=1, num_kv_heads=8, head_dim=128).to_wire()
    wire["num_segments"] = 1
    reply = client.call(
        "register",
        {"name": name, "spec": wire, "num_virtual_pages": num_virtual_pages, "pid": os.getpid()},
    )
    lease = Lease(client.paths, client.timeout_s, client.backend(), name, reply)
    lease.attach()
    return lease


def in_process_grow(num_pages: int, runs: bool = False) -> float:
    """Seconds to create and map ``num_pages`` pages with a backend in this process: a page at
    a time, or (``runs``) in one ``map_pages`` call (one mmap: they follow each other in the file)."""
    backend = HostBackend(num_pages=num_pages, page_size_bytes=PAGE_BYTES)
    backend.start()
    base = backend.reserve(num_pages * PAGE_BYTES)
    t0 = time.perf_counter()
    if runs:
        backend.map_pages(base, [backend.create_page(i) for i in range(num_pages)])
    else:
        for i in range(num_pages):
            backend.map_page(base + i * PAGE_BYTES, backend.create_page(i))
    elapsed = time.perf_counter() - t0
    backend.close()
    return elapsed


def daemon_grow(client: KVClient, name: str) -> float:
    """Seconds for a 1 GiB grow through the daemon, mapped in this process."""
    spec = KVSpec(num_layers=16, num_kv_heads=8, head_dim=128)
    tenant = MappedTenant(client.lease(name, spec, num_virtual_pages=16), 16)
    t0 = time.perf_counter()
    tenant.grow(list(range(16)))
    elapsed = time.perf_counter() - t0
    tenant.shrink_all()
    tenant.close()
    return elapsed


def one_page_grants(client: KVClient, num_grants: int) -> tuple[list[float], list[float]]:
    """Seconds per one-page grow (request, fd, import, map), and per bare ZeroMQ echo between
    two processes (the floor of any control-channel op), the two interleaved sample by sample
    so both see the same machine."""
    import zmq

    tenant = MappedTenant(single_segment_lease(client, "latency", 1), 1)
    with _echo_server() as endpoint:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(endpoint)
        grants, echoes = [], []
        for _ in range(num_grants):
            t0 = time.perf_counter()
            tenant.grow([0])
            grants.append(time.perf_counter() - t0)
            tenant.shrink_all()
            t0 = time.perf_counter()
            sock.send(b"ping")
            sock.recv()
            echoes.append(time.perf_counter() - t0)
        sock.send(b"")  # tells the server to stop
        sock.close(linger=1000)
    tenant.close()
    return grants, echoes


@contextmanager
def _echo_server() -> Iterator[str]:
    """A ZeroMQ ROUTER echoing every message in a child process, until an empty one."""
    import multiprocessing

    endpoint = f"ipc://{tempfile.mkdtemp(prefix='kvd-echo-', dir='/tmp')}/echo.sock"
    ready = multiprocessing.get_context("fork").Event()
    server = multiprocessing.get_context("fork").Process(target=_echo, args=(endpoint, ready))
    server.start()
    ready.wait(10)
    try:
        yield endpoint
    finally:
        server.join(10)
        if server.is_alive():
            server.kill()


def _echo(endpoint: str, ready: object) -> None:
    import zmq

    router = zmq.Context().socket(zmq.ROUTER)
    router.bind(endpoint)
    ready.set()  # type: ignore[attr-defined]
    while True:
        frames = router.recv_multipart()
        router.send_multipart(frames)
        if frames[-1] == b"":
            break
    router.close(linger=1000)


def control_round_trips(client: KVClient, num_trips: int) -> list[float]:
    """Seconds per ``status`` op: the daemon's own round trip without a grant."""
    samples = []
    for _ in range(num_trips):
        t0 = time.perf_counter()
        client.call("status")
        samples.append(time.perf_counter() - t0)
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="1 GiB grows per side")
    parser.add_argument("--grants", type=int, default=2000, help="one-page grants")
    args = parser.parse_args()

    with daemon_process("1100MiB") as client:
        ours, base, base_runs = [], [], []
        for r in range(args.rounds):
            base.append(in_process_grow(GiB // PAGE_BYTES))
            base_runs.append(in_process_grow(GiB // PAGE_BYTES, runs=True))
            ours.append(daemon_grow(client, f"grow-{r}"))
        latencies, echoes = one_page_grants(client, args.grants)
        controls = control_round_trips(client, args.grants)

    ours_ms, base_ms = median_us(ours) / 1e3, median_us(base) / 1e3
    ratio = ours_ms / base_ms
    p50, p99 = percentile_us(latencies, 50), percentile_us(latencies, 99)
    print(f"1 GiB grow through the daemon:   {ours_ms:8.2f} ms  ({GiB // PAGE_BYTES} pages)")
    runs_ms = median_us(base_runs) / 1e3
    print(f"1 GiB create+map in-process:     {base_ms:8.2f} ms  (baseline, same run: a map per page)")
    print(f"ratio: {ratio:.2f}x   target <= {GROW_TARGET}x   {verdict(ratio, GROW_TARGET)}")
    print(f"1 GiB create+map in-process, one mmap: {runs_ms:8.2f} ms  (same run; ratio to it {ours_ms / runs_ms:.2f}x)")
    control_p50, echo_p50 = percentile_us(controls, 50), percentile_us(echoes, 50)
    echo_ratio = p50 / echo_p50
    print(f"one-page grant round trip: p50 {p50:7.1f} us   p99 {p99:7.1f} us")
    print(f"bare zmq echo between two processes, interleaved: p50 {echo_p50:7.1f} us (baseline, same run); "
          f"status op p50 {control_p50:7.1f} us")
    print(f"grant/echo: {echo_ratio:.2f}x   target <= {ECHO_RATIO_TARGET}x   "
          f"{verdict(echo_ratio, ECHO_RATIO_TARGET)}")
    path = save("grant", {
        "grow_bytes": GiB, "rounds": args.rounds,
        "daemon_grow_ms": round(ours_ms, 3), "in_process_grow_ms": round(base_ms, 3),
        "in_process_one_mmap_ms": round(runs_ms, 3), "ratio_to_one_mmap": round(ours_ms / runs_ms, 3),
        "ratio": round(ratio, 3), "target_ratio": GROW_TARGET,
        "one_page_p50_us": round(p50, 1), "one_page_p99_us": round(p99, 1),
        "grants": args.grants, "grant_echo_ratio": round(echo_ratio, 3),
        "target_grant_echo_ratio": ECHO_RATIO_TARGET,
        "status_op_p50_us": round(control_p50, 1), "zmq_echo_p50_us": round(echo_p50, 1),
    })
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
