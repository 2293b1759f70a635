"""`status` latency while other clients flood the daemon's control socket.

Three phases against one daemon (a real separate process, host backend):

1. idle: a client calls ``status`` (one call every 5 ms); baseline, same run.
2. costly flood: ``--flooders`` processes, one DEALER socket each, send 983 KB
   requests of ~1M empty arrays (each ~0.5-1 s to unpack without cost limits),
   keeping ``--window`` unanswered at all times, while the same client calls ``status``.
3. many flood: the same processes send small ``hello`` requests as fast as they
   can (never waiting for replies), while the client calls ``status``.

Prints p50/p99 of ``status`` per phase, the flood p99 over the idle p99, and
how many flood requests per second the daemon answered meanwhile. Target: p99 under each flood
below 100 ms. Writes ``bench/results/flood.json``.
Run: ``python bench/flood.py [--flooders 8] [--calls 200]``.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from daemon_proc import daemon_process  # noqa: E402
from report import percentile_us, save, verdict  # noqa: E402

from kvdaemon.client import KVClient  # noqa: E402
from kvdaemon.wire.protocol import encode, request  # noqa: E402

P99_TARGET_MS = 100.0
KINDS = ("costly", "many")


def costly_request() -> bytes:
    return encode({"id": 1, "op": "status", "args": {"x": [[[]] * 65536] * 15}})


def flood(endpoint: str, kind: str, window: int) -> None:
    """Flood ``endpoint`` until SIGTERM; then print how many requests were answered."""
    import zmq

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    dealer = zmq.Context().socket(zmq.DEALER)
    dealer.connect(endpoint)
    num_answered = 0
    print("flooding", flush=True)
    try:
        if kind == "costly":
            message = costly_request()
            for _ in range(window):
                dealer.send(message)
            while True:
                dealer.recv()
                num_answered += 1
                dealer.send(message)
        message = request(1, "hello", {})
        while True:
            dealer.send(message)  # blocks while the daemon's queue for us is full
            while dealer.poll(0):
                dealer.recv()
                num_answered += 1
    finally:
        print(num_answered, flush=True)


def status_latencies(client: KVClient, num_calls: int) -> list[float]:
    samples = []
    for _ in range(num_calls):
        started = time.perf_counter()
        client.status()
        samples.append(time.perf_counter() - started)
        time.sleep(0.005)
    return samples


def under_flood(
    client: KVClient, kind: str, args: argparse.Namespace
) -> tuple[list[float], float]:
    """``status`` latencies while ``kind`` floods, and flood requests answered per second."""
    endpoint = f"ipc://{client.paths.control_socket}"
    flooders = [
        subprocess.Popen(
            [sys.executable, __file__, "--flooder", endpoint, "--kind", kind,
             "--window", str(args.window)],
            stdout=subprocess.PIPE, text=True,
        )
        for _ in range(args.flooders)
    ]
    try:
        for proc in flooders:
            assert proc.stdout is not None and proc.stdout.readline() == "flooding\n"
        time.sleep(0.5)  # let the queues fill
        started = time.perf_counter()
        samples = status_latencies(client, args.calls)
        seconds = time.perf_counter() - started
    finally:
        for proc in flooders:
            proc.terminate()
    num_answered = sum(int(proc.communicate(timeout=30)[0].strip() or 0) for proc in flooders)
    return samples, num_answered / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flooders", type=int, default=8)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--flooder", metavar="ENDPOINT", help=argparse.SUPPRESS)
    parser.add_argument("--kind", choices=KINDS, default="costly", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.flooder:
        flood(args.flooder, args.kind, args.window)
        return
    figures: dict[str, object] = {"flooders": args.flooders, "calls": args.calls}
    with daemon_process("64MiB") as client:
        idle = status_latencies(client, args.calls)
        floods = {kind: under_flood(client, kind, args) for kind in KINDS}
        client.status()  # still answering
    idle_p99 = percentile_us(idle, 99) / 1e3
    print(f"status idle:               p50 {percentile_us(idle, 50) / 1e3:7.2f} ms   "
          f"p99 {idle_p99:7.2f} ms   (baseline, same run)")
    figures["idle_p50_ms"], figures["idle_p99_ms"] = percentile_us(idle, 50) / 1e3, idle_p99
    for kind, (samples, answered_per_s) in floods.items():
        p50, p99 = percentile_us(samples, 50) / 1e3, percentile_us(samples, 99) / 1e3
        print(f"status under {kind:6s} flood: p50 {p50:7.2f} ms   p99 {p99:7.2f} ms   "
              f"p99 ratio {p99 / idle_p99:6.1f}x   target p99 < {P99_TARGET_MS:.0f} ms   "
              f"{verdict(p99, P99_TARGET_MS)}   (flood answered: {answered_per_s:,.0f}/s)")
        figures[f"{kind}_p50_ms"], figures[f"{kind}_p99_ms"] = p50, p99
        figures[f"{kind}_p99_ratio"] = p99 / idle_p99
        figures[f"{kind}_answered_per_s"] = answered_per_s
    print(f"({args.flooders} flooding sockets; costly = 983 KB of ~1M empty arrays per request, "
          f"{args.window} in flight each; many = small hello requests, unread replies)")
    print(f"wrote {save('flood', figures)}")


if __name__ == "__main__":
    main()
