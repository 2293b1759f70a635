"""Virtual-memory backends behind one interface: ``cuda`` (driver VMM) and ``host`` (memfd)."""

from kvdaemon.cuda_vmm.backend import DEFAULT_PAGE_SIZE_BYTES, Backend, MemInfo, PhysicalPage
from kvdaemon.cuda_vmm.cuda import CudaBackend
from kvdaemon.cuda_vmm.host import HostBackend
from kvdaemon.cuda_vmm.chooser import BACKEND_NAMES, auto_kind, cuda_available, open_backend

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
