"""Device facts and per-stream buffers that kernel launches need, and the dispatch rule.

Dispatch rule of every op: CUDA tensors run the Triton kernels; CPU tensors run the PyTorch
reference, or the Triton kernels in Triton's CPU interpreter when moekit was imported with
``TRITON_INTERPRET=1`` (how CI exercises the kernels without a GPU).
"""

from __future__ import annotations

import torch
import triton

from moekit.config import check_interpret_unchanged, interpret_mode
from moekit.runtime.state import STATE, memoized

__all__ = [
    "TILE_COUNTER_WORDS",
    "current_stream",
    "ensure_scratch_allocator",
    "is_capturing",
    "is_tile_counter",
    "num_sms",
    "scratch",
    "spare_bytes",
    "tile_counter",
    "use_triton",
]


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op on ``t`` runs the Triton kernels (see the module docstring)."""
    if t.is_cuda:
        return True
    check_interpret_unchanged()
    return t.device.type == "cpu" and interpret_mode()


@memoized
def _sm_count(device_index: int | None) -> int:
    if device_index is None:
        return 4  # the interpreter runs programs one after another: a few suffice
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(t: torch.Tensor) -> int:
    """Streaming multiprocessors of ``t``'s CUDA device (a small fixed number without CUDA):
    the grid size of moekit's persistent kernels."""
    return _sm_count(t.device.index if t.is_cuda else None)


def current_stream(device_index: int) -> int:
    """The raw handle of the current CUDA stream of a device."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def is_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph."""
    return torch._C._cuda_isCurrentStreamCapturing()


def spare_bytes(device: torch.device) -> int:
    """Bytes an allocation on ``device`` could take now without a new driver allocation failing:
    the driver's free memory plus what torch's caching allocator holds unused (fragmentation
    may make a single block smaller). Calls no stream synchronisation."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def scratch(size: int, device: int, stream: int | None) -> torch.Tensor:
    """At least ``size`` bytes of kernel scratch on ``device`` for launches on ``stream``.

    Eager: one buffer per stream, reused by every launch on it (kernels on one stream run in
    order, exactly like the block the caching allocator would hand back each time), which saves
    an allocation per launch. Under CUDA-graph capture: a fresh block from the graph's private
    pool, so that capture works.
    """
    if torch._C._cuda_isCurrentStreamCapturing():  # is_capturing(): one call less per launch
        return torch.empty(size, dtype=torch.int8, device=device)
    key = (device, stream)
    buf = STATE.scratch.get(key)
    if buf is None or buf.numel() < size:
        buf = torch.empty(max(size, 1 << 16), dtype=torch.int8, device=device)
        STATE.scratch[key] = buf
    return buf


def _triton_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    # Device-side TMA descriptors (tl.make_tensor_descriptor) live in this scratch memory.
    if interpret_mode():
        return torch.empty(size, dtype=torch.int8)
    return scratch(size, torch.cuda.current_device(), stream)


def ensure_scratch_allocator() -> None:
    """Install the global-scratch allocator that device-side tensor descriptors need.

    Triton keeps the allocator in a ContextVar, so it is set on every launch: autograd runs
    backward in its own thread, whose context does not see a set made in the main thread.
    """
    triton.set_allocator(_triton_scratch)


TILE_COUNTER_WORDS = 2  # [next tile, programs finished]


def tile_counter(device: torch.device, stream: int | None = None) -> torch.Tensor:
    """A zeroed int32 [2] work counter for a dynamically scheduled launch on the current stream
    (or the raw ``stream`` of ``device``).

    The kernel takes tiles with atomic increments of word 0 and counts finished programs in
    word 1; the last program to finish puts both back to zero, so the next launch on the same
    stream (launches on one stream run in order) finds a zeroed counter without a memset.
    Under CUDA-graph capture each launch gets its own counter from the graph's pool, zeroed by
    a captured memset (replays then start from zero too). Without CUDA, a fresh zeroed tensor.
    """
    if device.type != "cuda":
        return torch.zeros(TILE_COUNTER_WORDS, dtype=torch.int32, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if is_capturing():
        buf = torch.zeros(TILE_COUNTER_WORDS, dtype=torch.int32, device=index)
        STATE.counter_ptrs[buf.data_ptr()] = buf
        return buf
    if stream is None:
        stream = current_stream(index)
    buf = STATE.tile_counters.get((index, stream))
    if buf is None:
        buf = torch.zeros(TILE_COUNTER_WORDS, dtype=torch.int32, device=index)
        STATE.tile_counters[(index, stream)] = buf
        STATE.counter_ptrs[buf.data_ptr()] = buf
    return buf


def is_tile_counter(ptr: int) -> bool:
    """Whether ``ptr`` is the address of a live ``tile_counter`` buffer."""
    return ptr in STATE.counter_ptrs
