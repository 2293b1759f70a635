"""Test cases that must run in a child process, reported one by one in the test process.

Some cases need an environment the test process must not have: the fake CUDA
driver loaded (``tests.cuda_vmm.fake_cases``), or Triton imported in
interpreter mode (``tests.client.triton_cases``). Such a module keeps a dict of
named zero-argument cases and ends with ``child_cases.main(CASES)``; the test
module runs it once (``verdicts``) and parametrizes one test per case name,
each failing with the child's traceback (``report``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
CHILD_TIMEOUT_S = 600


def main(cases: dict[str, Callable[[], None]], before_each: Callable[[], None] | None = None) -> None:
    """Run the cases named on the command line (all by default), each isolated; print the verdicts.

    The last line of stdout is ``{"results": {name: null | traceback}}``.
    """
    results: dict[str, str | None] = {}
    for name in sys.argv[1:] or list(cases):
        if before_each is not None:
            before_each()
        try:
            cases[name]()
            results[name] = None
        except BaseException:  # noqa: BLE001 (one case's failure is that case's result)
            results[name] = traceback.format_exc()
    print(json.dumps({"results": results}), flush=True)


def run(module: str, env: dict[str, str], *names: str) -> subprocess.CompletedProcess[str]:
    """``python -m module names...`` from the repository root, in ``env``."""
    return subprocess.run(
        [sys.executable, "-m", module, *names], cwd=REPO_ROOT, env=env, capture_output=True,
        text=True, timeout=CHILD_TIMEOUT_S, check=False,
    )


def verdicts(module: str, env: dict[str, str]) -> dict[str, str | None]:
    """Every case's result from one child run: ``None`` when it passed, else its traceback."""
    done = run(module, env)
    assert done.returncode == 0, f"{module} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])["results"]


def report(results: dict[str, str | None], name: str) -> None:
    """Pass if case ``name`` passed in the child; fail with its traceback otherwise."""
    assert name in results, f"{name} did not run"
    if results[name] is not None:
        pytest.fail(f"{name} failed in the child:\n{results[name]}", pytrace=False)
