"""The fake CUDA driver keeps the real driver's rules, and ``CudaBackend`` runs on it.

The cases live in ``tests.cuda_vmm.fake_cases`` and run in one child process
that loads the fake ``libcuda.so.1`` (the test process never does); each case
here reports that child's verdict with its traceback. Skipped where no C
compiler or no cuda-python is installed.

Cost: one child process (torch import, about 3 s) plus one per crash case.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cuda_vmm import fake_cases
from tests.cuda_vmm.conftest import FakeCuda

REPO_ROOT = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 120


def run_cases(fake_cuda: FakeCuda, log_path: Path, *names: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.cuda_vmm.fake_cases", *names],
        cwd=REPO_ROOT, env=fake_cuda.env(log_path), capture_output=True, text=True,
        timeout=CHILD_TIMEOUT_S, check=False,
    )


@pytest.fixture(scope="module")
def verdicts(fake_cuda: FakeCuda, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    """Every case's result from one child: ``None`` when it passed, else its traceback."""
    done = run_cases(fake_cuda, tmp_path_factory.mktemp("fake-cases") / "driver.log")
    assert done.returncode == 0, f"the case runner failed:\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])["results"]


@pytest.mark.parametrize("name", sorted(fake_cases.CASES))
def test_case_under_the_fake_driver(verdicts: dict[str, str | None], name: str) -> None:
    assert name in verdicts, f"{name} did not run"
    if verdicts[name] is not None:
        pytest.fail(f"{name} failed in the child:\n{verdicts[name]}", pytrace=False)


def test_touching_a_page_before_its_access_is_set_faults(fake_cuda: FakeCuda, tmp_path: Path) -> None:
    done = run_cases(fake_cuda, tmp_path / "driver.log", "crash_touching_a_mapping_before_its_access_is_set")
    assert done.returncode == -signal.SIGSEGV, f"exit {done.returncode}:\n{done.stdout}\n{done.stderr}"
    assert done.stdout == "", "the read returned a value"
