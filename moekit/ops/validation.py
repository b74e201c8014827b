"""Input checks shared by the ops: each raises ``TypeError``/``ValueError`` naming the argument,
what was expected and what was given, so bad input never reaches a kernel."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from moekit.activations import Activation
from moekit.config import debug_checks
from moekit.runtime.device import use_triton
from moekit.runtime.eager import values_on_host


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


def _device_checks(device_check: bool | None) -> bool:
    return debug_checks() if device_check is None else device_check


def check_offsets_values(
    offsets: torch.Tensor,
    rows: int,
    *,
    name: str = "offsets",
    rows_what: str = "the number of rows",
    device_check: bool | None = None,
) -> None:
    """``offsets`` ([E] cumulative END offsets, ``torch._grouped_mm`` convention) must not go
    backwards (nor start below 0) and must end at most at ``rows`` (``rows_what`` says where
    that count comes from); ending short is allowed (a padding tail). Call after
    :func:`check_offsets`.

    CPU tensors are checked on the host on every call: a ``ValueError`` naming ``name``, the
    first entry that decreases or the last one, and the bound. Other devices only when
    ``device_check`` (an op's ``validate=True``; None: as ``MOEKIT_DEBUG`` says), and then on
    the device with ``torch._assert_async``, which never syncs: a failure surfaces as a
    device-side assert (``RuntimeError``) at the next synchronisation."""
    if values_on_host(offsets):
        prev = 0
        for e, v in enumerate(offsets.tolist()):
            if v < prev:
                was = f"{name}[{e - 1}] = {prev}" if e else "0"
                raise ValueError(
                    f"{name} must be non-decreasing cumulative end offsets starting at >= 0 "
                    f"(torch._grouped_mm convention), but {name}[{e}] = {v} < {was}"
                )
            prev = v
        if prev > rows:
            raise ValueError(
                f"{name}[-1] = {prev} exceeds {rows_what} = {rows}: the offsets must end at "
                f"most there (ending below it is allowed: a padding tail)"
            )
        return
    if offsets.numel() == 0 or offsets.device.type == "meta" or not _device_checks(device_check):
        return
    ok = (offsets[-1] <= rows) & (offsets[0] >= 0)
    if offsets.shape[0] > 1:
        ok &= (offsets[1:] >= offsets[:-1]).all()
    torch._assert_async(
        ok,
        f"{name} must be non-decreasing cumulative end offsets starting at >= 0 and ending at "
        f"most at {rows_what} = {rows}",
    )


def check_expert_ids(
    indices: torch.Tensor,
    num_experts: int,
    *,
    name: str = "indices",
    device_check: bool | None = None,
) -> None:
    """Expert ids must lie in ``[0, num_experts)``, or be −1 (a dropped slot: it gets no row).

    CPU tensors are checked on the host on every call (a ``ValueError`` naming ``name``, E and
    the first offending id and its place); other devices only when ``device_check`` (an op's
    ``validate=True``; None: as ``MOEKIT_DEBUG`` says), with ``torch._assert_async`` (no host
    sync; a ``RuntimeError`` at the next synchronisation)."""
    E = num_experts
    host = values_on_host(indices)
    if indices.numel() == 0 or not (
        host or (indices.device.type != "meta" and _device_checks(device_check))
    ):
        return
    if indices.dtype not in (torch.int32, torch.int64):  # compare uint8 ids as numbers, not mod 256
        indices = indices.int()
    if host:
        bad = (indices >= E) | (indices < -1)
        if bad.any():
            where = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"{name} must hold expert ids in [0, num_experts = {E}) or -1 (a dropped "
                f"slot), got {name}[{', '.join(map(str, where))}] = {int(indices[where])}"
            )
        return
    ok = ((indices < E) & (indices >= -1)).all()
    torch._assert_async(
        ok, f"{name} must hold expert ids in [0, num_experts = {E}) or -1 (a dropped slot)"
    )


def check_fp8_device(name: str, t: torch.Tensor, capability: tuple[int, int] = (8, 9)) -> None:
    """FP8 (e4m3) kernels need a GPU of compute capability ``capability`` or newer (Ada,
    Hopper); on an older one they cannot run, and moekit says so instead of running another
    path."""
    if not t.is_cuda:
        return
    have = torch.cuda.get_device_capability(t.device)
    if have < capability:
        raise RuntimeError(
            f"{name} is on {t.device} ({torch.cuda.get_device_name(t.device)}, compute "
            f"capability {have[0]}.{have[1]}): moekit's FP8 kernels need compute capability "
            f"{capability[0]}.{capability[1]} or newer (Ada, Hopper)"
        )


def check_positive(**sizes: int) -> None:
    """Sizes a module is built with (e.g. ``num_experts=...``) must be positive integers."""
    if any(n < 1 for n in sizes.values()):
        names = ", ".join(sizes)
        got = ", ".join(str(n) for n in sizes.values())
        raise ValueError(f"{names} must be positive, got {got}")


def check_mlp_weights(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, act: Activation, same_dtype: bool = True
) -> None:
    """An expert MLP's weights for rows x [R, H]: w1 [E, 2F, H] (gated) or [E, F, H], w2
    [E, H, F], on x's device (and in x's dtype unless ``same_dtype`` is False)."""
    check_ndim("w1", w1, 3, "[E, 2F, H] (gated) or [E, F, H]")
    check_ndim("w2", w2, 3, "[E, H, F]")
    for name, w in (("w1", w1), ("w2", w2)):
        if same_dtype and w.dtype != x.dtype:
            raise TypeError(f"{name} must have x's dtype {x.dtype}, got {w.dtype}")
        check_same_device(name, w, "x", x)
    H = x.shape[1]
    E, W1, H1 = w1.shape
    F_ = w2.shape[2]
    if H1 != H or w2.shape[1] != H:
        raise ValueError(
            f"w1.shape[2] and w2.shape[1] must equal H = x.shape[1] = {H}, got w1 "
            f"{tuple(w1.shape)}, w2 {tuple(w2.shape)}"
        )
    if w2.shape[0] != E:
        raise ValueError(f"w1 and w2 must hold the same E experts, got {E} and {w2.shape[0]}")
    if act.gated:
        if W1 % 2:
            raise ValueError(
                f"w1.shape[1] must be even for gated activation {act.name!r} ([gate | up]), "
                f"got {W1}"
            )
        if W1 != 2 * F_:
            raise ValueError(
                f"w1.shape[1] must be 2 * F = {2 * F_} for gated activation {act.name!r} "
                f"(F = w2.shape[2]), got {W1}"
            )
    elif W1 != F_:
        raise ValueError(
            f"w1.shape[1] must equal F = w2.shape[2] = {F_} for activation {act.name!r}, got {W1}"
        )


def check_interleave(glu_interleave: object, act: Activation, F_: int) -> None:
    """glu_interleave: None, or a positive divisor of F with a gated activation."""
    if glu_interleave is None:
        return
    if not act.gated:
        raise ValueError(f"glu_interleave applies to gated activations, not {act.name!r}")
    if (
        isinstance(glu_interleave, bool)
        or not isinstance(glu_interleave, int)
        or glu_interleave <= 0
        or F_ % glu_interleave
    ):
        raise ValueError(
            f"glu_interleave must be a positive integer dividing F = {F_}, got {glu_interleave!r}"
        )
