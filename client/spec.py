"""``KVSpec``: the shape of one model's KV cache, and how it is cut into segments.

Two layouts:

- ``"split"`` (the default): K and V of each layer are separate segments
  (``2 * num_layers`` of them), each viewed as a tensor
  ``[num_blocks, block_size, num_kv_heads, head_dim]``; one block of one
  segment is ``block_size * num_kv_heads * head_dim`` elements.
- ``"joint"``: one segment per layer, and a block holds the K *and* V of its
  tokens (the per-layer page of vLLM), ``2 * block_size * num_kv_heads *
  head_dim`` elements. The pool views such a segment as raw bytes
  ``[num_blocks, block_bytes]`` (int8); how K and V sit inside a block is the
  engine's business.

Block id b is block b of every segment in both layouts. On the wire a spec is
the same map as before plus ``num_segments``; the daemon needs nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvdaemon.errors import BadRequest
from kvdaemon.wire.dtypes import DTYPE_BYTES as _DTYPE_BYTES

if TYPE_CHECKING:
    import torch

LAYOUTS = ("split", "joint")
RAW_DTYPE = "int8"
"""Element type of a joint segment's view: raw bytes."""


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` or ``"bfloat16"`` -> ``"bfloat16"``; unknown dtypes raise BadRequest."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise BadRequest(f"dtype {dtype!r} is not supported; use one of {sorted(_DTYPE_BYTES)}")
    return name


@dataclass(frozen=True)
class KVSpec:
    """A model's KV cache: per-layer geometry and the segment layout (see the module docstring)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: Any = "bfloat16"
    layout: str = "split"

    def __post_init__(self) -> None:
        for field_name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise BadRequest(f"KVSpec.{field_name} must be a positive integer, got {value!r}")
        dtype_name(self.dtype)
        if self.layout not in LAYOUTS:
            raise BadRequest(f"KVSpec.layout must be one of {LAYOUTS}, got {self.layout!r}")

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    @property
    def num_segments(self) -> int:
        return 2 * self.num_layers if self.layout == "split" else self.num_layers

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one segment (K and V together in the joint layout)."""
        halves = 1 if self.layout == "split" else 2
        return halves * self.block_size * self.num_kv_heads * self.head_dim * _DTYPE_BYTES[self.dtype_name]

    # -- segments --------------------------------------------------------------

    def key_segment(self, layer: int) -> int:
        """Index of the segment holding K of ``layer`` (split layout only)."""
        return 2 * self._split_layer(layer)

    def value_segment(self, layer: int) -> int:
        """Index of the segment holding V of ``layer`` (split layout only)."""
        return 2 * self._split_layer(layer) + 1

    def _split_layer(self, layer: int) -> int:
        if self.layout != "split":
            raise BadRequest(
                "a joint layout keeps K and V of a layer in one segment; read it with segment(layer)"
            )
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise BadRequest(f"layer {layer!r} is outside the layers 0..{self.num_layers - 1}")
        return layer

    def segment_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of a segment's view over ``num_blocks`` blocks."""
        if self.layout == "joint":
            return (num_blocks, self.block_bytes)
        return (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def segment_dtype_name(self) -> str:
        """Element type of a segment's view: the KV dtype, or raw bytes in the joint layout."""
        return self.dtype_name if self.layout == "split" else RAW_DTYPE

    def to_wire(self) -> dict[str, object]:
        return {
            "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "block_size": self.block_size, "dtype": self.dtype_name,
            "num_segments": self.num_segments,
        }
