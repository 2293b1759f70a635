"""What ``kvdaemon version`` reports: this install, the machine's CUDA, and the daemon.

Nothing here imports torch: its version is read from the installed package's
metadata. The CUDA driver is asked through cuda-bindings where installed
(``cuDriverGetVersion`` needs no GPU and no context); the kernel module's
version comes from ``/proc/driver/nvidia/version``. Each probe that cannot
answer gives ``None``, never an error. Cost: a few file reads and, without a
running daemon, one ``cuInit`` to tell which backend ``auto`` would choose.
"""

from __future__ import annotations

import platform
import re
from pathlib import Path
from typing import Any

from kvdaemon import __version__

NVIDIA_PROC_VERSION = Path("/proc/driver/nvidia/version")


def versions(daemon: dict[str, Any] | None, device: int = 0) -> dict[str, Any]:
    """The ``version --json`` object.

    ``daemon`` is the running daemon's ``hello`` answer (None when none
    answers); its backend is reported, else the one ``auto`` would choose on
    ``device``.
    """
    return {
        "kvdaemon": __version__,
        "python": platform.python_version(),
        "torch": package_version("torch"),
        "cuda_bindings": package_version("cuda-bindings"),
        "cuda_driver": cuda_driver_version(),
        "driver": kernel_driver_version(),
        "backend": daemon["backend"] if daemon else auto_backend(device),
        "daemon": None if daemon is None else {
            "version": daemon.get("daemon_version"), "pid": daemon.get("pid"),
            "backend": daemon.get("backend"),
        },
    }  # fmt: skip


def package_version(name: str) -> str | None:
    from importlib import metadata  # ~30 ms: only `version` asks

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cuda_driver_version() -> str | None:
    """The CUDA version the driver supports (``12.4``), or None without one."""
    try:
        from cuda.bindings import driver

        err, number = driver.cuDriverGetVersion()
    except Exception:  # noqa: BLE001 - a probe: no bindings, no libcuda, any loader error
        return None
    if err != driver.CUresult.CUDA_SUCCESS:
        return None
    return f"{number // 1000}.{number % 1000 // 10}"


def kernel_driver_version() -> str | None:
    """The NVIDIA kernel module's version (``550.54.15``), or None without one."""
    try:
        text = NVIDIA_PROC_VERSION.read_text()
    except OSError:
        return None
    match = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]+)", text)
    return match.group(1) if match else None


def auto_backend(device: int) -> str:
    """The backend ``--backend auto`` would pick on ``device``: cuda where usable, else host;
    for a nonzero ``device`` that is not usable, why not."""
    from kvdaemon.cuda_vmm import auto_kind
    from kvdaemon.errors import BackendError

    try:
        return auto_kind(device)
    except BackendError as err:
        return f"none ({err.message})"


def version_text(info: dict[str, Any], with_daemon: bool = True) -> str:
    """The lines of ``kvdaemon version`` (``--version``: without the daemon's line)."""
    daemon = info["daemon"]
    running = (
        "no daemon answering" if daemon is None
        else f"kvdaemon {daemon['version']} (pid {daemon['pid']}, backend {daemon['backend']})"
    )  # fmt: skip
    rows = [
        ("kvdaemon", info["kvdaemon"]),
        ("python", info["python"]),
        ("torch", info["torch"] or "not installed"),
        ("cuda-bindings", info["cuda_bindings"] or "not installed"),
        ("cuda driver", info["cuda_driver"] or "none"),
        ("nvidia driver", info["driver"] or "none"),
        ("backend", info["backend"]),
    ]
    if with_daemon:
        rows.append(("daemon", running))
    return "\n".join(f"{name:<14} {value}" for name, value in rows)
