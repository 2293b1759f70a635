"""``bench/gpu_check.py`` runs to the end whatever its checks do, and always reports.

On this CPU machine every check fails (no GPU), which is what these tests
need: each failure must stay that check's own, with its traceback, and the
summary and JSON must be written, also when the run is stopped by SIGTERM.
Cost: a few child processes (a torch import each).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from tests.conftest import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
GPU_CHECK = REPO_ROOT / "bench" / "gpu_check.py"

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the failure paths, on a machine without a GPU")


def gpu_check(*args: str) -> list[str]:
    return [sys.executable, str(GPU_CHECK), *args]


def test_every_failing_check_is_reported_and_the_run_goes_on(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(gpu_check("--only", "cuda_start", "zeroed_pages", "swap_sliced", "--json", str(out)),
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    assert [line.split()[:2] for line in lines if line.startswith(("PASS", "FAIL"))] == [
        ["FAIL", "cuda_start"], ["FAIL", "zeroed_pages"], ["FAIL", "swap_sliced"]]
    assert any(line.startswith("SUMMARY  0 passed, 3 failed") for line in lines)
    record = json.loads(out.read_text())
    assert record["passed"] == 0 and record["failed"] == 3 and record["not_run"] == []
    for name in ("cuda_start", "zeroed_pages", "swap_sliced"):
        assert record["checks"][name]["ok"] is False
        assert "Traceback" in record["checks"][name]["error"]


def test_a_stopped_run_still_writes_its_summary(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    proc = subprocess.Popen(gpu_check("--only", "cuda_start", "torch_view", "swap_copy", "--json", str(out)),
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    runner = psutil.Process(proc.pid)
    wait_until(lambda: bool(runner.children()), 30, "the first check did not start")
    proc.send_signal(signal.SIGTERM)  # while the first check runs
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "gpu_check: stopped" in stdout and "SUMMARY" in stdout
    wait_until(out.exists, 5, "no JSON was written")
    record = json.loads(out.read_text())
    assert record["not_run"] == ["cuda_start", "torch_view", "swap_copy"]
    assert record["checks"] == {}
