"""GPU checks of the pointers the Triton kernels are given, run by ``bench/gpu_check.py``.

Triton's launcher asks the driver (``cuPointerGetAttribute``) about every
pointer argument and refuses one it does not know. A KV cache's ``data_ptr``
is its segment's base, logical page 0, so that page must be mapped whenever
a kernel launches, even after every other page went back to the daemon.

- ``check_kernel_pointers``: on the backend alone, caches over 4-page ranges
  with only page 0 mapped: ``store_kv`` and ``paged_attention`` launch and
  agree with the torch path. Also reports (without judging) what the launcher
  does with a view whose base page is unmapped, through a launch that would
  write nothing.
- ``check_pool_pointers``: through a daemon on the cuda backend and the
  public client API, a pool that returned every page it could still launches
  both kernels over its caches.

Imports happen inside the checks (``kvdaemon.client`` needs pyzmq).
Cost: a few kernel compiles; a few pages; the daemon's start for the second.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpu_backend_checks import PAGE, Figures, require, started

if TYPE_CHECKING:
    import torch

NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 2, 64, 16
UNMAPPED_PROBE_ERRORS = (ValueError, RuntimeError)


def check_kernel_pointers() -> Figures:
    """Kernels launch over caches whose base page alone is mapped (see the module docstring)."""
    import torch

    from kvdaemon.cuda_vmm import CudaBackend

    shape = (-1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    with started(CudaBackend(num_pages=2)) as backend:
        bases = [backend.reserve(4 * PAGE) for _ in range(2)]
        for page_id, base in enumerate(bases):
            backend.map_page(base, backend.create_page(page_id))  # page 0 only
        k_cache, v_cache = (backend.tensor(b, 4 * PAGE, torch.float16).view(shape) for b in bases)
        require(backend.device_pointer(k_cache.data_ptr()) == bases[0], "the base is not a device pointer")
        figures = launch_over(k_cache, v_cache, blocks=[3, 0, 5])
        probe = backend.tensor(bases[0] + PAGE, 3 * PAGE, torch.float16).view(shape)  # base unmapped
        figures["launch_over_unmapped_base"] = unmapped_launch(probe)
        del k_cache, v_cache, probe
        torch.cuda.synchronize()
    return figures


def launch_over(k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: list[int]) -> Figures:
    """``store_kv`` into ``blocks`` then ``paged_attention`` over them, each against the torch path.

    ``blocks`` must lie on mapped pages; nothing else of the caches is touched.
    """
    import torch

    from kvdaemon.client.attention import paged_attention, store_kv

    num_tokens = len(blocks) * BLOCK_SIZE - 5  # a partial last block
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.float16)
    value = torch.randn_like(key)
    positions = torch.arange(num_tokens, device="cuda")
    table = torch.tensor([blocks], dtype=torch.int32, device="cuda")
    slots = table[0, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    store_kv(key, value, k_cache, v_cache, slots)  # the Triton path: CUDA tensors
    torch.cuda.synchronize()
    require(torch.equal(k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots], key), "store_kv wrote other K")
    require(torch.equal(v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots], value), "store_kv wrote other V")
    query = torch.randn(1, 4 * NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.float16)
    args = (query, k_cache, v_cache, table, torch.tensor([num_tokens], dtype=torch.int32, device="cuda"),
            torch.tensor([0, 1], dtype=torch.int32, device="cuda"))
    ours = paged_attention(*args, impl="triton")
    torch.testing.assert_close(ours, paged_attention(*args, impl="torch"), atol=4e-3, rtol=1e-2)
    return {"store_kv_tokens": num_tokens, "attention_context": num_tokens}


def unmapped_launch(cache: torch.Tensor) -> str:
    """What a ``store_kv`` launch with only padding slots (it writes nothing) does over ``cache``."""
    import torch

    from kvdaemon.client.attention import store_kv

    key = torch.zeros(4, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.float16)
    try:
        store_kv(key, key, cache, cache, torch.full((4,), -1, device="cuda"))
        torch.cuda.synchronize()
    except UNMAPPED_PROBE_ERRORS as exc:
        return f"refused: {type(exc).__name__}: {str(exc)[:100]}"
    return "launched"


def check_pool_pointers() -> Figures:
    """A pool that gave back every page it could still launches both kernels over its caches.

    Guarantees on PASS: after ``alloc`` spanning three logical pages and
    ``free`` of every block (no spare pages kept), every cache's ``data_ptr``
    is a device pointer the driver knows, a padding-only ``store_kv`` launches
    over every layer, and ``store_kv`` + ``paged_attention`` over newly
    allocated blocks agree with the torch path.
    """
    import torch

    from daemon_proc import daemon_process

    from kvdaemon.client import KVSpec
    from kvdaemon.client.attention import store_kv

    spec = KVSpec(num_layers=2, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
                  dtype="float16")
    with daemon_process("256MiB", backend="cuda") as client:
        pool = client.register("pointers", spec, num_spare_pages=0, num_prefetch_pages=0)
        try:
            pool.free(pool.alloc(3 * pool.blocks_per_page))
            mapped_after_free = pool.mapped_bytes
            padding = torch.full((4,), -1, device="cuda")
            zeros = torch.zeros(4, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.float16)
            for layer in range(spec.num_layers):
                k_cache, v_cache = pool.key_cache(layer), pool.value_cache(layer)
                for cache in (k_cache, v_cache):
                    pool.backend.device_pointer(cache.data_ptr())
                store_kv(zeros, zeros, k_cache, v_cache, padding)
            blocks = pool.alloc(3)
            figures = launch_over(pool.key_cache(0), pool.value_cache(0), blocks)
            torch.cuda.synchronize()
        finally:
            pool.close()
    return {**figures, "mapped_bytes_after_free_all": mapped_after_free}
