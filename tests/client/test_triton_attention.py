"""The Triton kernels under Triton's interpreter, against the torch path (cases: ``triton_cases``).

Triton's interpreter (``TRITON_INTERPRET=1``) runs each kernel program with
numpy on CPU tensors, so the kernels' indexing, masking, online softmax and
GQA grouping are checked on machines without a GPU. The cases run in one
child process with that variable set (Triton reads it when it is first
imported); each is reported here. Skipped where triton is not installed.

The matrix: fp16 and fp32; head_dim 64, 80, 128; GQA 1, 4, 8; block 16 and
32; ragged batches mixing decode, chunked and full prefill with context 1,
partial last blocks and ``-1`` table padding; decode-only batches (the
kernel's other tile shape); strided query, caches and block table; and
``store_kv`` with padded (``-1``) slots, strided K/V and an fp32 -> fp16 cast.

Cost: one child (torch and triton import, about 5 s) and about a second per
kernel launch in the interpreter.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests import child_cases
from tests.client import triton_cases

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install 'kvdaemon[ci]')")
MODULE = "tests.client.triton_cases"


@pytest.fixture(scope="module")
def verdicts() -> dict[str, str | None]:
    return child_cases.verdicts(MODULE, {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("name", [
    *triton_cases.CASES,
    *(pytest.param(name, marks=pytest.mark.skip(reason=why)) for name, why in triton_cases.SKIPPED.items()),
])
def test_kernel_case_in_the_interpreter(verdicts: dict[str, str | None], name: str) -> None:
    child_cases.report(verdicts, name)
