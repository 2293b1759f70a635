"""The KV layout a vLLM engine wants, as a ``KVSpec`` the daemon can serve, and the layouts it can view.

vLLM keeps, per attention layer, one page per block holding the K and V of the
block's tokens (``FullAttentionSpec.page_size_bytes``). The pool serves that
as a *joint* ``KVSpec``: one segment per layer, ``block_bytes`` = vLLM's page,
block id b of vLLM = block b of the pool.

What fits (anything else is refused with ``Unsupported`` naming the layer and
the reason): every layer a plain ``FullAttentionSpec`` (no sliding window,
chunked-local, MLA or Mamba layers, no quantised or padded pages), all alike,
and K and V of equal head size. Layouts: those where each block of a layer is
one contiguous page (``KVCacheLayout.is_block_compact``); a segment then holds
a layer's blocks back to back.

Cost: O(layers).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvdaemon.client.spec import KVSpec, dtype_name
from kvdaemon.errors import BadRequest, Unsupported

from kvdaemon.integrations.vllm.gate import VllmSurface


def kv_spec_for(surface: VllmSurface, layer_specs: Mapping[str, Any]) -> KVSpec:
    """The joint ``KVSpec`` of a model whose attention layers have ``layer_specs`` (name -> spec)."""
    if not layer_specs:
        raise Unsupported("the model has no KV cache layers; kvdaemon has nothing to hold for it")
    specs = list(layer_specs.items())
    for name, spec in specs:
        _check_layer(surface, name, spec)
    first_name, first = specs[0]
    for name, spec in specs[1:]:
        if spec != first:
            raise Unsupported(
                f"layers {first_name} and {name} have different KV specs ({first} vs {spec}); "
                "kvdaemon's vLLM plugin supports models whose attention layers are all alike"
            )
    try:
        kv_spec = KVSpec(
            num_layers=len(specs), num_kv_heads=first.num_kv_heads, head_dim=first.head_size,
            block_size=first.block_size, dtype=dtype_name(first.dtype), layout="joint",
        )
    except BadRequest as exc:
        raise Unsupported(f"vLLM's KV cache of layer {first_name} cannot be described: {exc.message}") from exc
    if kv_spec.block_bytes != first.page_size_bytes:
        raise Unsupported(
            f"layer {first_name}: vLLM's page is {first.page_size_bytes} bytes but K and V of a block "
            f"take {kv_spec.block_bytes}; kvdaemon's vLLM plugin supports unpadded, unquantised pages"
        )
    return kv_spec


def _check_layer(surface: VllmSurface, name: str, spec: Any) -> None:
    if type(spec) is not surface.full_attention_spec_cls:
        raise Unsupported(
            f"layer {name} has a {type(spec).__name__}; kvdaemon's vLLM plugin supports full-attention "
            "layers only (no sliding-window, chunked-local, MLA, Mamba or cross-attention caches)"
        )
    window = spec.sliding_window or spec.attention_chunk_size
    if window is not None:
        raise Unsupported(f"layer {name} attends over a window of {window} tokens; only full attention is supported")
    if spec.head_size_v != spec.head_size:
        raise Unsupported(f"layer {name}: K and V heads differ in size ({spec.head_size} vs {spec.head_size_v})")


def pooled_layouts(surface: VllmSurface, names: Iterable[str]) -> list[str]:
    """The layouts among ``names`` (most preferred first) a pool segment per layer can hold.

    ``Unsupported`` when none of them can.
    """
    names = list(names)
    kept = [name for name in names if surface.layout_cls[name].is_block_compact]
    if not kept:
        raise Unsupported(
            f"the attention backends support the KV layouts {names}, none of which keeps a layer's "
            "block in one contiguous page; kvdaemon's vLLM plugin needs one (e.g. LBHNC or LBNHC)"
        )
    return kept


def check_layout(layout: Any) -> None:
    """``Unsupported`` unless ``layout`` (a ``KVCacheLayout``) keeps each block in one page."""
    if not layout.is_block_compact:
        raise Unsupported(
            f"vLLM resolved the KV layout {layout.name}, which spreads a block over its layer's "
            "range; kvdaemon's vLLM plugin needs a block-compact layout (e.g. LBHNC)"
        )
