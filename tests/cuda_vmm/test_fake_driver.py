"""The fake CUDA driver keeps the real driver's rules, and ``CudaBackend`` runs on it.

The cases live in ``tests.cuda_vmm.fake_cases`` and run in one child process
that loads the fake ``libcuda.so.1`` (the test process never does); each case
here reports that child's verdict with its traceback. Skipped where no C
compiler or no cuda-python is installed.

Cost: one child process (torch import, about 3 s) plus one per crash case.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests import child_cases
from tests.cuda_vmm import fake_cases
from tests.cuda_vmm.conftest import FakeCuda

MODULE = "tests.cuda_vmm.fake_cases"


@pytest.fixture(scope="module")
def verdicts(fake_cuda: FakeCuda, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    return child_cases.verdicts(MODULE, fake_cuda.env(tmp_path_factory.mktemp("fake-cases") / "driver.log"))


@pytest.mark.parametrize("name", sorted(fake_cases.CASES))
def test_case_under_the_fake_driver(verdicts: dict[str, str | None], name: str) -> None:
    child_cases.report(verdicts, name)


def test_touching_a_page_before_its_access_is_set_faults(fake_cuda: FakeCuda, tmp_path: Path) -> None:
    done = child_cases.run(MODULE, fake_cuda.env(tmp_path / "driver.log"),
                           "crash_touching_a_mapping_before_its_access_is_set")
    assert done.returncode == -signal.SIGSEGV, f"exit {done.returncode}:\n{done.stdout}\n{done.stderr}"
    assert done.stdout == "", "the read returned a value"
