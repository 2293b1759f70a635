"""Choosing and opening a backend by name: ``auto``, ``cuda`` or ``host``."""

from __future__ import annotations

from kvdaemon.cuda_vmm.backend import DEFAULT_PAGE_SIZE_BYTES, Backend
from kvdaemon.cuda_vmm.cuda import CudaBackend
from kvdaemon.cuda_vmm.host import HostBackend
from kvdaemon.errors import BackendError

BACKEND_NAMES = ("auto", "cuda", "host")


def cuda_available(device: int = 0) -> bool:
    """True when the CUDA driver loads and ``device`` exists. Costs one cuInit."""
    return _cuda_refusal(device) is None


def auto_kind(device: int = 0) -> str:
    """The backend ``auto`` picks: ``cuda`` where ``device`` is usable; else ``host``, but only
    for device 0. A nonzero ``device`` names a GPU: where it is not usable that is a
    ``BackendError`` saying why, never a silent fall back to host memory."""
    refusal = _cuda_refusal(device)
    if refusal is None:
        return "cuda"
    if device:
        raise BackendError(f"device {device} names a CUDA GPU, and it is not usable here ({refusal.message}); "
                           "without --device, auto runs on host memory")
    return "host"


def _cuda_refusal(device: int) -> BackendError | None:
    """Why the cuda backend cannot start on ``device``, or None where it can."""
    probe = CudaBackend(device=device)
    try:
        probe.start()
    except BackendError as err:
        return err
    probe.close()
    return None


def open_backend(
    kind: str = "auto",
    *,
    num_pages: int = 0,
    page_size_bytes: int = DEFAULT_PAGE_SIZE_BYTES,
    device: int = 0,
) -> Backend:
    """Build and start a backend. ``auto`` picks cuda where a usable GPU exists, else host
    (``auto_kind``). ``device`` chooses the GPU; the host backend is device 0 alone.

    ``num_pages`` is the pool size on the creating side (the daemon); a client
    that only imports pages passes 0. Raises ``BackendError`` for an unknown
    kind, a device the kind has not, or a backend that cannot start (with the reason).
    """
    if kind not in BACKEND_NAMES:
        raise BackendError(f"unknown backend {kind!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if kind == "auto":
        kind = auto_kind(device)
    if kind == "host" and device:
        raise BackendError(f"the host backend has no device {device}: --device chooses a CUDA GPU "
                           "(host memory is device 0)")
    cls = CudaBackend if kind == "cuda" else HostBackend
    backend = cls(num_pages=num_pages, page_size_bytes=page_size_bytes, device=device)
    backend.start()
    return backend
