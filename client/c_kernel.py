"""Building and loading a C source shipped with the client: the system compiler, on first use.

``load(source)`` compiles ``source`` (a ``.c`` file) with the
system C compiler (``cc``, else ``gcc``) for this machine (``-O3
-march=native``) into a shared library and loads it with ``ctypes``. The
library is cached per user (``$XDG_CACHE_HOME/kvdaemon``, else
``~/.cache/kvdaemon``, else a temporary folder) under a name that hashes the
source, the flags, the compiler's version and the CPU's model and flags, so a
changed source, compiler or machine builds again and no process ever loads a
library built for another CPU. The build writes a temporary file and renames it
into place, so processes building at once never see half a library.

Where there is no compiler or the build fails, ``load`` returns ``None`` and logs
why once; callers keep their portable path. Cost: one build (about a second)
per source, machine and compiler; then one ``dlopen`` per process.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger("kvdaemon.client.c_kernel")
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=fast", "-fPIC", "-shared", "-pthread")
BUILD_TIMEOUT_S = 120.0

_lock = threading.Lock()
_loaded: dict[tuple[Path, tuple[str, ...]], ctypes.CDLL | None] = {}


def load(source: Path, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library built from ``source`` (with ``extra_flags`` after ``FLAGS``), or ``None`` (logged
    once). Thread-safe; one build per source and flags per process."""
    with _lock:
        key = (source, extra_flags)
        if key not in _loaded:
            _loaded[key] = _build_and_load(source, extra_flags)
        return _loaded[key]


def _build_and_load(path: Path, extra_flags: tuple[str, ...]) -> ctypes.CDLL | None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler (cc or gcc): %s is not built; the portable path runs instead", path.name)
        return None
    try:
        target = _cache_dir() / f"{path.stem}-{_fingerprint(path, compiler, extra_flags)}.so"
        if not target.exists():
            _build(compiler, path, target, extra_flags)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        log.warning("building %s failed (%s); the portable path runs instead", path.name, exc)
        return None


def _build(compiler: str, path: Path, target: Path, extra_flags: tuple[str, ...]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, *extra_flags, "-o", tmp, str(path)], capture_output=True,
                              text=True, timeout=BUILD_TIMEOUT_S, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} exited {done.returncode}: {done.stderr.strip()[:2000]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = Path(base) / "kvdaemon"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if os.access(folder, os.W_OK):
            return folder
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"kvdaemon-{os.getuid()}"


def _fingerprint(path: Path, compiler: str, extra_flags: tuple[str, ...]) -> str:
    """A hash of what the library depends on: source, flags, compiler, CPU."""
    digest = hashlib.sha256(path.read_bytes())
    digest.update(" ".join(FLAGS + extra_flags).encode())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=False)
    digest.update(version.stdout.encode())
    digest.update(platform.machine().encode())
    digest.update(_cpu_identity().encode())
    return digest.hexdigest()[:16]


CPUINFO = Path("/proc/cpuinfo")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``flags`` on x86, ``Features`` on ARM); empty where unreadable."""
    lines = _cpuinfo_lines()
    if lines is None:
        return frozenset()
    values = (lines[key].split(":", 1)[1] for key in ("flags", "Features") if key in lines)
    return frozenset(word for value in values for word in value.split())


def _cpu_identity() -> str:
    """The CPU's model and feature flags (what ``-march=native`` builds for)."""
    lines = _cpuinfo_lines()
    if lines is None:
        return platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(lines.get(key, "") for key in wanted)


def _cpuinfo_lines() -> dict[str, str] | None:
    """One line per field of ``CPUINFO`` (a field repeated per core: the last core's), or ``None``."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        return None
    return {line.split(":", 1)[0].strip(): line for line in text.splitlines() if ":" in line}
