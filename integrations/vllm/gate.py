"""The version gate: which vLLM the plugin was tested on, and everything of it the plugin touches.

``check_vllm()`` runs before anything is patched. It reads vLLM's version and
refuses (``Unsupported``, naming the version) outside the tested range; then it
imports every module and resolves every class, method, function and field the
plugin reads, wraps or replaces, checks the parameter names of what it calls
or stands in for, and refuses naming *all* that is missing. What it returns,
``VllmSurface``, is the only way the rest of the plugin reaches vLLM's
internals, so nothing unchecked is touched.

Cost: the imports (vLLM's own engine and worker modules, which a vLLM process
loads anyway) and one two-block probe ``BlockPool``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from kvdaemon.errors import Unsupported

WRAPPED = "__kvdaemon_wrapped__"
"""Marks what the plugin put in vLLM's place (so a second check accepts a patched vLLM)."""

TESTED_SERIES = (0, 33)
"""vLLM releases the plugin was tested on: 0.33.x."""

QUEUE_METHODS = frozenset(
    {"popleft", "popleft_n", "remove", "append", "append_n", "prepend_n", "get_all_free_blocks",
     "iter_blocks_after"}
)
"""The public methods of vLLM's free-block queue; ``PooledFreeQueue`` provides each."""

_SIGNATURES: dict[str, tuple[str, ...]] = {
    "allocate_kv_cache": ("kv_cache_config", "device", "layout", "kernel_block_sizes"),
    "create_kv_cache_views": (
        "raw", "spec", "num_blocks", "layout", "kv_cache_tensor", "kernel_block_size",
    ),
    "determine_available_memory": ("self",),
    "initialize_from_config": ("self", "kv_cache_config"),
    "get_supported_kv_cache_layouts": ("self",),
    "reset_prefix_cache": ("self",),
}
_FIELDS = {
    "KVCacheTensor": ("size", "layers", "layer_stride", "block_stride", "offset"),
    "CacheConfig": ("kv_cache_memory_bytes",),
    "ParallelConfig": (
        "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
        "decode_context_parallel_size", "prefill_context_parallel_size",
        "distributed_executor_backend",
    ),
}


@dataclass(frozen=True)
class VllmSurface:
    """The parts of vLLM the plugin uses, resolved and checked by ``check_vllm``."""

    version: str
    coordinator_module: ModuleType  # its global BlockPool is what coordinators build
    coordinator_cls: type  # KVCacheCoordinator: get_num_blocks_to_allocate
    block_pool_cls: type  # BlockPool
    scheduler_cls: type  # Scheduler: schedule, update_from_output, finish_requests, reset_prefix_cache
    engine_core_cls: type  # EngineCore: step, step_with_batch_queue, shutdown
    worker_cls: type  # the GPU Worker: determine_available_memory, initialize_from_config
    worker_base_cls: type  # WorkerBase: get_supported_kv_cache_layouts
    runner_modules: tuple[ModuleType, ...]  # model runners calling allocate_kv_cache by name
    allocate_kv_cache: Any
    create_kv_cache_views: Any
    kv_cache_tensor_cls: type
    full_attention_spec_cls: type
    layout_cls: type  # KVCacheLayout


def check_vllm() -> VllmSurface:
    """Resolve and check the surface of the installed vLLM; ``Unsupported`` if anything is off."""
    version = installed_version()
    check_version(version)
    return _resolve(version)


def installed_version() -> str:
    try:
        vllm = importlib.import_module("vllm")
    except ImportError as exc:
        raise Unsupported(f"kvdaemon's vLLM plugin is enabled but vLLM does not import: {exc}") from exc
    return str(getattr(vllm, "__version__", "unknown"))


def check_version(version: str) -> None:
    """``Unsupported`` unless ``version`` is in the tested series (``0.33.x``)."""
    match = re.match(r"(\d+)\.(\d+)\.", version + ".")
    if match is None or (int(match[1]), int(match[2])) != TESTED_SERIES:
        series = ".".join(map(str, TESTED_SERIES))
        raise Unsupported(
            f"kvdaemon's vLLM plugin supports vLLM {series}.x (the release it was tested on); "
            f"this is vLLM {version}. Install vllm=={series}.* or unset KVDAEMON_VLLM_TENANT "
            "to run vLLM without kvdaemon."
        )


class _Resolver:
    """Collects every missing module, attribute, parameter or field before refusing once."""

    def __init__(self) -> None:
        self.missing: list[str] = []

    def module(self, name: str) -> ModuleType:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            self.missing.append(f"module {name} ({exc})")
            return ModuleType(name)

    def attr(self, owner: Any, name: str, *, where: str) -> Any:
        value = getattr(owner, name, None)
        if value is None:
            self.missing.append(f"{where}.{name}")
        return value

    def methods(self, cls: Any, names: tuple[str, ...], where: str) -> None:
        for name in names:
            if not callable(getattr(cls, name, None)):
                self.missing.append(f"{where}.{name}()")

    def params(self, func: Any, key: str, where: str) -> None:
        if func is None:
            return
        names = tuple(inspect.signature(func).parameters)
        wanted = _SIGNATURES[key]
        if names[: len(wanted)] != wanted:
            self.missing.append(f"{where}{wanted} (found {names})")

    def fields(self, cls: Any, key: str) -> None:
        if cls is None:
            return
        found = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        for name in _FIELDS[key]:
            if name not in found:
                self.missing.append(f"{key}.{name} (a field)")


def _resolve(version: str) -> VllmSurface:
    r = _Resolver()
    coordinator = r.module("vllm.v1.core.kv_cache_coordinator")
    block_pool_mod = r.module("vllm.v1.core.block_pool")
    utils_mod = r.module("vllm.v1.core.kv_cache_utils")
    sched_mod = r.module("vllm.v1.core.sched.scheduler")
    core_mod = r.module("vllm.v1.engine.core")
    worker_mod = r.module("vllm.v1.worker.gpu_worker")
    worker_base_mod = r.module("vllm.v1.worker.worker_base")
    worker_utils = r.module("vllm.v1.worker.utils")
    interface = r.module("vllm.v1.kv_cache_interface")
    layout_mod = r.module("vllm.v1.kv_cache_layout")
    config_mod = r.module("vllm.config")
    runners = (r.module("vllm.v1.worker.gpu_model_runner"), r.module("vllm.v1.worker.gpu.attn_utils"))

    coordinator_cls = r.attr(coordinator, "KVCacheCoordinator", where=coordinator.__name__)
    block_pool_cls = r.attr(block_pool_mod, "BlockPool", where=block_pool_mod.__name__)
    if not _is_or_replaces(r.attr(coordinator, "BlockPool", where=coordinator.__name__), block_pool_cls):
        r.missing.append(f"{coordinator.__name__}.BlockPool is vLLM's BlockPool")
    r.methods(coordinator_cls, ("get_num_blocks_to_allocate",), "KVCacheCoordinator")
    r.methods(block_pool_cls, (
        "get_new_blocks", "free_blocks", "touch", "reset_prefix_cache", "get_num_free_blocks",
        "get_usage", "_maybe_evict_cached_block",
    ), "BlockPool")
    r.params(getattr(block_pool_cls, "reset_prefix_cache", None), "reset_prefix_cache", "BlockPool.reset_prefix_cache")
    queue_cls = r.attr(utils_mod, "FreeKVCacheBlockQueue", where=utils_mod.__name__)
    if queue_cls is not None:
        public = {n for n, v in vars(queue_cls).items() if callable(v) and not n.startswith("_")}
        if public != QUEUE_METHODS:
            r.missing.append(f"FreeKVCacheBlockQueue with methods {sorted(QUEUE_METHODS)} (found {sorted(public)})")
    if block_pool_cls is not None and not r.missing:
        _probe_block_pool(r, block_pool_cls)

    scheduler_cls = r.attr(sched_mod, "Scheduler", where=sched_mod.__name__)
    r.methods(scheduler_cls, ("schedule", "update_from_output", "finish_requests", "reset_prefix_cache"), "Scheduler")
    engine_core_cls = r.attr(core_mod, "EngineCore", where=core_mod.__name__)
    r.methods(engine_core_cls, ("step", "step_with_batch_queue", "shutdown"), "EngineCore")

    worker_cls = r.attr(worker_mod, "Worker", where=worker_mod.__name__)
    worker_base_cls = r.attr(worker_base_mod, "WorkerBase", where=worker_base_mod.__name__)
    r.methods(worker_cls, ("get_kv_cache_spec",), "Worker")
    for cls, name in ((worker_cls, "determine_available_memory"), (worker_cls, "initialize_from_config"),
                      (worker_base_cls, "get_supported_kv_cache_layouts")):
        r.params(r.attr(cls, name, where=getattr(cls, "__name__", "?")), name, f"{name}")

    allocate = r.attr(worker_utils, "allocate_kv_cache", where=worker_utils.__name__)
    r.params(allocate, "allocate_kv_cache", "allocate_kv_cache")
    for runner in runners:
        if not _is_or_replaces(getattr(runner, "allocate_kv_cache", None), allocate):
            r.missing.append(f"{runner.__name__}.allocate_kv_cache is vllm.v1.worker.utils.allocate_kv_cache")
    views = r.attr(interface, "create_kv_cache_views", where=interface.__name__)
    r.params(views, "create_kv_cache_views", "create_kv_cache_views")
    tensor_cls = r.attr(interface, "KVCacheTensor", where=interface.__name__)
    r.fields(tensor_cls, "KVCacheTensor")
    spec_cls = r.attr(interface, "FullAttentionSpec", where=interface.__name__)
    layout_cls = r.attr(layout_mod, "KVCacheLayout", where=layout_mod.__name__)
    if layout_cls is not None and not isinstance(getattr(layout_cls, "is_block_compact", None), property):
        r.missing.append("KVCacheLayout.is_block_compact (a property)")
    r.fields(r.attr(config_mod, "CacheConfig", where="vllm.config"), "CacheConfig")
    r.fields(r.attr(config_mod, "ParallelConfig", where="vllm.config"), "ParallelConfig")

    if r.missing:
        raise Unsupported(
            f"kvdaemon's vLLM plugin cannot run on this vLLM {version}: it lacks "
            + "; ".join(r.missing)
        )
    return VllmSurface(
        version=version, coordinator_module=coordinator, coordinator_cls=coordinator_cls,
        block_pool_cls=block_pool_cls, scheduler_cls=scheduler_cls, engine_core_cls=engine_core_cls,
        worker_cls=worker_cls, worker_base_cls=worker_base_cls, runner_modules=runners,
        allocate_kv_cache=allocate, create_kv_cache_views=views, kv_cache_tensor_cls=tensor_cls,
        full_attention_spec_cls=spec_cls, layout_cls=layout_cls,
    )


def _is_or_replaces(found: Any, original: Any) -> bool:
    return found is original or getattr(found, WRAPPED, False)


def _probe_block_pool(r: _Resolver, block_pool_cls: type) -> None:
    """A two-block pool shows the instance fields the plugin reads exist."""
    probe = block_pool_cls(num_gpu_blocks=2, enable_caching=True, hash_block_size=16)
    for name in ("free_block_queue", "blocks", "null_block", "num_gpu_blocks", "enable_caching"):
        if not hasattr(probe, name):
            r.missing.append(f"BlockPool().{name}")
    if getattr(getattr(probe, "null_block", None), "block_id", None) != 0:
        r.missing.append("BlockPool().null_block being block 0")
