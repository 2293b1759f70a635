"""Factories for backend tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvdaemon.cuda_vmm import HostBackend

PAGE_BYTES = 2 * 1024 * 1024


def make_host(num_pages: int = 8, page_size_bytes: int = PAGE_BYTES) -> HostBackend:
    """A started host backend with a pool of ``num_pages``."""
    backend = HostBackend(num_pages=num_pages, page_size_bytes=page_size_bytes)
    backend.start()
    return backend


@pytest.fixture
def host() -> Iterator[HostBackend]:
    backend = make_host()
    yield backend
    backend.close()
