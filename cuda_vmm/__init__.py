"""Virtual-memory backends behind one interface: ``cuda`` (driver VMM) and ``host`` (memfd).

The backends load on first use (``kvdaemon.cuda_vmm.HostBackend`` imports ``host``): a module
that needs only ``PhysicalPage`` or ``Backend`` (the daemon's tables, the CLI) pays for neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvdaemon.cuda_vmm.backend import DEFAULT_PAGE_SIZE_BYTES, Backend, MemInfo, PhysicalPage
from kvdaemon.lazy_names import lazy_names

if TYPE_CHECKING:
    from kvdaemon.cuda_vmm.chooser import BACKEND_NAMES, auto_kind, cuda_available, open_backend
    from kvdaemon.cuda_vmm.cuda import CudaBackend
    from kvdaemon.cuda_vmm.host import HostBackend

_LAZY = {
    "CudaBackend": "kvdaemon.cuda_vmm.cuda",
    "HostBackend": "kvdaemon.cuda_vmm.host",
    "BACKEND_NAMES": "kvdaemon.cuda_vmm.chooser",
    "auto_kind": "kvdaemon.cuda_vmm.chooser",
    "cuda_available": "kvdaemon.cuda_vmm.chooser",
    "open_backend": "kvdaemon.cuda_vmm.chooser",
}

__all__ = [
    "BACKEND_NAMES",
    "DEFAULT_PAGE_SIZE_BYTES",
    "Backend",
    "CudaBackend",
    "HostBackend",
    "MemInfo",
    "PhysicalPage",
    "auto_kind",
    "cuda_available",
    "open_backend",
]


__getattr__ = lazy_names(__name__, _LAZY, globals())
