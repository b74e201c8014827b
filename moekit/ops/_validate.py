"""Input checks shared by the ops: each raises ``TypeError``/``ValueError`` naming the argument,
what was expected and what was given, so bad input never reaches a kernel."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def check_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_ndim(name: str, t: torch.Tensor, ndim: int, shape_hint: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {shape_hint}, got shape {tuple(t.shape)}")


def check_dtype(name: str, t: torch.Tensor, allowed: Iterable[torch.dtype]) -> None:
    allowed = tuple(allowed)
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(
            f"{name} must have dtype in ({names}), got {str(t.dtype).replace('torch.', '')}"
        )


def check_same_device(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} must be on {ref_name}'s device {ref.device}, got {t.device}")


def check_dim_size(name: str, t: torch.Tensor, dim: int, expected: int, what: str) -> None:
    if t.shape[dim] != expected:
        raise ValueError(
            f"{name}.shape[{dim}] must equal {what} = {expected}, got {t.shape[dim]} "
            f"(shape {tuple(t.shape)})"
        )


def check_byte_aligned(
    name: str, size: int, dtype: torch.dtype, what: str, align: int = 16
) -> None:
    """TMA needs every non-unit stride (a row of K or N elements) to be a multiple of 16 bytes."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if (size * itemsize) % align:
        mult = align // itemsize
        dtype_name = str(dtype).replace("torch.", "")
        raise ValueError(
            f"{name}: {what} = {size} must be a multiple of {mult} for {dtype_name} "
            f"({align}-byte rows), got {size}"
        )
