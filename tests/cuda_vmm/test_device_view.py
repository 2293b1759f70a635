"""``address_view``: tensors over raw ranges, made without touching (or asking about) the memory."""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvdaemon.cuda_vmm.device_view import address_view

SIZE = 4 * mmap.PAGESIZE
PROT_NONE = 0
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


@pytest.fixture
def reserved() -> Iterator[int]:
    """The address of ``SIZE`` bytes mapped PROT_NONE (any touch would fault), like a reservation."""
    addr = _libc.mmap(None, SIZE, PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value)
    yield addr
    _libc.munmap(addr, SIZE)


def open_access(addr: int) -> None:
    assert _libc.mprotect(addr, SIZE, mmap.PROT_READ | mmap.PROT_WRITE) == 0


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.int32, torch.float32])
def test_a_view_over_inaccessible_memory_is_made_without_touching_it(reserved: int, dtype: torch.dtype) -> None:
    view = address_view(reserved, SIZE, dtype, torch.device("cpu"))
    assert view.data_ptr() == reserved
    assert view.dtype == dtype and view.numel() * view.element_size() == SIZE
    open_access(reserved)  # "mapped" later: the early view sees the memory
    view.fill_(3)
    assert ctypes.string_at(reserved, SIZE) == torch.full((view.numel(),), 3, dtype=dtype).numpy().tobytes()


def test_writes_through_the_view_land_at_the_address_and_it_owns_nothing(reserved: int) -> None:
    open_access(reserved)
    view = address_view(reserved, SIZE, torch.int32, torch.device("cpu"))
    view.copy_(torch.arange(SIZE // 4, dtype=torch.int32))
    assert ctypes.c_int32.from_address(reserved + 4 * 100).value == 100
    del view  # frees no memory: the range stays readable
    assert ctypes.c_int32.from_address(reserved + 4 * 101).value == 101


def test_without_the_storage_constructor_cpu_views_still_work(
    reserved: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(torch._C, "_construct_storage_from_data_pointer")
    view = address_view(reserved, SIZE, torch.int16, torch.device("cpu"))
    assert view.data_ptr() == reserved
    open_access(reserved)
    view[5] = 9
    assert ctypes.c_int16.from_address(reserved + 10).value == 9


def test_without_the_storage_constructor_cuda_views_name_their_device_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fallback hands torch an explicit device index, so torch need not ask the driver."""
    monkeypatch.delattr(torch._C, "_construct_storage_from_data_pointer")
    seen: dict[str, Any] = {}

    def as_tensor(data: Any, device: torch.device) -> torch.Tensor:
        seen["interface"], seen["device"] = data.__cuda_array_interface__, device
        return torch.empty(data.__cuda_array_interface__["shape"], dtype=torch.uint8)

    monkeypatch.setattr(torch, "as_tensor", as_tensor)
    address_view(0x7F0000000000, SIZE, torch.float16, torch.device("cuda", 3))
    assert seen["device"] == torch.device("cuda", 3) and seen["device"].index == 3
    assert seen["interface"]["data"] == (0x7F0000000000, False)
    assert seen["interface"]["shape"] == (SIZE,)


def test_the_installed_torch_has_the_storage_constructor() -> None:
    """The explicit-device path is the one used (present from torch 2.1 on); if a torch drops it, say so."""
    assert callable(getattr(torch._C, "_construct_storage_from_data_pointer", None))
