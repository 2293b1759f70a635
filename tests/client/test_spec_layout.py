"""KVSpec's two layouts: split K/V segments (the default) and joint K+V pages per layer."""

from __future__ import annotations

import pytest
import torch

from kvdaemon.client import KVSpec
from kvdaemon.errors import BadRequest

from tests.conftest import PAGE_BYTES, RunningDaemon

SPLIT = KVSpec(num_layers=3, num_kv_heads=2, head_dim=64, block_size=16, dtype="float16")
JOINT = KVSpec(num_layers=3, num_kv_heads=2, head_dim=64, block_size=16, dtype="float16", layout="joint")


def test_split_is_the_default_and_its_wire_form_is_unchanged() -> None:
    assert SPLIT.layout == "split" and SPLIT.num_segments == 6
    assert SPLIT.block_bytes == 16 * 2 * 64 * 2
    assert SPLIT.to_wire() == {
        "num_layers": 3, "num_kv_heads": 2, "head_dim": 64, "block_size": 16, "dtype": "float16",
        "num_segments": 6,
    }
    assert (SPLIT.key_segment(2), SPLIT.value_segment(2)) == (4, 5)
    assert SPLIT.segment_shape(10) == (10, 16, 2, 64) and SPLIT.segment_dtype_name == "float16"


def test_joint_keeps_k_and_v_of_a_block_in_one_segment_per_layer() -> None:
    assert JOINT.num_segments == 3
    assert JOINT.block_bytes == 2 * SPLIT.block_bytes
    assert JOINT.to_wire()["num_segments"] == 3
    assert JOINT.segment_shape(10) == (10, JOINT.block_bytes) and JOINT.segment_dtype_name == "int8"
    with pytest.raises(BadRequest, match="joint layout keeps K and V"):
        JOINT.key_segment(0)


def test_bad_layouts_and_layers_are_refused() -> None:
    with pytest.raises(BadRequest, match="layout must be one of"):
        KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, layout="interleaved")
    with pytest.raises(BadRequest, match="layer 3 is outside"):
        SPLIT.value_segment(3)


def test_a_joint_pool_views_each_layer_as_raw_blocks(kvd: RunningDaemon) -> None:
    client = kvd.client()
    pool = client.register("joint", JOINT)
    assert pool.num_blocks == PAGE_BYTES // JOINT.block_bytes * (64 * 2**20 // (3 * PAGE_BYTES))
    blocks = pool.alloc(3)
    for layer in range(3):
        segment = pool.segment(layer)
        assert segment.shape == (pool.num_blocks, JOINT.block_bytes) and segment.dtype == torch.int8
        segment[blocks[layer]] = layer + 1
    for layer in range(3):
        assert int(pool.segment(layer)[blocks[layer]].sum()) == (layer + 1) * JOINT.block_bytes
    row = next(t for t in client.status()["tenants"] if t["name"] == "joint")
    assert row["mapped_bytes"] == pool.mapped_bytes and pool.mapped_bytes % (3 * PAGE_BYTES) == 0
    with pytest.raises(BadRequest, match="segment 3 is outside"):
        pool.segment(3)
    with pytest.raises(BadRequest, match="joint layout"):
        pool.key_cache(0)
    pool.close()
    client.close()
