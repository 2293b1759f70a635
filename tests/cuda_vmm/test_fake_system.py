"""The whole system on the ``cuda`` backend, over the fake CUDA driver.

A daemon (``kvdaemon start --backend cuda``) and tenant processes
(``tests.cuda_vmm.fake_tenant``, ``tests.integrations.engine_worker``) all
load the fake ``libcuda.so.1``: pages are fake-driver allocations crossing
processes as fds, the tenants' KV tensors are CPU views of the mapped
addresses. The test process only speaks the control protocol (``KVClient``)
and reads the driver's call log. Skipped where the fake driver cannot be built.

Cost: a few child processes per test (torch start-up dominates: about 5 s each).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvdaemon.client import KVClient

from tests.conftest import answers, short_dir, wait_until
from tests.cuda_vmm.conftest import FakeCuda

REPO_ROOT = Path(__file__).resolve().parents[2]
MiB = 1024 * 1024
PAGE_BYTES = 2 * MiB
LP_BYTES = 2 * PAGE_BYTES  # one logical page of the tenants' spec (K and V of one layer)
BLOCKS_PER_LP = 256
CAPACITY = 16 * PAGE_BYTES  # 8 logical pages
REPLY_TIMEOUT_S = 120.0


class Child:
    """A child process spoken to in JSON lines (a reader thread, so no read blocks forever)."""

    def __init__(self, argv: list[str], env: dict[str, str], what: str) -> None:
        self.what = what
        self.proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def read(self) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=REPLY_TIMEOUT_S)
        except queue.Empty:
            raise AssertionError(f"{self.what} did not answer in {REPLY_TIMEOUT_S} s") from None
        assert line is not None, f"{self.what} exited with {self.proc.wait(10)}"
        return json.loads(line)

    def send(self, cmd: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.proc.stdin.flush()

    def ask(self, cmd: str, **args: Any) -> dict[str, Any]:
        self.send(cmd, **args)
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.ask("close")["event"] == "closed"
        assert self.proc.wait(30) == 0, f"{self.what} exited with {self.proc.returncode}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


class System:
    """One daemon directory on the fake driver, the processes started in it, and its call log."""

    def __init__(self, fake_cuda: FakeCuda, root: Path) -> None:
        self.root = root
        self.log = root / "driver.log"
        self.env = fake_cuda.env(self.log)
        self.daemon: subprocess.Popen[bytes] | None = None
        self.children: list[Child] = []
        self.client = KVClient(root, timeout_s=30)

    def start_daemon(self) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "kvdaemon", "start", "--foreground", "--dir", str(self.root),
                "--backend", "cuda", "--capacity", str(CAPACITY), "--page-size", str(PAGE_BYTES)]
        with open(self.root / "daemon.err", "ab") as err:
            self.daemon = subprocess.Popen(argv, cwd=REPO_ROOT, env=self.env,
                                           stdout=subprocess.DEVNULL, stderr=err)
        wait_until(lambda: answers(self.root), 60, "the daemon did not start on the fake driver")
        return self.daemon

    def tenant(self, name: str, tag: int, spare: int = 2, prefetch: int = 0) -> Child:
        argv = [sys.executable, "-m", "tests.cuda_vmm.fake_tenant", str(self.root), name,
                "--tag", str(tag), "--spare", str(spare), "--prefetch", str(prefetch)]
        return self._spawn(argv, f"tenant {name}")

    def engine(self, name: str, arch: str, seed: int) -> Child:
        argv = [sys.executable, "-m", "tests.integrations.engine_worker", str(self.root), name,
                "--arch", arch, "--seed", str(seed)]
        return self._spawn(argv, f"engine {name}")

    def _spawn(self, argv: list[str], what: str) -> Child:
        child = Child(argv, self.env, what)
        self.children.append(child)
        assert child.read()["event"] == "ready"
        return child

    def tenants(self) -> dict[str, dict[str, Any]]:
        return {t["name"]: t for t in self.client.status()["tenants"]}

    def check_accounting(self) -> dict[str, Any]:
        status = self.client.status()
        assert status["backend"] == "cuda"
        mapped = sum(t["mapped_bytes"] for t in status["tenants"])
        assert mapped + status["free_bytes"] == status["capacity_bytes"] == CAPACITY
        return status

    def calls(self, pid: int | None = None) -> list[Any]:
        return [c for c in FakeCuda.calls(self.log) if pid is None or c.pid == pid]

    def failed_calls(self) -> list[Any]:
        return [c for c in self.calls() if c.result != 0]

    def stop(self) -> None:
        for child in self.children:
            child.kill()
        self.client.close()
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            try:
                self.daemon.wait(30)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait(10)


def copied_bytes(call: Any) -> int:
    """The size a logged copy moved (its detail reads ``... size=N ...``)."""
    return int(call.detail.split("size=", 1)[1].split()[0])


@pytest.fixture
def system(fake_cuda: FakeCuda) -> Iterator[System]:
    root = short_dir()
    running = System(fake_cuda, root)
    try:
        yield running
    finally:
        running.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_two_tenants_grow_reclaim_and_sleep_warm_and_cold(system: System) -> None:
    daemon = system.start_daemon()
    a, b = system.tenant("a", tag=1), system.tenant("b", tag=2)
    assert a.ask("alloc", n=3 * BLOCKS_PER_LP)["num_nonzero"] == 0  # fresh pages read zero
    assert b.ask("alloc", n=2 * BLOCKS_PER_LP)["num_nonzero"] == 0
    assert system.check_accounting()["free_bytes"] == CAPACITY - 5 * LP_BYTES
    assert all(d == "cpu" for d in a.ask("info")["devices"])  # CPU views of fake device memory

    # a keeps two spare pages; b's grow needs one of them: the daemon reclaims it.
    a.ask("free", n=-1)
    grown = b.ask("alloc", n=5 * BLOCKS_PER_LP)
    assert grown["num_nonzero"] == 0, "pages a gave back reached b with a's bytes"
    assert system.tenants()["a"]["mapped_bytes"] <= LP_BYTES
    assert b.ask("verify") == {"ok": True, "num_blocks": 7 * BLOCKS_PER_LP}
    system.check_accounting()

    # Warm sleep: b's bytes go to page-locked host buffers; a uses the memory meanwhile.
    b_ptrs = b.ask("info")["data_ptrs"]
    system.client.sleep("b", mode="warm")
    assert system.tenants()["b"]["state"] == "sleeping-warm"
    assert system.tenants()["b"]["mapped_bytes"] == 0
    assert a.ask("alloc", n=4 * BLOCKS_PER_LP)["num_nonzero"] == 0
    a.ask("free", n=-1)
    system.client.set_limit("a", max_bytes=LP_BYTES)  # a gives back its spare pages
    wait_until(lambda: system.tenants()["a"]["mapped_bytes"] <= LP_BYTES, 30, "a kept its spare pages")
    system.client.wake("b")
    wait_until(lambda: b.ask("info")["mapped_bytes"] == 7 * LP_BYTES, 30, "b's pool did not map its pages")
    assert b.ask("verify") == {"ok": True, "num_blocks": 7 * BLOCKS_PER_LP}  # every byte, same addresses
    assert b.ask("info")["data_ptrs"] == b_ptrs

    # Cold sleep: a wakes to an empty pool whose new pages read zero.
    a.ask("alloc", n=BLOCKS_PER_LP)
    system.client.sleep("a", mode="cold")
    system.client.wake("a")
    wait_until(lambda: a.ask("info")["sleep_mode"] is None, 30, "a's pool did not wake")
    a.ask("forget")
    assert a.ask("alloc", n=BLOCKS_PER_LP)["num_nonzero"] == 0
    system.check_accounting()

    daemon_calls = system.calls(daemon.pid)
    copies = [c for c in daemon_calls if c.name in ("cuMemcpyDtoHAsync", "cuMemcpyHtoDAsync")]
    for name in ("cuMemcpyDtoHAsync", "cuMemcpyHtoDAsync"):  # b's 7 logical pages, K and V, each way
        assert sum(copied_bytes(c) for c in copies if c.name == name) == 14 * PAGE_BYTES, name
    assert all("pinned=1" in c.detail for c in copies), "a swap copy used pageable memory"
    assert not [c for c in daemon_calls if c.name in ("cuMemcpyDtoH", "cuMemcpyHtoD")], "a page-by-page copy"
    assert any(c.name == "cuMemHostRegister" for c in daemon_calls)
    a.close()
    b.close()
    status = system.check_accounting()
    assert status["tenants"] == [] and status["free_bytes"] == CAPACITY
    assert system.failed_calls() == [], "a driver call failed"


def test_a_killed_tenant_and_a_restarted_daemon_lose_nothing(system: System) -> None:
    first = system.start_daemon()
    a, b = system.tenant("a", tag=1), system.tenant("b", tag=2)
    a.ask("alloc", n=2 * BLOCKS_PER_LP)
    b.ask("alloc", n=2 * BLOCKS_PER_LP)
    b_mapped = b.ask("info")["mapped_bytes"]

    os.kill(a.proc.pid, signal.SIGKILL)
    wait_until(lambda: "a" not in system.tenants(), 30, "a's lease was not ended")
    assert system.check_accounting()["free_bytes"] == CAPACITY - b_mapped
    assert b.ask("verify")["ok"]

    os.kill(first.pid, signal.SIGKILL)
    first.wait(10)
    assert b.ask("verify")["ok"], "b lost its KV when the daemon died"
    system.start_daemon()

    def old_pages_released() -> bool:  # the hand-over's last step: the dead daemon's pages go
        released = [c for c in system.calls(b.proc.pid) if c.name == "cuMemRelease" and c.result == 0]
        return len(released) >= b_mapped // PAGE_BYTES

    wait_until(old_pages_released, 60, "b did not hand its pages over to the new daemon")
    assert system.tenants()["b"]["mapped_bytes"] == b_mapped
    assert b.ask("verify") == {"ok": True, "num_blocks": 2 * BLOCKS_PER_LP}
    assert b.ask("alloc", n=BLOCKS_PER_LP)["num_nonzero"] == 0
    assert b.ask("verify")["ok"]
    b.close()
    assert system.check_accounting()["free_bytes"] == CAPACITY
    assert system.failed_calls() == [], "a driver call failed"


def test_kernel_pointers_stay_mapped_when_every_other_page_is_returned(system: System) -> None:
    """Triton's launcher asks ``cuPointerGetAttribute`` about every pointer argument; a cache's
    ``data_ptr`` is its segment's logical page 0, so that page must stay mapped while the pool lives.

    Passes once ``KVPool`` keeps logical page 0 of every segment mapped for its whole life
    (issue #11, risk a: the pool side of the fix); fails before that.
    """
    system.start_daemon()
    t = system.tenant("t", tag=3, spare=0)
    t.ask("alloc", n=3 * BLOCKS_PER_LP)
    assert t.ask("pointers")["failed"] == []
    t.ask("free", n=-1)  # no spare pages kept: every page the pool can return goes back
    answer = t.ask("pointers")
    assert answer["failed"] == [], f"kernel launches would fail: {answer}"
    t.close()


def test_the_engine_generates_through_a_warm_sleep(system: System) -> None:
    pytest.importorskip("transformers")
    from tests.integrations.models import random_prompts, reference_outputs, tiny_model

    daemon = system.start_daemon()
    engine = system.engine("engine", "llama", seed=4)
    model = tiny_model("llama", seed=4)
    prompts = random_prompts([19, 33, 7], seed=5)
    expected = reference_outputs(model, prompts, 24)
    assert engine.ask("generate", prompts=prompts, new=24)["outputs"] == expected
    system.client.sleep("engine", mode="warm")  # idle: its KV (and prefix cache) goes to host memory
    assert engine.ask("generate", prompts=prompts, new=24)["outputs"] == expected  # woken, restored
    engine.send("generate", prompts=prompts, new=24)
    system.client.sleep("engine", mode="warm")  # between two steps (or once done): it wakes itself
    assert engine.read()["outputs"] == expected
    copies = [c for c in system.calls(daemon.pid) if c.name in ("cuMemcpyDtoHAsync", "cuMemcpyHtoDAsync")]
    assert {c.name for c in copies} == {"cuMemcpyDtoHAsync", "cuMemcpyHtoDAsync"}, "no warm sleep and wake happened"
    assert all("pinned=1" in c.detail for c in copies)
    engine.close()
    assert system.failed_calls() == [], "a driver call failed"
