"""Launch-time helpers shared by the kernel families: scratch allocator and device facts."""

from __future__ import annotations

import functools

import torch
import triton

from moekit.config import interpret_mode


def _scratch_alloc(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    # Device-side TMA descriptors (tl.make_tensor_descriptor) live in this scratch memory.
    # Allocating through torch keeps it inside the caching allocator, so CUDA-graph capture works.
    device = "cpu" if interpret_mode() else torch.cuda.current_device()
    return torch.empty(size, dtype=torch.int8, device=device)


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
