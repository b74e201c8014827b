"""The one test of whether a tensor can be read or written through a TMA descriptor."""

from __future__ import annotations

import torch

__all__ = ["aligned_copy", "tma_ready", "tma_rows", "tma_strides"]


def tma_strides(t: torch.Tensor, unit_dim: int = -1) -> bool:
    """The static half of :func:`tma_ready`: unit stride along ``unit_dim`` and every other
    stride a multiple of 16 bytes (the base address is not looked at)."""
    if t.stride(unit_dim) != 1 and t.shape[unit_dim] > 1:
        return False
    size = t.element_size()
    unit = unit_dim % t.dim()
    return all((s * size) % 16 == 0 for d, s in enumerate(t.stride()) if d != unit)


def tma_ready(t: torch.Tensor, unit_dim: int = -1) -> bool:
    """Whether the TMA engine can address ``t`` with ``unit_dim`` as its contiguous dimension.

    The engine needs unit stride along that dimension, every other stride a multiple of 16
    bytes and a 16-byte aligned base address (which is also what Triton specialises compiled
    kernels on, so a replayed launch relies on this too).
    """
    return t.data_ptr() % 16 == 0 and tma_strides(t, unit_dim)


def tma_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if TMA can address its rows (unit stride along the last dimension), else a
    contiguous copy. Only what TMA cannot address (a view like ``x[:, ::2]``, a misaligned
    base address) is copied.

    The ops validate that rows span a multiple of 16 bytes, so a contiguous tensor at an
    aligned address needs no closer look (the common case, checked first: it is cheap)."""
    if t.is_contiguous() and not t.data_ptr() & 15:
        return t
    return t if tma_ready(t, -1) else aligned_copy(t)


def aligned_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` in fresh (hence aligned) memory. ``t.contiguous()`` is not
    enough: it returns a contiguous ``t`` itself, even at a misaligned address."""
    return t.clone(memory_format=torch.contiguous_format)
