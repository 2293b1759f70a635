"""The fused CPU decode kernel (``cpu_decode``) against the explicit fp32 reference, and its limits.

Batches are decode-only (one new token per sequence) from ``test_attention.make_batch``:
NaN-poisoned caches at shuffled block ids, so a read outside a sequence's blocks
shows. Skipped where no C compiler builds the kernel (the torch path then runs,
and ``test_attention`` covers it).
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kvdaemon.client import c_kernel, cpu_decode
from kvdaemon.client.attention import paged_attention
from kvdaemon.errors import BadRequest

from .test_attention import TOLERANCE, make_batch
from .test_attention_window import reference

DECODE = [(37, 1), (16, 1), (1, 1), (64, 1), (70, 1), (200, 1), (17, 1)]
needs_kernel = pytest.mark.skipif(cpu_decode._library() is None, reason="no C compiler built the kernel")


@pytest.fixture(autouse=True)
def kernel_on() -> Iterator[None]:
    """The kernel's tests run it on any CPU that builds it (the default uses it on AVX-512F only)."""
    cpu_decode.enabled = True
    try:
        yield
    finally:
        cpu_decode.enabled = None


@pytest.fixture
def kernel_off(kernel_on: None) -> Iterator[None]:
    cpu_decode.enabled = False
    yield


def run(batch: object, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    return paged_attention(*batch.args(), sliding_window=window, softcap=softcap)  # type: ignore[attr-defined]


def check(batch: object, window: int | None = None, softcap: float | None = None) -> None:
    assert cpu_decode.usable(batch.query, batch.k_cache, batch.v_cache)  # type: ignore[attr-defined]
    tol = TOLERANCE[batch.query.dtype]  # type: ignore[attr-defined]
    expected = reference(batch, window, softcap)  # type: ignore[arg-type]
    torch.testing.assert_close(run(batch, window, softcap).float(), expected, atol=tol, rtol=tol)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 80, 128, 256])
@pytest.mark.parametrize("group", [1, 3, 4, 6, 8])
def test_decode_matches_the_reference(dtype: torch.dtype, head_dim: int, group: int) -> None:
    batch = make_batch(DECODE, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim, dtype=dtype, seed=group)
    check(batch)


@needs_kernel
@pytest.mark.parametrize("head_dim", [32, 64, 256])
@pytest.mark.parametrize("group", [2, 4, 5, 16, 17, 32])
def test_bf16_on_either_side_of_the_tile_limits(head_dim: int, group: int) -> None:
    """Groups of 4 to 16 go to the tiles where the machine has them, others to the dot
    instruction; a padded chunk (odd lengths) never lets the padding rows count."""
    batch = make_batch(DECODE, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim, dtype=torch.bfloat16,
                       seed=group + head_dim)
    check(batch)
    check(batch, window=5, softcap=3.0)


@needs_kernel
@pytest.mark.skipif("amx_bf16" not in c_kernel.cpu_flags(), reason="the CPU has no AMX-BF16")
def test_bf16_runs_on_the_tiles_where_the_cpu_has_them() -> None:
    if not cpu_decode._library().kvd_decode_bf16_paths() & 2:  # type: ignore[union-attr]
        pytest.skip("the C compiler does not build AMX code")
    assert cpu_decode.bf16_path() == "tiles"


@needs_kernel
@pytest.mark.skipif("amx_bf16" not in c_kernel.cpu_flags(), reason="the CPU has no AMX-BF16")
def test_a_threads_tile_configuration_is_put_back(tmp_path: Path) -> None:
    """torch's own kernels may keep their tile configuration across calls: after a call the
    thread's configuration is the one it had (or none, where it had none)."""
    if not cpu_decode._library().kvd_decode_bf16_paths() & 2:  # type: ignore[union-attr]
        pytest.skip("the C compiler does not build AMX code")
    compiler = shutil.which("cc") or shutil.which("gcc")
    source = Path(cpu_decode.__file__).with_name("cpu_decode.c")
    probe = tmp_path / "probe"
    subprocess.run([compiler, *c_kernel.FLAGS[:4], "-pthread", "-include", str(source), "-o", str(probe),
                    str(Path(__file__).with_name("tile_config_probe.c")), "-lm"], check=True, timeout=120)
    lines = subprocess.run([str(probe)], capture_output=True, text=True, check=True, timeout=60).stdout.splitlines()
    assert lines == ["paths 7 status 0 out 3f80 kept 1", "released status 0 kept 1"]


@needs_kernel
def test_torchs_own_bf16_kernels_are_untouched_by_the_tiles(two_threads: None) -> None:
    """torch's bf16 matmul and SDPA (oneDNN, on the same tiles where the machine has them, and
    on the same OpenMP threads) give the same bits before and after the kernel ran."""
    gen = torch.Generator().manual_seed(3)
    a, b = (torch.randn(64, 256, generator=gen).to(torch.bfloat16) for _ in range(2))
    q, k, v = (torch.randn(4, 8, 64, 64, generator=gen).to(torch.bfloat16) for _ in range(3))

    def torch_side() -> tuple[torch.Tensor, torch.Tensor]:
        return a @ b.T, torch.nn.functional.scaled_dot_product_attention(q, k, v)

    before = torch_side()
    batch = make_batch(DECODE * 2, num_heads=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, seed=9)
    for _ in range(3):
        check(batch)
        after = torch_side()
        for was, now in zip(before, after):
            torch.testing.assert_close(now, was, atol=0, rtol=0)


@needs_kernel
@pytest.mark.parametrize("block_size", [1, 7, 16, 32])
@pytest.mark.parametrize("window", [None, 1, 5, 16, 40])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_windows_softcaps_and_block_sizes(block_size: int, window: int | None, softcap: float | None) -> None:
    batch = make_batch(DECODE, block_size=block_size, num_heads=8, num_kv_heads=2, head_dim=32, seed=block_size)
    check(batch, window, softcap)


@needs_kernel
def test_strided_caches_read_in_place() -> None:
    """K and V as views of one joint tensor (vLLM's layout): strides, not copies."""
    batch = make_batch(DECODE, num_heads=8, num_kv_heads=2, head_dim=64, index_dtype=torch.int64)
    joint = torch.stack([batch.k_cache, batch.v_cache], dim=1)  # [blocks, 2, block, heads, dim]
    batch.k_cache, batch.v_cache = joint[:, 0], joint[:, 1]
    assert not batch.k_cache.is_contiguous()
    check(batch)


@needs_kernel
def test_the_kernel_and_the_gather_path_agree_on_a_mixed_batch(kernel_off: None) -> None:
    batch = make_batch(DECODE + [(40, 9), (12, 12)], num_heads=8, num_kv_heads=2, head_dim=32)
    gathered = run(batch)
    cpu_decode.enabled = True
    torch.testing.assert_close(run(batch), gathered, atol=2e-5, rtol=2e-5)


@needs_kernel
def test_a_block_id_outside_the_cache_is_refused() -> None:
    batch = make_batch(DECODE, num_heads=4, num_kv_heads=2, head_dim=32)
    batch.block_tables[3, 2] = batch.k_cache.shape[0]  # inside sequence 3's 64 tokens
    with pytest.raises(BadRequest, match="outside"):
        run(batch)


def test_what_the_kernel_does_not_take_goes_the_torch_way() -> None:
    odd_dim = make_batch(DECODE, num_heads=4, num_kv_heads=2, head_dim=24)
    assert not cpu_decode.usable(odd_dim.query, odd_dim.k_cache, odd_dim.v_cache)
    check_reference = reference(odd_dim, None, None)
    torch.testing.assert_close(run(odd_dim).float(), check_reference, atol=2e-5, rtol=2e-5)
    double = make_batch(DECODE, num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float64)
    assert not cpu_decode.usable(double.query, double.k_cache, double.v_cache)


def test_switched_off_it_is_not_used(kernel_off: None) -> None:
    batch = make_batch(DECODE, num_heads=4, num_kv_heads=2, head_dim=32)
    assert not cpu_decode.usable(batch.query, batch.k_cache, batch.v_cache)


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.skipif("parallel backend: OpenMP" not in torch.__config__.parallel_info(), reason="torch runs no OpenMP")
def test_shares_run_on_torchs_openmp_team_or_on_started_threads_alike(two_threads: None) -> None:
    """Where torch runs on OpenMP, the kernel finds its runtime (loaded, not loaded anew);
    without it, each call starts its threads. Both give the reference's rows."""
    parallel = cpu_decode._openmp_parallel()
    assert parallel is not None
    lib = cpu_decode._library()
    batch = make_batch(DECODE * 3, num_heads=8, num_kv_heads=2, head_dim=64, seed=5)
    with_team = run(batch)
    lib.kvd_decode_use_openmp(None)  # type: ignore[union-attr]
    try:
        started = run(batch)
    finally:
        lib.kvd_decode_use_openmp(parallel)  # type: ignore[union-attr]
    torch.testing.assert_close(with_team, started, atol=0, rtol=0)
    check(batch)


@needs_kernel
def test_calls_from_several_threads_at_once_each_get_their_rows(two_threads: None) -> None:
    batches = [make_batch(DECODE * 2, num_heads=8, num_kv_heads=2, head_dim=64, seed=s) for s in range(4)]
    expected = [run(b) for b in batches]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            got = list(pool.map(run, batches))
            for want, have in zip(expected, got):
                torch.testing.assert_close(have, want, atol=0, rtol=0)


@needs_kernel
@pytest.mark.parametrize("fast", [True, False], ids=["avx512f-or-avx2", "other"])
def test_by_default_the_kernel_serves_cpus_of_its_measured_widths(
    monkeypatch: pytest.MonkeyPatch, fast: bool
) -> None:
    batch = make_batch(DECODE, num_heads=4, num_kv_heads=2, head_dim=32)
    monkeypatch.setattr(cpu_decode, "enabled", None)
    monkeypatch.setattr(cpu_decode, "fast_vectors", lambda: fast)
    assert cpu_decode.usable(batch.query, batch.k_cache, batch.v_cache) is fast
    expected = reference(batch, None, None)
    torch.testing.assert_close(run(batch).float(), expected, atol=2e-5, rtol=2e-5)  # either way, the same


@needs_kernel
@pytest.mark.parametrize(("flags", "expected"), [
    ("flags : fpu avx2 fma avx512f\n", True), ("flags : fpu avx2 fma\n", True),
    ("flags : fpu avx avx2\n", False), ("Features : fp asimd\n", False),
], ids=["avx512f", "avx2-fma", "avx2-no-fma", "arm"])
def test_the_measured_widths_are_read_from_the_cpu_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: str, expected: bool
) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor : 0\n" + flags)
    monkeypatch.setattr(c_kernel, "CPUINFO", info)
    cpu_decode.fast_vectors.cache_clear()
    try:
        assert cpu_decode.fast_vectors() is expected
    finally:
        cpu_decode.fast_vectors.cache_clear()


@pytest.fixture
def eight_lanes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel built for 8 lanes (no AVX-512) on any x86 CPU, so CI machines with AVX-512 run
    the AVX2 path too."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the 8-lane build is forced with an x86 flag")
    lib = cpu_decode.prepared(c_kernel.load(cpu_decode.SOURCE, ("-mno-avx512f",)))
    if lib is None:
        pytest.skip("no C compiler built the kernel")
    assert lib.kvd_decode_lanes() == 8 and lib.kvd_decode_bf16_paths() == 0
    monkeypatch.setattr(cpu_decode, "_kernel", lib)
    monkeypatch.setattr(cpu_decode, "_tried", True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 80, 128, 256])
def test_the_8_lane_build_matches_the_reference(eight_lanes: None, dtype: torch.dtype, head_dim: int) -> None:
    """Query heads per KV head that take every pass size (8, 4, 1 for scores; 4, 2, 1 for V)."""
    assert cpu_decode.lanes() == 8
    for group in (1, 3, 6, 13, 32):
        batch = make_batch(DECODE, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim, dtype=dtype,
                           seed=group + head_dim)
        check(batch)


@pytest.mark.parametrize("block_size", [1, 7, 16])
def test_the_8_lane_build_with_windows_and_softcaps(eight_lanes: None, block_size: int) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        batch = make_batch(DECODE, block_size=block_size, num_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype,
                           seed=block_size)
        for window, softcap in ((None, None), (1, None), (5, 3.0), (40, None), (None, 3.0)):
            check(batch, window, softcap)
