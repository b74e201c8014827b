"""CUDA tensors with unmapped address space right before (and after) them, for GPU tests.

The caching allocator usually hands out blocks with mapped memory around them, so a kernel that
touches an address outside its tensors rarely faults in tests and then faults in production,
wherever a tensor lands at the start of a fresh mapping (as in a CUDA graph's private pool).
Here the driver's virtual memory API reserves an address range and maps physical memory only
to the middle of it: any access before or after the tensor's pages faults (illegal address).
"""

from __future__ import annotations

import contextlib
import ctypes

import torch

_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with CUresult {status}")


class GuardedBuffer:
    """``nbytes`` of device memory mapped in the middle of a reserved, otherwise unmapped
    range (``guard`` bytes of it on each side). ``tensor(shape, dtype)`` views it, starting at
    the first mapped byte; ``free()`` (or garbage collection) unmaps it."""

    def __init__(self, nbytes: int, guard: int = 256 << 20, device: int | None = None):
        torch.cuda.init()
        dev = torch.cuda.current_device() if device is None else device
        torch.cuda.synchronize(dev)  # the primary context is current on this thread
        cu = ctypes.CDLL("libcuda.so.1")
        prop = _AllocProp()
        prop.type = _CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location = _Location(_CU_MEM_LOCATION_TYPE_DEVICE, dev)
        gran = ctypes.c_size_t()
        _check(
            cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 0),
            "cuMemGetAllocationGranularity",
        )
        g = gran.value
        self.size = max(-(-nbytes // g) * g, g)
        self.guard = -(-guard // g) * g
        self._cu = cu
        self._span = self.size + 2 * self.guard
        base = ctypes.c_uint64()
        _check(
            cu.cuMemAddressReserve(
                ctypes.byref(base), ctypes.c_size_t(self._span), ctypes.c_size_t(g),
                ctypes.c_uint64(0), ctypes.c_uint64(0),
            ),
            "cuMemAddressReserve",
        )  # fmt: skip
        self._base = base.value
        handle = ctypes.c_uint64()
        _check(
            cu.cuMemCreate(
                ctypes.byref(handle), ctypes.c_size_t(self.size), ctypes.byref(prop),
                ctypes.c_uint64(0),
            ),
            "cuMemCreate",
        )  # fmt: skip
        self._handle = handle.value
        self.ptr = self._base + self.guard
        _check(
            cu.cuMemMap(
                ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.size), ctypes.c_size_t(0),
                ctypes.c_uint64(self._handle), ctypes.c_uint64(0),
            ),
            "cuMemMap",
        )  # fmt: skip
        access = _AccessDesc(_Location(_CU_MEM_LOCATION_TYPE_DEVICE, dev), 3)
        _check(
            cu.cuMemSetAccess(
                ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.size), ctypes.byref(access),
                ctypes.c_size_t(1),
            ),
            "cuMemSetAccess",
        )  # fmt: skip
        self.__cuda_array_interface__ = {
            "shape": (self.size,),
            "typestr": "|u1",
            "data": (self.ptr, False),
            "version": 3,
        }
        self._bytes = torch.as_tensor(self, device=f"cuda:{dev}")

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype, at_end: bool = False):
        """A [shape] tensor at the first mapped byte (or ending at the last, ``at_end``)."""
        n = 1
        for s in shape:
            n *= s
        nbytes = n * torch.tensor([], dtype=dtype).element_size()
        if nbytes > self.size:
            raise ValueError(f"{nbytes} bytes do not fit in {self.size}")
        first = self.size - nbytes if at_end else 0
        return self._bytes[first : first + nbytes].view(dtype).view(shape)

    def free(self) -> None:
        if self._cu is None:
            return
        torch.cuda.synchronize()
        self._bytes = None
        cu, self._cu = self._cu, None
        cu.cuMemUnmap(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.size))
        cu.cuMemRelease(ctypes.c_uint64(self._handle))
        cu.cuMemAddressFree(ctypes.c_uint64(self._base), ctypes.c_size_t(self._span))

    def __del__(self):
        with contextlib.suppress(Exception):  # interpreter teardown: the driver may be gone
            self.free()
