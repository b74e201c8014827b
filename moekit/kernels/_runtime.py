"""Launch-time helpers shared by the kernel families: scratch allocator and device facts."""

from __future__ import annotations

import functools
import weakref

import torch
import triton

from moekit.config import interpret_mode

_scratch_by_stream: dict[tuple[int, int | None], torch.Tensor] = {}


def _scratch_alloc(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    # Device-side TMA descriptors (tl.make_tensor_descriptor) live in this scratch memory.
    if interpret_mode():
        return torch.empty(size, dtype=torch.int8)
    return cuda_scratch(size, torch.cuda.current_device(), stream)


def cuda_scratch(size: int, device: int, stream: int | None) -> torch.Tensor:
    """At least ``size`` bytes of kernel scratch on ``device`` for launches on ``stream``.

    Eager: one buffer per stream, reused by every launch on it (kernels on one stream run in
    order, exactly like the block the caching allocator would hand back each time), which saves
    an allocation per launch on the host. Under CUDA-graph capture: a fresh block from the
    graph's private pool via the caching allocator, so capture works.
    """
    if torch._C._cuda_isCurrentStreamCapturing():
        return torch.empty(size, dtype=torch.int8, device=device)
    key = (device, stream)
    buf = _scratch_by_stream.get(key)
    if buf is None or buf.numel() < size:
        buf = torch.empty(max(size, 1 << 16), dtype=torch.int8, device=device)
        _scratch_by_stream[key] = buf
    return buf


_counter_by_stream: dict[tuple[int, int], torch.Tensor] = {}
# Every live counter by address, so that launch replay can tell a counter argument apart from
# an op's tensors (and give each replay the counter of its own stream).
_counter_ptrs: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

TILE_COUNTER_WORDS = 2  # [next tile, programs finished]


def tile_counter(device: torch.device) -> torch.Tensor:
    """A zeroed int32 [2] work counter for a dynamically scheduled launch on the current stream.

    The kernel takes tiles with atomic increments of word 0 and counts finished programs in
    word 1; the last program to finish puts both back to zero, so the next launch on the same
    stream (launches on one stream run in order) finds a zeroed counter without a memset.
    Under CUDA-graph capture each launch gets its own counter from the graph's pool, zeroed by
    a captured memset (replays then start from zero too). Without CUDA (the interpreter), a
    fresh zeroed tensor.
    """
    if device.type != "cuda":
        return torch.zeros(TILE_COUNTER_WORDS, dtype=torch.int32, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_tile_counter(index, torch._C._cuda_getCurrentRawStream(index))


def _cuda_tile_counter(index: int, stream: int) -> torch.Tensor:
    if torch._C._cuda_isCurrentStreamCapturing():
        buf = torch.zeros(TILE_COUNTER_WORDS, dtype=torch.int32, device=index)
        _counter_ptrs[buf.data_ptr()] = buf
        return buf
    buf = _counter_by_stream.get((index, stream))
    if buf is None:
        buf = torch.zeros(TILE_COUNTER_WORDS, dtype=torch.int32, device=index)
        _counter_by_stream[(index, stream)] = buf
        _counter_ptrs[buf.data_ptr()] = buf
    return buf


def tile_counter_buffer(index: int, stream: int) -> torch.Tensor:
    """``tile_counter(...)`` for a known device index and raw stream (launch replay's fast
    path)."""
    return _cuda_tile_counter(index, stream)


def is_tile_counter(ptr: int) -> bool:
    """Whether ``ptr`` is the address of a live ``tile_counter`` buffer."""
    return ptr in _counter_ptrs


def ensure_scratch_allocator() -> None:
    """Install the global-scratch allocator that device-side tensor descriptors need.

    Triton keeps the allocator in a ContextVar, so it is set on every launch: autograd runs
    backward in its own thread, whose context does not see a set made in the main thread.
    """
    triton.set_allocator(_scratch_alloc)


@functools.cache
def num_sms(device_index: int | None) -> int:
    """Streaming multiprocessors of a CUDA device; a small fixed number under the interpreter."""
    if device_index is None:
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(t: torch.Tensor) -> int:
    return num_sms(t.device.index if t.is_cuda else None)
