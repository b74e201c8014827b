"""Input checks shared by the ops: each raises ``TypeError``/``ValueError`` naming the argument,
what was expected and what was given, so bad input never reaches a kernel."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from moekit.runtime.device import use_triton


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
    """The kernels read rows through TMA, which needs each row (``size`` elements of ``dtype``)
    to span a multiple of 16 bytes."""
    itemsize = dtype.itemsize
    if (size * itemsize) % align:
        mult = align // itemsize
        dtype_name = str(dtype).replace("torch.", "")
        raise ValueError(
            f"{name}: {what} must be a multiple of {mult} for {dtype_name} (the kernels read "
            f"{align}-byte rows), got {size}"
        )


FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_interpretable(name: str, t: torch.Tensor) -> None:
    """GEMM ops refuse bf16 in Triton's CPU interpreter, whose ``tl.dot`` on bf16 is wrong."""
    if t.dtype == torch.bfloat16 and not t.is_cuda and use_triton(t):
        raise TypeError(
            f"{name} has dtype bfloat16, which Triton's CPU interpreter (TRITON_INTERPRET=1) "
            "multiplies wrongly in tl.dot; use float16 or float32 under the interpreter, or run "
            "without TRITON_INTERPRET (CPU tensors then use the PyTorch reference)"
        )


def check_offsets(
    offsets: object,
    num_groups: int | None,
    ref_name: str,
    ref: torch.Tensor,
    groups_what: str | None,
) -> torch.Tensor:
    """offsets: a 1-D int32/int64 tensor of cumulative end offsets on ``ref``'s device, with
    ``num_groups`` entries (``groups_what`` names where that count comes from) when given."""
    offsets = check_tensor("offsets", offsets)
    check_ndim("offsets", offsets, 1, "[E] (cumulative end offsets)")
    check_dtype("offsets", offsets, INDEX_DTYPES)
    check_same_device("offsets", offsets, ref_name, ref)
    if offsets.shape[0] == 0:
        raise ValueError("offsets must hold at least one expert, got shape (0,)")
    if num_groups is not None and offsets.shape[0] != num_groups:
        raise ValueError(
            f"offsets has {offsets.shape[0]} entries but there are E = {num_groups} experts "
            f"({groups_what}); they must match"
        )
    return offsets


def check_offsets_values(offsets: torch.Tensor, total: int) -> None:
    """Non-decreasing, non-negative, at most ``total``. Reads offsets on the host (a sync):
    only for ``validate=True``, never on a hot path."""
    prev = 0
    for e, v in enumerate(offsets.tolist()):
        if v < prev:
            raise ValueError(
                f"offsets must be non-decreasing and start at >= 0; offsets[{e}] = {v} < {prev}"
            )
        prev = v
    if prev > total:
        raise ValueError(f"offsets[-1] = {prev} exceeds the ragged dimension's size {total}")
