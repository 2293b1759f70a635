"""The worker side: vLLM's KV views over the pool's segments, the KV size vLLM plans, layouts, specs."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvdaemon.errors import Unsupported
from kvdaemon.integrations.vllm.config import PluginConfig
from kvdaemon.integrations.vllm.layout import kv_spec_for, pooled_layouts
from kvdaemon.integrations.vllm.tenant import set_current_tenant
from kvdaemon.integrations.vllm.worker import available_kv_bytes, pool_kv_cache_views, real_allocation

from tests.conftest import RunningDaemon
from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

import vllm.v1.worker.gpu_model_runner as runner  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from .engines import LAYER_SPEC, Engine, layer_specs, plan_kv_cache, start_engine, tokens, vllm_config  # noqa: E402

PAGE = LAYER_SPEC.page_size_bytes


@pytest.fixture(params=["LBHNC", "LBNHC"])
def engine(request: pytest.FixtureRequest, surface: Any, kvd: RunningDaemon, model_dir: Path) -> Iterator[Engine]:
    engine = start_engine(surface, kvd.dir, model_dir, "a", layout=request.param)
    set_current_tenant(engine.tenant)  # the worker's allocation finds the process's tenant
    yield engine
    set_current_tenant(None)
    engine.close()


def allocate(engine: Engine) -> dict[str, torch.Tensor]:
    """vLLM's KV allocation as its model runner calls it, inside the worker's real allocation."""
    layout = KVCacheLayout[engine.worker_kv_config.kv_cache_layout]
    with real_allocation():
        return runner.allocate_kv_cache(engine.worker_kv_config, torch.device("cpu"), layout, [16])


def held_blocks(engine: Engine) -> list[int]:
    """Block ids vLLM allocated for a request (their pages are mapped)."""
    engine.add("r", tokens(0, 100), max_tokens=50)
    (new,) = engine.step().scheduled_new_reqs
    return list(new.block_ids[0])


def test_views_put_each_block_on_its_own_page_of_its_layer(engine: Engine) -> None:
    views = allocate(engine)
    names = list(layer_specs())
    assert list(views) == names
    blocks = held_blocks(engine)
    assert len(blocks) == 7
    for index, name in enumerate(names):
        segment = engine.tenant.pool.segment(index)
        view = views[name]
        assert view.shape == (256, 2, 16, 32) and view.dtype == torch.float32  # [B, H, N, K+V]
        for block in blocks:
            start = segment.data_ptr() + block * PAGE
            assert view[block].data_ptr() == start
            last = sum((size - 1) * stride for size, stride in zip(view[block].shape, view[block].stride()))
            assert (last + 1) * view.element_size() == PAGE  # the whole page, nothing past it


def test_bytes_written_through_vllm_views_are_read_through_the_pool(engine: Engine) -> None:
    views = allocate(engine)
    blocks = held_blocks(engine)
    generator = torch.Generator().manual_seed(0)
    for index, name in enumerate(layer_specs()):
        view, segment = views[name], engine.tenant.pool.segment(index)
        for block in blocks:
            assert not segment[block].any()  # fresh pages are zero
            view[block] = torch.randn(view[block].shape, generator=generator)
            raw = segment[block].view(torch.float32)  # the pool's page, in the layout's physical order
            layout = engine.worker_kv_config.kv_cache_layout
            physical = raw.view(2, 16, 32) if layout == "LBHNC" else raw.view(16, 2, 32).transpose(0, 1)
            assert torch.equal(physical, view[block])
            keys, values = view[block][..., :16], view[block][..., 16:]
            assert torch.equal(physical[..., :16], keys) and torch.equal(physical[..., 16:], values)


def test_the_profiling_pass_allocates_on_its_own(engine: Engine) -> None:
    layout = KVCacheLayout[engine.worker_kv_config.kv_cache_layout]
    minimal = dataclasses.replace(engine.worker_kv_config, num_blocks=4)
    views = runner.allocate_kv_cache(minimal, torch.device("cpu"), layout, [16])  # outside the scope
    segments = [engine.tenant.pool.segment(i) for i in range(2)]
    for view in views.values():
        assert view.shape[0] == 4
        assert not any(s.data_ptr() <= view.data_ptr() < s.data_ptr() + s.numel() for s in segments)


def test_views_refuse_what_they_cannot_place(surface: Any, engine: Engine) -> None:
    tenant, config = engine.tenant, engine.worker_kv_config
    layout = KVCacheLayout[config.kv_cache_layout]
    with pytest.raises(Unsupported, match="vLLM runs on cuda"):
        pool_kv_cache_views(surface, tenant, config, torch.device("cuda", 0), layout)
    with pytest.raises(Unsupported, match="LHBNC"):
        pool_kv_cache_views(surface, tenant, config, "cpu", KVCacheLayout.LHBNC)
    with pytest.raises(Unsupported, match="planned 128 KV blocks"):
        pool_kv_cache_views(surface, tenant, dataclasses.replace(config, num_blocks=128), "cpu", layout)


def test_vllm_plans_exactly_the_pools_blocks(surface: Any, kvd: RunningDaemon, model_dir: Path) -> None:
    config = vllm_config(model_dir)
    config.parallel_config.distributed_executor_backend = "uni"  # a GPU engine's; the CPU platform picks mp
    worker = SimpleNamespace(vllm_config=config, cache_config=config.cache_config, get_kv_cache_spec=layer_specs)
    set_current_tenant(None)
    tenant = available_kv_bytes(surface, PluginConfig(tenant="sized", dir=str(kvd.dir)), worker)
    try:
        # Block 0 (vLLM's null block, which its warm-up reads) is mapped before any scheduler exists.
        assert tenant.pool.num_used_blocks == 1 and not tenant.pool.segment(0)[0].any()
        assert config.cache_config.kv_cache_memory_bytes == tenant.kv_bytes == 256 * PAGE * 2
        worker_config, scheduler_config = plan_kv_cache(config, tenant.kv_bytes)
        assert worker_config.num_blocks == scheduler_config.num_blocks == tenant.pool.num_blocks == 256
    finally:
        set_current_tenant(None)
        tenant.close()


def test_layouts_are_filtered_to_those_a_segment_holds(surface: Any) -> None:
    assert pooled_layouts(surface, ["LHBNC", "LBNHC", "LBHNC", "BLHNC"]) == ["LBNHC", "LBHNC", "BLHNC"]
    with pytest.raises(Unsupported, match=r"\['LHBNC'\]"):
        pooled_layouts(surface, ["LHBNC"])


def test_the_joint_spec_is_vllms_page(surface: Any) -> None:
    spec = kv_spec_for(surface, layer_specs())
    assert (spec.layout, spec.num_layers, spec.num_segments) == ("joint", 2, 2)
    assert spec.block_bytes == PAGE


@pytest.mark.parametrize("odd, reason", [
    (SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float32, sliding_window=64),
     "SlidingWindowSpec"),
    (MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32), "MLAAttentionSpec"),
    (FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float32, sliding_window=64),
     "window of 64"),
    (FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, head_size_v=8, dtype=torch.float32),
     "K and V heads differ"),
    (FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=16, dtype=torch.float32), "different KV specs"),
])
def test_unsupported_kv_specs_are_refused_by_name(surface: Any, odd: Any, reason: str) -> None:
    specs = {**layer_specs(), "model.layers.9.self_attn.attn": odd}
    with pytest.raises(Unsupported, match=reason) as info:
        kv_spec_for(surface, specs)
    assert info.value.code == "UNSUPPORTED"


def test_padded_pages_are_refused(surface: Any) -> None:
    padded = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float32, page_size_padded=8192)
    with pytest.raises(Unsupported, match="page is 8192 bytes but K and V of a block take 4096"):
        kv_spec_for(surface, layer_specs(padded))
