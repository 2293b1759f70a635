"""Torch tensors over raw address ranges that may not be mapped yet.

A KV pool makes its tensor views over reserved ranges before any page is
mapped behind them, so making a view must never ask the driver about the
pointer. ``torch.as_tensor`` over ``__cuda_array_interface__`` may ask: torch
2.1 builds that tensor with ``at::from_blob`` on device ``cuda`` without an
index, which resolves the device through ``cudaPointerGetAttributes``: a
question about memory that is not there yet. Later versions (2.11's headers have
it) take the index from ``device=`` and skip the query, but the project
allows torch >= 2.1.

``address_view`` therefore builds a non-owning storage with an explicit
device through ``torch._C._construct_storage_from_data_pointer`` (present in
torch 2.1 through 2.13 at least; the inductor's CUDA-graph trees use it) and
sets a tensor on it: no driver call is made on any version. Where a torch
lacks that function it falls back to ``__cuda_array_interface__`` with the
device index given (honoured by those later versions), or, for CPU views, to
a buffer over the address.

Guarantees: the view's ``data_ptr()`` is ``addr``; it owns nothing (freeing the
tensor frees no memory); nothing is read or written when it is made.
Cost: one small allocation of tensor metadata.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def address_view(addr: int, size_bytes: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D ``dtype`` tensor on ``device`` (``cpu`` or ``cuda:N``) over ``[addr, addr + size_bytes)``."""
    import torch

    construct = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if construct is not None:
        storage = construct(addr, device, size_bytes)
        view = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (size_bytes,), (1,))
    elif device.type == "cpu":
        view = torch.frombuffer((ctypes.c_ubyte * size_bytes).from_address(addr), dtype=torch.uint8)
    else:
        view = torch.as_tensor(_DeviceBytes(addr, size_bytes), device=device)
    return view.view(dtype)


class _DeviceBytes:
    """A byte array in device memory, exposed through ``__cuda_array_interface__``."""

    def __init__(self, addr: int, size_bytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (size_bytes,),
            "typestr": "|u1",
            "data": (addr, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }
