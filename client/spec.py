"""``KVSpec``: the shape of one model's KV cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvdaemon.errors import BadRequest
from kvdaemon.wire.dtypes import DTYPE_BYTES as _DTYPE_BYTES

if TYPE_CHECKING:
    import torch


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` or ``"bfloat16"`` -> ``"bfloat16"``; unknown dtypes raise BadRequest."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise BadRequest(f"dtype {dtype!r} is not supported; use one of {sorted(_DTYPE_BYTES)}")
    return name


@dataclass(frozen=True)
class KVSpec:
    """Layer-major KV layout: K and V of each layer are separate segments.

    One block of one segment is ``block_size * num_kv_heads * head_dim`` elements.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: Any = "bfloat16"

    def __post_init__(self) -> None:
        for field_name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise BadRequest(f"KVSpec.{field_name} must be a positive integer, got {value!r}")
        dtype_name(self.dtype)

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    @property
    def num_segments(self) -> int:
        return 2 * self.num_layers

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one segment."""
        return self.block_size * self.num_kv_heads * self.head_dim * _DTYPE_BYTES[self.dtype_name]

    def to_wire(self) -> dict[str, object]:
        return {
            "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "block_size": self.block_size, "dtype": self.dtype_name,
            "num_segments": self.num_segments,
        }
