"""Fixtures of the vLLM tests: the checked vLLM surface with the plugin installed, daemons, a model dir.

Tests that need vLLM skip (with the reason) where it does not import; CI
installs it in its own virtualenv (``.ci/run``) and runs them there.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvdaemon.integrations.vllm.config import PluginConfig

from tests.conftest import RunningDaemon, running_daemon

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM's CPU platform: configs build without a GPU

PAGE_BYTES = 64 * 1024
"""Small daemon pages: 16 blocks of the tests' 4 KiB vLLM pages each."""

VLLM_MISSING = (
    "vLLM is not installed in this environment; .ci/run installs vllm==0.33.0 (--no-deps, CPU torch) "
    "in .venv-vllm and runs these tests there"
)


@pytest.fixture(scope="session")
def surface() -> Any:
    """vLLM's checked surface, with the plugin's patches installed in this process."""
    pytest.importorskip("vllm", reason=VLLM_MISSING)
    from kvdaemon.integrations.vllm.gate import check_vllm
    from kvdaemon.integrations.vllm.patches import install

    checked = check_vllm()
    install(checked, PluginConfig(tenant="unused-by-the-scheduler-tests"))
    return checked


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("vllm", reason=VLLM_MISSING)
    from .engines import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def kvd() -> Iterator[RunningDaemon]:
    """A daemon of 2 MiB: 16 logical pages (of 2 layers), 256 vLLM blocks in all."""
    with running_daemon("2MiB", page_size_bytes=PAGE_BYTES) as running:
        yield running
