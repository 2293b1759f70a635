"""Choosing and opening a backend by name: ``auto``, ``cuda`` or ``host``."""

from __future__ import annotations

from kvdaemon.cuda_vmm.backend import DEFAULT_PAGE_SIZE_BYTES, Backend
from kvdaemon.cuda_vmm.cuda import CudaBackend
from kvdaemon.cuda_vmm.host import HostBackend
from kvdaemon.errors import BackendError

BACKEND_NAMES = ("auto", "cuda", "host")


def cuda_available(device: int = 0) -> bool:
    """True when the CUDA driver loads and ``device`` exists. Costs one cuInit."""
    probe = CudaBackend(device=device)
    try:
        probe.start()
    except BackendError:
        return False
    probe.close()
    return True


def open_backend(
    kind: str = "auto",
    *,
    num_pages: int = 0,
    page_size_bytes: int = DEFAULT_PAGE_SIZE_BYTES,
    device: int = 0,
) -> Backend:
    """Build and start a backend. ``auto`` picks cuda where a usable GPU exists, else host.

    ``num_pages`` is the pool size on the creating side (the daemon); a client
    that only imports pages passes 0. Raises ``BackendError`` for an unknown
    kind or a backend that cannot start (with the reason).
    """
    if kind not in BACKEND_NAMES:
        raise BackendError(f"unknown backend {kind!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if kind == "auto":
        kind = "cuda" if cuda_available(device) else "host"
    cls = CudaBackend if kind == "cuda" else HostBackend
    backend = cls(num_pages=num_pages, page_size_bytes=page_size_bytes, device=device)
    backend.start()
    return backend
