"""Decode attention on the CPU with K/V read in place: ``cpu_decode.c``, through ``ctypes``.

``attend(...)`` computes the attention of one new token for each of the given
sequences over their cached K/V, writing the rows of ``out``: the kernel walks
each sequence's blocks in place (no gathered copy of K/V, so K/V move once, as
for SDPA over contiguous tensors), on ``torch.get_num_threads()`` threads, with
the GIL released. ``usable(...)`` says whether a call can go there: CPU
tensors of fp32, bf16 or fp16, every row's last dimension contiguous,
``head_dim`` a multiple of 16 up to 256, at most 32 query heads per KV head, and
the kernel built (``c_kernel``; it is not where no C compiler is), and by default
a CPU it was measured on: AVX-512F, or AVX2 with FMA (``fast_vectors``; ``lanes()``
says which width the build computes with). Otherwise the caller keeps the torch
path, and so may a caller that sets ``enabled = False``.

Index values are the caller's to check (``torch_attention._check_ragged``),
except block ids, which the kernel checks (``BadRequest``).
Cost: a few microseconds of Python per call; K and V read once. ``bf16_path()``
says how this machine computes bf16: ``"tiles"`` (AMX), ``"dot"`` (AVX512-BF16) or
``"fp32"`` (widened).
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
from pathlib import Path

import torch

from kvdaemon.client import c_kernel
from kvdaemon.errors import BadRequest

enabled: bool | None = None
"""``None``: the kernel where ``fast_vectors()`` (elsewhere, e.g. on ARM, it is built but
not measured); ``True``/``False``: on or off wherever it is built (tests, comparisons)."""

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_MAX_HEAD_DIM, _MAX_GROUP = 256, 32
_I64 = ctypes.c_int64


class _Args(ctypes.Structure):
    """``struct decode_args`` of ``cpu_decode.c``, field for field."""

    _fields_ = [
        ("query", ctypes.c_void_p), ("query_row", _I64), ("query_head", _I64),
        ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
        ("k_block", _I64), ("k_slot", _I64), ("k_head", _I64),
        ("v_block", _I64), ("v_slot", _I64), ("v_head", _I64),
        ("block_tables", ctypes.c_void_p), ("table_row", _I64), ("num_blocks", _I64),
        ("seq_lens", ctypes.c_void_p), ("seq_ids", ctypes.c_void_p), ("rows", ctypes.c_void_p),
        ("num_seqs", _I64),
        ("out", ctypes.c_void_p), ("out_row", _I64), ("out_head", _I64),
        ("block_size", _I64), ("num_kv_heads", _I64), ("group", _I64), ("head_dim", _I64), ("window", _I64),
        ("scale", ctypes.c_float), ("softcap", ctypes.c_float),
        ("dtype", ctypes.c_int32), ("num_threads", ctypes.c_int32),
    ]


_OPENMP_RUNTIME = re.compile(r"/lib(gomp|iomp5|omp)(-[0-9a-f]+)?\.so(\.\d+)*$")  # wheels rename: libgomp-1a2b.so.1
_kernel: ctypes.CDLL | None = None
_tried = False


SOURCE = Path(__file__).with_name("cpu_decode.c")


def _library() -> ctypes.CDLL | None:
    global _kernel, _tried
    if not _tried:
        _kernel, _tried = prepared(c_kernel.load(SOURCE)), True
    return _kernel


def prepared(lib: ctypes.CDLL | None) -> ctypes.CDLL | None:
    """``lib`` (a build of ``SOURCE``, e.g. with other flags) set up to be called: once per library."""
    if lib is not None and not getattr(lib, "kvd_prepared", False):
        lib.kvd_decode_init()
        lib.kvd_decode.argtypes = [ctypes.POINTER(_Args)]
        lib.kvd_decode.restype = ctypes.c_int
        lib.kvd_decode_use_openmp.argtypes = [ctypes.c_void_p]
        lib.kvd_decode_use_openmp(_openmp_parallel())
        lib.kvd_decode_bf16_paths.restype = ctypes.c_int
        lib.kvd_decode_lanes.restype = ctypes.c_int
        lib.kvd_prepared = True
    return lib


def _openmp_parallel() -> int | None:
    """``GOMP_parallel`` of the OpenMP runtime torch's own threads run on, or ``None``.

    Only where torch's parallel backend is OpenMP and the runtime is already
    loaded (found in ``/proc/self/maps``; nothing new is loaded).
    """
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if _OPENMP_RUNTIME.search(line.rstrip())}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            runtime = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)
            return ctypes.cast(runtime.GOMP_parallel, ctypes.c_void_p).value
        except (OSError, AttributeError):
            continue
    return None


def bf16_path() -> str:
    """``"tiles"``, ``"dot"`` or ``"fp32"``: how the kernel computes bf16 here (``"none"``: not built).

    Tiles serve 4 to 16 query heads per KV head and the dot instruction the rest, each where
    ``head_dim`` is a multiple of 32; other bf16 calls are widened to fp32.
    """
    lib = _library()
    if lib is None:
        return "none"
    bits = lib.kvd_decode_bf16_paths()
    return "tiles" if bits & 6 == 6 else "dot" if bits & 1 else "fp32"


def lanes() -> int:
    """Lanes per vector the kernel computes with here: 16 (AVX-512), 8 (elsewhere), 0 (not built)."""
    lib = _library()
    return 0 if lib is None else lib.kvd_decode_lanes()


@functools.cache
def fast_vectors() -> bool:
    """Whether this CPU has AVX-512F, or AVX2 and FMA: the kernel's measured widths (16 and 8 lanes;
    against SDPA on contiguous K/V: 1.15x and 1.19x at worst, ``bench/attention.py``). Read once
    (``c_kernel.cpu_flags``); False where unreadable."""
    flags = c_kernel.cpu_flags()
    return "avx512f" in flags or {"avx2", "fma"} <= flags


def usable(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether ``attend`` can serve these tensors (see the module docstring)."""
    head_dim = query.shape[-1]
    if enabled is False or (enabled is None and not fast_vectors()):
        return False
    if query.device.type != "cpu" or query.dtype not in _DTYPES:
        return False
    if not k_cache.dtype == v_cache.dtype == query.dtype or k_cache.device.type != "cpu":
        return False
    if head_dim % 16 or head_dim > _MAX_HEAD_DIM or query.shape[1] // k_cache.shape[2] > _MAX_GROUP:
        return False
    if any(t.stride(-1) != 1 for t in (query, k_cache, v_cache)):
        return False
    return _library() is not None


def attend(
    out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, seqs: list[int], rows: list[int],
    scale: float, sliding_window: int | None, softcap: float | None,
) -> None:
    """Rows ``rows`` of ``out``: sequence ``seqs[i]``'s new token (query row ``rows[i]``) over its
    cached K/V. ``out`` is like ``query``; ``usable`` must have said yes."""
    lib = _library()
    assert lib is not None, "attend() without usable()"
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    tables = tables.contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    seq_ids = (_I64 * len(seqs))(*seqs)
    row_ids = (_I64 * len(rows))(*rows)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    args = _Args(
        query.data_ptr(), query.stride(0), query.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        tables.data_ptr(), tables.stride(0), num_blocks,
        lens.data_ptr(), ctypes.addressof(seq_ids), ctypes.addressof(row_ids), len(seqs),
        out.data_ptr(), out.stride(0), out.stride(1),
        block_size, num_kv_heads, query.shape[1] // num_kv_heads, head_dim, sliding_window or 0,
        scale, softcap or 0.0, _DTYPES[query.dtype], torch.get_num_threads(),
    )
    status = lib.kvd_decode(ctypes.byref(args))
    if status == -1:
        raise BadRequest(f"a block id of sequences {seqs[:8]} lies outside [0, {num_blocks})")
    if status != 0:
        raise MemoryError("the CPU decode kernel could not get its working memory or threads")
