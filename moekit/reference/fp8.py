"""Pure-PyTorch twin of :mod:`moekit.kernels.fp8`: blockwise and rowwise e4m3 quantization and
the FP8 grouped GEMMs, the test oracles and the CPU path.

A block of ``x`` (1×B along the last dim for ``axis="row"``, B×1 along dim -2 for ``"col"``,
B×B over the last two dims for ``"both"``; partial blocks at the edges) gets one fp32 scale,
the dequantization factor; ``block=None`` (rowwise, ``"row"`` and ``"col"`` only) makes the
block the whole row or column, so the scale of an empty row or column is 1::

    amax  = max |x| over the block, NaN entries left out
    scale = amax / 448            (1 where amax is 0; the next power of two up with pow2)
    inv   = 448 / amax            (1 where amax is 0; 1 / scale with pow2)
    data  = e4m3(clamp(x · inv, -448, 448))       round to nearest even; x ≈ data · scale

The kernels compute exactly this (one IEEE division per block, one product and one rounding
per element), so the two agree bit for bit.
Non-finite input: a NaN entry quantizes to NaN; an inf entry makes its block's scale inf, so
its finite entries quantize to 0 and the inf entries to NaN.
"""

from __future__ import annotations

import itertools

import torch

__all__ = [
    "E4M3_MAX",
    "dequantize_fp8_ref",
    "grouped_mm_fp8_ref",
    "grouped_mm_fp8_rowwise_ref",
    "grouped_mm_fp8_wgrad_ref",
    "pow2_up",
    "quantize_fp8_ref",
    "round_e4m3",
    "scale_and_inverse",
    "scale_shape",
]

E4M3_MAX = 448.0


def _block_grid(M: int, K: int, axis: str, block: int | None) -> tuple[tuple[int, int], ...]:
    """((blocks, side) along M, (blocks, side) along K) of a [M, K] matrix: side B and ⌈·/B⌉
    blocks along a scaled dimension (with ``block=None`` one block spanning it, even an empty
    one), side 1 along the other."""

    def along(n: int, scaled: bool) -> tuple[int, int]:
        if not scaled:
            return n, 1
        return (1, max(n, 1)) if block is None else (-(-n // block), block)

    return along(M, axis != "row"), along(K, axis != "col")


def scale_shape(
    shape: torch.Size | tuple[int, ...], axis: str, block: int | None
) -> tuple[int, ...]:
    """The scale tensor's shape for data of ``shape``: row [..., ⌈K/B⌉], col [..., ⌈M/B⌉, K],
    both [..., ⌈M/B⌉, ⌈K/B⌉]; with ``block=None`` row [..., 1] and col [..., 1, K]."""
    if axis == "row":
        return (*shape[:-1], _block_grid(1, shape[-1], axis, block)[1][0])
    (nm, _), (nk, _) = _block_grid(shape[-2], shape[-1], axis, block)
    return (*shape[:-2], nm, nk)


def pow2_up(s: torch.Tensor) -> torch.Tensor:
    """The smallest power of two ≥ each positive fp32 ``s`` (inf stays inf), by its bits."""
    bits = s.view(torch.int32)
    up = (bits & 0x7F800000) + (1 << 23)
    return torch.where((bits & 0x7FFFFF) != 0, up, bits).view(torch.float32)


def round_e4m3(q: torch.Tensor) -> torch.Tensor:
    """fp32 ``q`` (|q| ≤ 448) rounded to the nearest e4m3 value, ties to even, still in fp32:
    the spacing is 2^(e - 3) in a binade 2^e with e ≥ -6 and 2^-9 below. Done here rather than
    by torch's float8 cast, which on the CPU rounds twice (183.99998 became 192, not 176); the
    cast then only meets representable values, which every path converts exactly."""
    exp = (q.view(torch.int32) >> 23) & 0xFF  # biased fp32 exponent
    ulp = ((exp.clamp_min(127 - 6) - 3) << 23).view(torch.float32)
    return torch.round(q / ulp) * ulp  # q / ulp is exact: a power of two


def _blocks(x: torch.Tensor, axis: str, block: int | None) -> tuple[torch.Tensor, tuple[int, int]]:
    """x as fp32 [..., nm, bm, nk, bk] zero-padded to whole blocks, and (M, K)."""
    x = x.float()
    if axis == "row":
        x = x.unsqueeze(-2)
    M, K = x.shape[-2:]
    (nm, bm), (nk, bk) = _block_grid(M, K, axis, block)
    x = torch.nn.functional.pad(x, (0, nk * bk - K, 0, nm * bm - M))
    return x.reshape(*x.shape[:-2], nm, bm, nk, bk), (M, K)


def scale_and_inverse(amax: torch.Tensor, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, inverse) of blocks of fp32 absolute maximum ``amax``: the dequantization factor
    amax / 448 and the quantization factor 448 / amax, both IEEE divisions (1 and 1 for an
    all-zero block); with ``pow2`` the scale rounded up to a power of two and its exact
    inverse. An inf amax gives scale inf and inverse 0."""
    # tensor / tensor: an IEEE division on every device (a CUDA tensor divided by a Python
    # number is multiplied by its rounded reciprocal instead)
    top = torch.full_like(amax, E4M3_MAX)
    scale = torch.where(amax > 0, amax / top, 1.0)
    if pow2:
        scale = pow2_up(scale)
        return scale, torch.ones_like(scale) / scale
    return scale, torch.where(amax > 0, top / amax, 1.0)


def quantize_fp8_ref(
    x: torch.Tensor,  # [..., K] (row) or [..., M, K] (col, both); bf16 / fp16 / fp32
    axis: str,
    block: int | None,  # None: the whole row (row) or column (col)
    pow2_scale: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale)``: data e4m3 of x's shape, scale fp32 of :func:`scale_shape`."""
    xb, (M, K) = _blocks(x, axis, block)
    mag = torch.where(xb.isnan(), 0.0, xb.abs())
    amax = mag.amax(dim=(-3, -1), keepdim=True)
    scale, inv = scale_and_inverse(amax, pow2_scale)
    q = round_e4m3((xb * inv).clamp(-E4M3_MAX, E4M3_MAX)).to(torch.float8_e4m3fn)
    lead = xb.shape[:-4]
    rows, cols = xb.shape[-4] * xb.shape[-3], xb.shape[-2] * xb.shape[-1]
    data = q.reshape(*lead, rows, cols)[..., :M, :K]
    scale = scale.squeeze(-1).squeeze(-2)  # [..., nm, nk]
    if axis == "row":
        data, scale = data.squeeze(-2), scale.squeeze(-2)
    return data.contiguous(), scale.contiguous()


def dequantize_fp8_ref(
    data: torch.Tensor, scale: torch.Tensor, axis: str, block: int | None
) -> torch.Tensor:
    """``data · scale`` in fp32, each scale spread over its block."""
    s = scale
    if block is None:  # [..., 1] or [..., 1, K]: broadcast over the whole row or column
        return data.float() * s
    if axis in ("row", "both"):
        s = s.repeat_interleave(block, dim=-1)[..., : data.shape[-1]]
    if axis in ("col", "both"):
        s = s.repeat_interleave(block, dim=-2)[..., : data.shape[-2], :]
    return data.float() * s


def grouped_mm_fp8_ref(
    a: torch.Tensor,  # [T, K] e4m3
    sa: torch.Tensor,  # [T, ⌈K/B⌉] fp32: a's 1×B blocks
    b: torch.Tensor,  # [E, N, K] e4m3 (each expert's weight as stored, nn.Linear layout)
    sb: torch.Tensor,  # [E, ⌈N/B⌉, ⌈K/B⌉] fp32: b's B×B blocks
    offsets: torch.Tensor,  # [E] cumulative end offsets (read on the host)
    block: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The blockwise FP8 ragged-M product ``y[rows of e] = a[rows of e] @ b[e]ᵀ`` in fp32, one
    promotion per block of K: ``acc += (a_k @ b[e]_kᵀ) · (sa_k · sb_k)``, as the kernel does it;
    rows past ``offsets[-1]`` are zero. Returns [T, N] in ``out_dtype``."""
    T, K = a.shape
    N = b.shape[1]
    out = torch.zeros(T, N, dtype=torch.float32, device=a.device)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            acc = torch.zeros(end - start, N, dtype=torch.float32, device=a.device)
            for kb in range(-(-K // block)):
                ks = slice(kb * block, min(K, (kb + 1) * block))
                part = a[start:end, ks].float() @ b[e, :, ks].float().t()
                col_scale = sb[e, :, kb].repeat_interleave(block)[:N]
                acc += part * (sa[start:end, kb, None] * col_scale[None, :])
            out[start:end] = acc
        start = end
    return out.to(out_dtype)


def grouped_mm_fp8_rowwise_ref(
    a: torch.Tensor,  # [T, K] e4m3
    sa: torch.Tensor,  # [T, 1] fp32: one scale per row of a
    b: torch.Tensor,  # [E, N, K] e4m3 (the contracted K last)
    sb: torch.Tensor,  # [E, N, 1] fp32: one scale per output channel of b[e]
    offsets: torch.Tensor,  # [E] cumulative end offsets (read on the host)
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The rowwise FP8 ragged-M product ``y[rows of e] = (a[rows of e] @ b[e]ᵀ) · sa · sb[e]ᵀ``:
    the whole K summed in fp32, then scaled once per output element, ``(acc · sa) · sb``, as
    the kernel does it; rows past ``offsets[-1]`` are zero. Returns [T, N] in ``out_dtype``."""
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    for e, (start, end) in enumerate(itertools.pairwise([0, *offsets.tolist()])):
        if end > start:
            acc = a[start:end].float() @ b[e].float().t()
            out[start:end] = acc * sa[start:end] * sb[e].t()
    return out.to(out_dtype)


def grouped_mm_fp8_wgrad_ref(
    a: torch.Tensor,  # [M, T] e4m3 (the tokens along T)
    sa: torch.Tensor,  # [⌈T/B⌉, M] fp32: a's B×1 blocks along the tokens
    b: torch.Tensor,  # [N, T] e4m3
    sb: torch.Tensor,  # [⌈T/B⌉, N] fp32
    offsets: torch.Tensor,  # [E] cumulative token ends, multiples of B (read on the host)
    block: int,
) -> torch.Tensor:
    """The blockwise FP8 weight gradient ``c[e] = a[:, tokens of e] @ b[:, tokens of e]ᵀ`` in
    fp32, one promotion per block of B tokens: ``acc += (a_k @ b_kᵀ) · (sa_k ⊗ sb_k)``.
    Returns [E, M, N] fp32 (zeros for an expert without tokens)."""
    M, N = a.shape[0], b.shape[0]
    out = torch.zeros(offsets.shape[0], M, N, dtype=torch.float32, device=a.device)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        for t0 in range(start, end, block):
            k, ts = t0 // block, slice(t0, t0 + block)
            part = a[:, ts].float() @ b[:, ts].float().t()
            out[e] += part * (sa[k, :, None] * sb[k, None, :])
        start = end
    return out
