"""Building, loading and reading the fake CUDA driver (a test double of ``libcuda.so.1``).

The C sources beside this file implement the driver calls kvdaemon makes over
host memory (see ``fake_cuda.h``). ``build`` compiles them with the system C
compiler into a folder holding ``libcuda.so.1``; a process started with
``env(...)`` finds that library first (``LD_LIBRARY_PATH``), so cuda-bindings,
and with it ``CudaBackend``, runs on it unchanged. The test process itself
never loads it: every process that uses it is a child.

``read_log`` parses the call log each process appends to (``FAKE_CUDA_LOG``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
SOURCES = ("fake_core.c", "fake_vmm.c", "fake_copy.c")
LIBRARY_NAME = "libcuda.so.1"
DEVICE_NAME = "kvdaemon fake CUDA device (host memory)"
GARBAGE_HIGH_BITS = 0xC0
"""Every byte of a fresh fake allocation has these bits set (never zero), like a reused GPU page."""


def compiler() -> str | None:
    """The system C compiler (``cc``, else ``gcc``), or ``None`` where there is none."""
    return shutil.which("cc") or shutil.which("gcc")


def build(dest: Path) -> Path:
    """Compile the fake driver into ``dest/libcuda.so.1``; return ``dest``.

    Raises ``RuntimeError`` with the compiler's output when it fails.
    Cost: about a second.
    """
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [cc, "-std=c11", "-O1", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC",
           f"-Wl,-soname,{LIBRARY_NAME}", "-o", str(dest / LIBRARY_NAME),
           *(str(SOURCE_DIR / name) for name in SOURCES), "-lpthread"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"building the fake CUDA driver failed:\n{done.stdout}{done.stderr}")
    return dest


def env(lib_dir: Path, log_path: Path, total_bytes: int | None = None) -> dict[str, str]:
    """This process's environment plus what makes a child load the fake driver and log to ``log_path``."""
    child = dict(os.environ)
    child["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(lib_dir), child.get("LD_LIBRARY_PATH", "")) if p
    )
    child["FAKE_CUDA_LOG"] = str(log_path)
    if total_bytes is not None:
        child["FAKE_CUDA_TOTAL_BYTES"] = str(total_bytes)
    child.setdefault("OMP_NUM_THREADS", "1")
    return child


@dataclass(frozen=True)
class Call:
    """One logged driver call: process, thread, current context (``None``: none), name, result."""

    pid: int
    tid: int
    context: int | None
    name: str
    result: int
    detail: str


def read_log(path: Path) -> list[Call]:
    """Every call logged to ``path`` so far, in order (an absent file: none)."""
    if not path.exists():
        return []
    calls = []
    for line in path.read_text().splitlines():
        pid, tid, context, name, result, detail = line.split("\t", 5)
        ctx = None if context in ("(nil)", "0x0") else int(context, 16)
        calls.append(Call(int(pid), int(tid), ctx, name, int(result), detail))
    return calls
