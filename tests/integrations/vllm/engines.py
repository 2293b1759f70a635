"""Factories for the vLLM tests: vLLM's real Scheduler over a kvdaemon tenant, stepped without a model.

``start_engine`` registers a tenant the way the plugin's worker side does,
plans the KV cache with vLLM's own planner for the bytes the plugin reports,
and builds vLLM's ``Scheduler`` (whose coordinator builds the pooled block
pool). ``Engine.step`` schedules and feeds back one sampled token per request
whose prefill is done, as a model runner would.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm.config import KVEventsConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config, get_request_block_hasher, init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvdaemon.integrations.vllm.config import PluginConfig
from kvdaemon.integrations.vllm.gate import VllmSurface
from kvdaemon.integrations.vllm.layout import kv_spec_for
from kvdaemon.integrations.vllm.tenant import VllmTenant, register_tenant, set_current_tenant
from kvdaemon.wire.sizes import parse_size

BLOCK_SIZE = 16
NUM_LAYERS = 2
LAYER_SPEC = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=16, dtype=torch.float32)
"""One layer's page: 2 heads x 16 tokens x (16 K + 16 V) float32 = 4 KiB."""


def write_model_dir(root: Path) -> Path:
    """A tiny Llama config on disk (no weights, no tokenizer: nothing runs it here)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": NUM_LAYERS, "vocab_size": 256, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5, "torch_dtype": "float32", "head_dim": 16,
    }))
    return root


def layer_specs(spec: Any = LAYER_SPEC, num_layers: int = NUM_LAYERS) -> dict[str, Any]:
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(num_layers)}


def vllm_config(
    model_dir: Path, *, prefix_caching: bool = True, events: bool = False, max_seqs: int = 8,
    max_batched_tokens: int = 256,
) -> Any:
    args = EngineArgs(
        model=str(model_dir), skip_tokenizer_init=True, load_format="dummy", block_size=BLOCK_SIZE,
        max_model_len=1024, enable_prefix_caching=prefix_caching, max_num_batched_tokens=max_batched_tokens,
        max_num_seqs=max_seqs, dtype="float32",
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null") if events else None,
    )
    return args.create_engine_config()


def plan_kv_cache(config: Any, kv_bytes: int, layout: str = "LBHNC") -> tuple[Any, Any]:
    """vLLM's own planning for ``kv_bytes`` of KV: (the worker's config, the scheduler's config)."""
    specs = [layer_specs()]
    config.cache_config.kv_cache_layout = None
    resolve_kv_cache_layout(config, [[layout]], list(specs[0].values()))
    groups = get_global_kv_cache_groups(config, specs)
    (worker_config,) = get_kv_cache_configs(config, specs, [kv_bytes], groups)
    worker_config.kv_cache_layout = layout
    scheduler_config = generate_scheduler_kv_cache_config([worker_config])
    config.cache_config.num_gpu_blocks = scheduler_config.num_blocks
    _, hash_block_size = resolve_kv_cache_block_sizes(scheduler_config, config)
    worker_config.hash_block_size = scheduler_config.hash_block_size = hash_block_size
    return worker_config, scheduler_config


def start_tenant(surface: VllmSurface, kvd_dir: Path, name: str, max_size: str | None = None) -> VllmTenant:
    """Register a tenant as the plugin's worker side does; it is this process's tenant until cleared."""
    set_current_tenant(None)
    config = PluginConfig(tenant=name, dir=str(kvd_dir), max_size=parse_size(max_size) if max_size else None)
    return register_tenant(config, kv_spec_for(surface, layer_specs()))


@dataclass
class Engine:
    """vLLM's scheduler over a tenant, with a stand-in model runner."""

    tenant: VllmTenant
    scheduler: Any
    worker_kv_config: Any
    hasher: Any

    @property
    def block_pool(self) -> Any:
        return self.scheduler.kv_cache_manager.block_pool

    def add(self, request_id: str, prompt: list[int], max_tokens: int = 4) -> Request:
        request = Request(
            request_id=request_id, prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None, block_hasher=self.hasher,
        )
        self.scheduler.add_request(request)
        return request

    def step(self) -> Any:
        """One engine step: schedule, then token 1 for each request whose prefill is done."""
        output = self.scheduler.schedule()
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            sampled.append([1] if request.num_computed_tokens >= request.num_tokens else [])
        self.scheduler.update_from_output(output, ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        ))
        return output

    def run(self, max_steps: int = 200) -> int:
        """Step until no request is left; returns the steps taken."""
        for steps in range(1, max_steps + 1):
            self.step()
            if not self.scheduler.has_unfinished_requests():
                return steps
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    def check(self) -> None:
        """Every block the pool handed out is held by vLLM or cached (spare ones went back after the step)."""
        queue = self.block_pool.free_block_queue
        assert not queue.spare
        assert self.tenant.pool.num_used_blocks == queue.num_held + len(queue.spare) + len(queue.cached)
        held = sum(1 for block in self.block_pool.blocks if block.ref_cnt > 0)
        assert queue.num_held == held + 1  # and the null block

    def close(self) -> None:
        self.tenant.close()


def start_engine(
    surface: VllmSurface, kvd_dir: Path, model_dir: Path, name: str, *,
    max_size: str | None = None, layout: str = "LBHNC", **config_kw: Any,
) -> Engine:
    """Register ``name`` and build vLLM's Scheduler over it (see the module docstring)."""
    tenant = start_tenant(surface, kvd_dir, name, max_size)
    try:
        config = vllm_config(model_dir, **config_kw)
        worker_kv_config, scheduler_kv_config = plan_kv_cache(config, tenant.kv_bytes, layout)
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        scheduler = Scheduler(
            vllm_config=config, kv_cache_config=scheduler_kv_config,
            structured_output_manager=StructuredOutputManager(config), block_size=BLOCK_SIZE,
            hash_block_size=scheduler_kv_config.hash_block_size,
        )
    except BaseException:
        tenant.close()
        raise
    finally:
        set_current_tenant(None)
    hasher = get_request_block_hasher(scheduler_kv_config.hash_block_size, hash_fn, config.num_hash_lookahead_tokens)
    return Engine(tenant, scheduler, worker_kv_config, hasher)


def tokens(seed: int, length: int) -> list[int]:
    """A prompt of ``length`` token ids that differs per ``seed``."""
    return [(seed * 7919 + i * 31) % 250 + 3 for i in range(length)]
