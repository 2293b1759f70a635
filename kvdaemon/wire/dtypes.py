"""KV element types both sides agree on: the wire name of a dtype and its size in bytes."""

from __future__ import annotations

DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1,
    "uint8": 1,
}
"""Bytes per element of every dtype a KV spec may name (torch's names, without ``torch.``)."""
