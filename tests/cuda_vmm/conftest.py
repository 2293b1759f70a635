"""Factories for backend tests: a host backend, and the fake CUDA driver built once per session."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvdaemon.cuda_vmm import HostBackend

from tests.cuda_vmm import fake_driver

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


@dataclass(frozen=True)
class FakeCuda:
    """The built fake driver: ``env`` makes a child process load it, ``calls`` reads its log."""

    lib_dir: Path

    def env(self, log_path: Path, total_bytes: int | None = None) -> dict[str, str]:
        return fake_driver.env(self.lib_dir, log_path, total_bytes)

    @staticmethod
    def calls(log_path: Path) -> list[fake_driver.Call]:
        return fake_driver.read_log(log_path)


@pytest.fixture(scope="session")
def fake_cuda(tmp_path_factory: pytest.TempPathFactory) -> FakeCuda:
    """The fake libcuda, compiled once per session; skips where it cannot be built or used."""
    pytest.importorskip("cuda.bindings.driver", reason="cuda-python is not installed (kvdaemon[cuda])")
    if fake_driver.compiler() is None:
        pytest.skip("no C compiler (cc or gcc) to build the fake CUDA driver")
    return FakeCuda(fake_driver.build(tmp_path_factory.mktemp("fake-cuda")))
