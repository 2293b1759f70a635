"""The ``cuda`` backend on a machine without a usable GPU: clear refusals, host fallback.

These tests run on CPU-only machines (CI) and are skipped where a CUDA GPU works.
The "no CUDA driver" message is checked only where the driver library itself is
absent; a machine with a driver but no GPU gets a different (also clear) message.
"""

from __future__ import annotations

import ctypes

import pytest

from kvdaemon.cuda_vmm import CudaBackend, cuda_available, open_backend
from kvdaemon.errors import BackendError


def _driver_library_loads() -> bool:
    """True when ``libcuda.so.1`` can be loaded, whether or not a GPU is present."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


_HAS_CUDA = cuda_available()
_HAS_DRIVER_LIBRARY = _driver_library_loads()

pytestmark = pytest.mark.skipif(_HAS_CUDA, reason="a CUDA GPU is usable here")

no_driver_only = pytest.mark.skipif(
    _HAS_DRIVER_LIBRARY, reason="the CUDA driver library is installed here"
)


@no_driver_only
def test_open_backend_cuda_says_there_is_no_driver() -> None:
    with pytest.raises(BackendError, match="no CUDA driver") as info:
        open_backend("cuda")
    assert "--backend host" in str(info.value)  # the message says what to do instead


@no_driver_only
def test_cuda_backend_start_says_there_is_no_driver_every_time() -> None:
    backend = CudaBackend(num_pages=4)
    for _ in range(2):  # a failed start leaves nothing half-open behind
        with pytest.raises(BackendError, match="no CUDA driver"):
            backend.start()
    with pytest.raises(BackendError, match="not started"):
        backend.reserve(backend.page_size_bytes)
    backend.close()  # closing a backend that never started is a no-op


def test_cuda_backend_refuses_to_start_without_a_gpu() -> None:
    with pytest.raises(BackendError):
        CudaBackend().start()
    with pytest.raises(BackendError):
        open_backend("cuda")


def test_auto_falls_back_to_the_host_backend() -> None:
    backend = open_backend("auto", num_pages=2)
    try:
        assert backend.name == "host"
        assert backend.num_pages == 2
        addr = backend.reserve(backend.page_size_bytes)
        backend.map_page(addr, backend.create_page(0))
        backend.unmap(addr, backend.page_size_bytes)
        backend.free_range(addr)
    finally:
        backend.close()


def test_auto_does_not_fall_back_to_host_for_a_named_gpu() -> None:
    with pytest.raises(BackendError, match="device 2 names a CUDA GPU, and it is not usable here") as info:
        open_backend("auto", num_pages=2, device=2)
    assert info.value.code == "BACKEND_ERROR"
    assert "without --device, auto runs on host memory" in info.value.message


def test_the_host_backend_has_device_0_alone() -> None:
    with pytest.raises(BackendError, match="the host backend has no device 1") as info:
        open_backend("host", num_pages=2, device=1)
    assert info.value.code == "BACKEND_ERROR"
    backend = open_backend("host", num_pages=2, device=0)
    assert backend.device == 0
    backend.close()
