"""GPU checks: the one script a session with an NVIDIA GPU runs (DESIGN.md section 12).

Run from the repository root, with the project installed (``bench/gpu_run.sh``
does it on a bare machine)::

    python bench/gpu_check.py [--json PATH] [--only NAME ...] [--timeout S] [--budget S]

Each check runs in a child process of its own (``--check NAME``, internal), so
whatever one does (an exception, a sticky CUDA fault, a crash, a hang past
its time limit) is that check's FAIL, with its traceback or its output's tail,
and the run goes on; checks that would start past ``--budget`` seconds, or
after a SIGTERM or Ctrl-C, are listed as not run. Each check prints ``PASS``
or ``FAIL`` with its figures; the summary line and the JSON
(``bench/results/gpu_check.json``, and ``--json PATH`` too) are written
whatever happened. Exit status 0 when every
check passed, else 1. This runner imports neither torch nor kvdaemon.

Checks, in order (``gpu_backend_checks``, ``gpu_pointer_checks``,
``gpu_attention``, ``gpu_engine``):

- ``cuda_start``: the backend starts; device, torch, triton, cuda-bindings.
- ``cross_process``: a page crosses processes as an fd; both see each other's writes.
- ``map_latency``: map/unmap per page against the raw driver and ``torch.empty``.
- ``torch_view``: views at one address agree; copy bandwidth into a view.
- ``view_before_map``: views over unmapped ranges work once mapped (this torch).
- ``zeroed_pages``: created pages read zero after the memory held other bytes.
- ``kernel_pointers``: Triton kernels launch over caches with only page 0 mapped.
- ``swap_copy``: page copies to and from pinned host memory, bandwidth.
- ``swap_sliced``: the daemon's sliced warm copy (buffer pinned on its own thread) against one whole copy.
- ``attention``: Triton against the torch path (fp32/fp16/bf16), decode bandwidth.
- ``pool_pointers``: a pool that returned every page it could still launches kernels.
- ``engine``: the transformers ``Engine`` over cuda daemon KV equals ``generate``.

Cost: about two minutes on an H200 (torch start-up per child dominates), at
most about 4 GiB of device memory at a time.
"""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

from report import save  # noqa: E402

CHECKS: dict[str, str] = {
    "cuda_start": "gpu_backend_checks:check_cuda_start",
    "cross_process": "gpu_backend_checks:check_cross_process",
    "map_latency": "gpu_backend_checks:check_map_latency",
    "torch_view": "gpu_backend_checks:check_torch_view",
    "view_before_map": "gpu_backend_checks:check_view_before_map",
    "zeroed_pages": "gpu_backend_checks:check_zeroed_pages",
    "kernel_pointers": "gpu_pointer_checks:check_kernel_pointers",
    "swap_copy": "gpu_backend_checks:check_swap_copy",
    "swap_sliced": "gpu_swap_check:check_swap_sliced",
    "attention": "gpu_attention:gpu_attention_check",
    "pool_pointers": "gpu_pointer_checks:check_pool_pointers",
    "engine": "gpu_engine:gpu_engine_check",
}
CHECK_TIMEOUT_S = 300
BUDGET_S = 1800
RESULT_PREFIX = "GPU_CHECK_RESULT "  # the child's last line: this prefix and its JSON record
TAIL_CHARS = 3000


def load(target: str) -> Callable[[], dict[str, Any]]:
    """The check function named ``module:function`` (a module of this folder)."""
    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)


def run_here(name: str) -> dict[str, Any]:
    """Run one check in this process; any failure, whatever it is, becomes its record."""
    t0 = time.perf_counter()
    try:
        figures = load(CHECKS[name])()
    except (Exception, SystemExit):  # noqa: BLE001 (a harness boundary: one check's failure is its result)
        return {"ok": False, "seconds": round(time.perf_counter() - t0, 2), "error": traceback.format_exc()}
    return {"ok": True, "seconds": round(time.perf_counter() - t0, 2), "figures": figures}


def run_child(name: str, timeout_s: float) -> dict[str, Any]:
    """Run one check in a child process; a crash or a hang is a FAIL with the output's tail."""
    t0 = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--check", name],
                              capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        output = _text(exc.stdout) + _text(exc.stderr)
        return {"ok": False, "seconds": round(time.perf_counter() - t0, 2),
                "error": f"no result within {timeout_s} s\n{output[-TAIL_CHARS:]}"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    return {"ok": False, "seconds": round(time.perf_counter() - t0, 2),
            "error": f"the check's process exited with {done.returncode} and no result\n"
                     f"{(done.stdout + done.stderr)[-TAIL_CHARS:]}"}


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def print_record(name: str, record: dict[str, Any]) -> None:
    verdict = "PASS" if record["ok"] else "FAIL"
    print(f"{verdict}  {name:<16} {record['seconds']:7.2f} s", flush=True)
    for key, value in record.get("figures", {}).items():
        print(f"        {key:<36} {value}")
    if not record["ok"]:
        print("        " + record["error"].rstrip().replace("\n", "\n        "), flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="GPU checks of kvdaemon (see the module docstring).")
    parser.add_argument("--json", type=Path, help="also write the JSON record here")
    parser.add_argument("--only", nargs="+", choices=list(CHECKS), help="run only these checks")
    parser.add_argument("--timeout", type=float, default=CHECK_TIMEOUT_S, help="seconds per check")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole run")
    parser.add_argument("--check", choices=list(CHECKS), help=argparse.SUPPRESS)  # the child side
    opts = parser.parse_args(argv)
    if opts.check:
        print(RESULT_PREFIX + json.dumps(run_here(opts.check)), flush=True)
        return 0
    names = opts.only or list(CHECKS)
    signal.signal(signal.SIGTERM, _interrupt)
    t0 = time.perf_counter()
    records: dict[str, dict[str, Any]] = {}
    try:
        for name in names:
            left = opts.budget - (time.perf_counter() - t0)
            if left <= 1:
                print(f"gpu_check: the {opts.budget:.0f} s budget is spent", flush=True)
                break
            records[name] = run_child(name, min(opts.timeout, left))
            print_record(name, records[name])
    except KeyboardInterrupt:
        print("gpu_check: stopped", flush=True)
    finally:
        summarize(names, records, time.perf_counter() - t0, opts.json)
    return 0 if all(r["ok"] for r in records.values()) and len(records) == len(names) else 1


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def summarize(names: list[str], records: dict[str, dict[str, Any]], seconds: float, extra: Path | None) -> None:
    """Print the summary line and write the JSON (here and to ``extra``), whatever ran."""
    failed = [n for n, r in records.items() if not r["ok"]]
    not_run = [n for n in names if n not in records]
    record = {"passed": len(records) - len(failed), "failed": len(failed), "not_run": not_run,
              "seconds": round(seconds, 1), "checks": records}
    path = save("gpu_check", record)
    if extra is not None:
        extra.parent.mkdir(parents=True, exist_ok=True)
        extra.write_text(json.dumps(record, indent=2) + "\n")
    print(f"SUMMARY  {len(records) - len(failed)} passed, {len(failed)} failed"
          f"{' (' + ', '.join(failed) + ')' if failed else ''}"
          f"{', not run: ' + ', '.join(not_run) if not_run else ''}"
          f" of {len(names)} checks in {seconds:.1f} s; figures in {path}", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
