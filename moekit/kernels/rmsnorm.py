"""Fused residual-add + RMSNorm, forward and backward (local, one GPU).

Math, per row ``t`` of ``x [T, H]`` (fp32 inside the kernel, one rounding per stored tensor)::

    r[t]     = round(x[t] + residual[t])                   # residual_out, input dtype
    rstd[t]  = 1 / sqrt(mean_h(r[t]²) + eps)                # fp32, saved for backward
    y[t]     = round(r[t] · rstd[t] · w)                    # normed output, input dtype

Backward, with ``g = dy · w`` and ``r̂ = r · rstd``::

    dr[t] = rstd[t] · (g − r̂ · mean_h(g · r̂)) + d_residual_out[t]
    dw    = Σ_t dy[t] · r̂[t]          # fp32 partials per program, then summed
    dx = d_residual = dr              # the add routes the gradient to both inputs

The normalisation reads the *rounded* residual stream ``r`` (what an unfused ``x + residual``
followed by RMSNorm would see), so the fused and unfused paths agree up to the norm's own rounding.
The cross-rank kernels in :mod:`moekit.kernels.allreduce` use the same row epilogue. Launch
shapes (warps, the backward's grid) are chosen in :mod:`moekit.tuning.allreduce`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekit.runtime.intmath import next_power_of_2
from moekit.runtime.replay import launch

__all__ = ["add_rmsnorm_bwd", "add_rmsnorm_fwd", "block_h"]


def block_h(h: int) -> int:
    """Power-of-two tile that covers one row of ``h`` elements."""
    return next_power_of_2(h)


@triton.jit
def _add_rmsnorm_fwd_kernel(
    # in: x and residual (HAS_RESIDUAL) [T, H] in the input dtype, w [H] (input dtype or fp32)
    x_ptr, res_ptr, w_ptr,
    # out: y [T, H] normed, ro [T, H] residual_out (STORE_RO), rstd [T] fp32 (STORE_RSTD)
    y_ptr, ro_ptr, rstd_ptr,
    H, eps,  # sizes
    stride_x_t, stride_res_t, stride_y_t, stride_ro_t,  # strides (elements)
    BLOCK_H: tl.constexpr,  # meta
    HAS_RESIDUAL: tl.constexpr, STORE_RO: tl.constexpr, STORE_RSTD: tl.constexpr,
):  # fmt: skip
    """One program per row: r = round(x + residual); y = round(r · rsqrt(mean(r²) + eps) · w)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    v = tl.load(x_ptr + row * stride_x_t + cols, mask=cmask, other=0.0)
    out_dtype = v.dtype
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * stride_res_t + cols, mask=cmask, other=0.0)
        v = (v.to(tl.float32) + res.to(tl.float32)).to(out_dtype)
    if STORE_RO:
        tl.store(ro_ptr + row * stride_ro_t + cols, v, mask=cmask)
    vf = v.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(vf * vf, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y_t + cols, (vf * rstd * w).to(out_dtype), mask=cmask)
    if STORE_RSTD:
        tl.store(rstd_ptr + row, rstd)


@triton.jit
def _add_rmsnorm_bwd_kernel(
    # in: dy [T, H] grad of the normed output, dro [T, H] grad of residual_out from downstream
    # (HAS_DRO), ro [T, H] saved residual_out (the norm's input), w [H], rstd [T] fp32
    dy_ptr, dro_ptr, ro_ptr, w_ptr, rstd_ptr,
    # out: dx [T, H] grad of the norm's input (= of x and of the residual), dw_part [G, H] fp32
    dx_ptr, dw_part_ptr,
    T, H,  # sizes
    stride_dy_t, stride_dro_t, stride_ro_t, stride_dx_t,  # strides (elements)
    BLOCK_H: tl.constexpr, HAS_DRO: tl.constexpr,  # meta
):  # fmt: skip
    """Persistent over rows (pid, pid + G, …): dr = rstd·(g − r̂·mean(g·r̂)) + dro, dw += dy·r̂."""
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for row in range(pid, T, num_progs):
        row64 = tl.cast(row, tl.int64)
        r = tl.load(ro_ptr + row64 * stride_ro_t + cols, mask=cmask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row64)
        dy_raw = tl.load(dy_ptr + row64 * stride_dy_t + cols, mask=cmask, other=0.0)
        dy = dy_raw.to(tl.float32)
        r_hat = r * rstd
        g = dy * w
        dr = rstd * (g - r_hat * (tl.sum(g * r_hat, axis=0) / H))
        if HAS_DRO:
            dr += tl.load(dro_ptr + row64 * stride_dro_t + cols, mask=cmask,
                          other=0.0).to(tl.float32)  # fmt: skip
        tl.store(dx_ptr + row64 * stride_dx_t + cols, dr.to(dy_raw.dtype), mask=cmask)
        dw_acc += dy * r_hat
    tl.store(dw_part_ptr + pid.to(tl.int64) * H + cols, dw_acc, mask=cmask)


def add_rmsnorm_fwd(
    x: torch.Tensor,  # [T, H], T > 0, row stride free, unit column stride
    residual: torch.Tensor | None,  # [T, H] like x, or None (plain RMSNorm)
    weight: torch.Tensor,  # [H]
    y: torch.Tensor,  # [T, H] out: normed
    ro: torch.Tensor | None,  # [T, H] out: residual_out (with a residual)
    rstd: torch.Tensor | None,  # [T] fp32 out, or None
    eps: float,
    num_warps: int,
) -> None:
    """Launch the forward kernel, one program per row."""
    T, H = x.shape
    launch(
        _add_rmsnorm_fwd_kernel, (T,),
        x, residual if residual is not None else x, weight, y, ro if ro is not None else y,
        rstd if rstd is not None else y,
        H, eps,
        x.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0),
        ro.stride(0) if ro is not None else 0,
        BLOCK_H=block_h(H), HAS_RESIDUAL=residual is not None,
        STORE_RO=ro is not None, STORE_RSTD=rstd is not None,
        num_warps=num_warps,
    )  # fmt: skip


def add_rmsnorm_bwd(
    dy: torch.Tensor,  # [T, H], T > 0: grad of y
    d_residual_out: torch.Tensor | None,  # [T, H] grad of residual_out, or None
    residual_out: torch.Tensor,  # [T, H] saved norm input
    weight: torch.Tensor,  # [H]
    rstd: torch.Tensor,  # [T] fp32
    dx: torch.Tensor,  # [T, H] out, in dy's dtype: grad of x (and of the residual)
    dw_part: torch.Tensor,  # [grid, H] fp32 out: per-program partial sums of dw
    num_warps: int,
) -> None:
    """Launch the persistent backward kernel on ``dw_part.shape[0]`` programs; dw is
    ``dw_part.sum(0)``."""
    T, H = residual_out.shape
    launch(
        _add_rmsnorm_bwd_kernel, (dw_part.shape[0],),
        dy, d_residual_out if d_residual_out is not None else dy, residual_out, weight, rstd, dx,
        dw_part,
        T, H,
        dy.stride(0), d_residual_out.stride(0) if d_residual_out is not None else 0,
        residual_out.stride(0), dx.stride(0),
        BLOCK_H=block_h(H), HAS_DRO=d_residual_out is not None,
        num_warps=num_warps,
    )  # fmt: skip
