"""Which implementation an op runs: the Triton kernel or the pure-PyTorch reference."""

from __future__ import annotations

import torch

from moekit.config import interpret_mode


def use_triton(t: torch.Tensor) -> bool:
    """CUDA tensors → Triton kernel; CPU tensors → reference, or the kernel in Triton's
    interpreter when ``TRITON_INTERPRET=1`` (how CI exercises kernels)."""
    if t.is_cuda:
        return True
    return t.device.type == "cpu" and interpret_mode()
