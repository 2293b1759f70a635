"""Fixtures of the transformers tests: a daemon with small pages, a client, the tiny models."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvdaemon.client import KVClient

from tests.conftest import RunningDaemon, running_daemon

PAGE_BYTES = 64 * 1024
"""Small daemon pages, so that a few dozen blocks fill a page and exhaustion is cheap to reach."""


@pytest.fixture(scope="module")
def kvd() -> Iterator[RunningDaemon]:
    with running_daemon("64MiB", page_size_bytes=PAGE_BYTES) as running:
        yield running


@pytest.fixture(scope="module")
def client(kvd: RunningDaemon) -> Iterator[KVClient]:
    client = kvd.client()
    yield client
    client.close()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request: pytest.FixtureRequest) -> Any:
    pytest.importorskip("transformers")
    from .models import tiny_model

    return tiny_model(request.param)
