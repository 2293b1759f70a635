"""A kvdaemon in a child process for benchmarks: started, awaited, stopped."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvdaemon.client import KVClient
from kvdaemon.errors import DaemonUnreachable


@contextmanager
def daemon_process(capacity: str, *options: str, backend: str = "host") -> Iterator[KVClient]:
    """Run ``kvdaemon start --foreground`` (host backend unless told) in a fresh dir; yield a client.

    ``options`` are more ``kvdaemon start`` flags (``--page-size 64KiB``...).

    The daemon is a real separate process, so client and daemon do not share
    a GIL. On exit the daemon is shut down and its dir removed.
    """
    root = Path(tempfile.mkdtemp(prefix="kvd-bench-", dir="/tmp"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvdaemon", "start", "--foreground", "--dir", str(root),
         "--backend", backend, "--capacity", capacity, *options],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    client = KVClient(root)
    try:
        _await(client, proc)
        yield client
        client.shutdown()
        proc.wait(30)
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(root, ignore_errors=True)


def _await(client: KVClient, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the daemon exited with {proc.returncode} before answering")
        try:
            client.hello()
            return
        except DaemonUnreachable:
            time.sleep(0.05)
    raise SystemExit("the daemon did not answer within 30 s")
