"""Config choice for the fused grouped-MLP kernels (fc1 with the activation epilogue, and the
fc2 dgrad with the activation backward): candidates, and fitting tiles to a GLU interleave.

``BLOCK_N`` counts F-columns: a gated fc1 tile holds 2 * BLOCK_N accumulator columns, so gated
tiles are narrower than the plain grouped GEMM's.
"""

from __future__ import annotations

import dataclasses

import torch

from moekit.runtime.intmath import cdiv
from moekit.runtime.state import memoized
from moekit.tuning.grouped_gemm import INTERPRET_CONFIG, GemmConfig

__all__ = [
    "dact_candidates",
    "dact_partial_rows",
    "fc1_candidates",
    "fit_interleave",
]

# Gated: two [128, 128] accumulators (gate and up) fed from one A tile; a fourth stage keeps
# more of the three operand tiles in flight.
_FC1_GATED = (
    GemmConfig(128, 128, 64, num_warps=8, num_stages=4),
    GemmConfig(128, 128, 64, num_warps=8, num_stages=3),
    GemmConfig(128, 64, 64, num_warps=4, num_stages=4),
    GemmConfig(64, 128, 64, num_warps=4, num_stages=4),
)
_FC1 = (
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3),
    GemmConfig(128, 128, 64, num_warps=8, num_stages=4),
    GemmConfig(64, 256, 64, num_warps=4, num_stages=4),
)
_DACT = (
    GemmConfig(128, 128, 64, num_warps=8, num_stages=4),
    GemmConfig(128, 64, 64, num_warps=4, num_stages=4),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3),
    GemmConfig(64, 128, 64, num_warps=4, num_stages=4),
)
# The dact epilogue reads h and writes dh, memory-bound work that the tile's tensor cores sit
# out: wide tiles halve the epilogues per row (and the re-reads of dy across F-tiles). That pays
# where there are many rows to spread over the SMs and F is moderate, and not when the epilogue
# also stores the recomputed activation (its registers and shared memory no longer fit well).
_DACT_WIDE = GemmConfig(128, 256, 64, num_warps=8, num_stages=4)
DACT_WIDE_MIN_ROWS = 32768
DACT_WIDE_MAX_F = 4096
_DACT_WIDE_FIRST = (_DACT_WIDE, *_DACT)
# fp32 operands (4-byte elements, TF32 MMA): 32-deep K steps and narrower tiles, so that the
# pipeline stages fit in shared memory (the 16-bit tiles would need 288-384 KiB).
_FC1_FP32 = (
    GemmConfig(128, 64, 32, num_warps=8, num_stages=3),
    GemmConfig(64, 64, 32, num_warps=4, num_stages=3),
)
_DACT_FP32 = (
    GemmConfig(128, 64, 32, num_warps=8, num_stages=3),
    GemmConfig(64, 64, 32, num_warps=4, num_stages=3),
)
_DACT_ALL = (*_DACT, _DACT_WIDE)


def _fused_block_n(block_n: int, interleave: int | None) -> int:
    """The largest power-of-two tile width <= block_n that divides the GLU interleave (a tile
    must not straddle a gate/up block); halves (interleave None) need no division."""
    if interleave is None:
        return block_n
    while block_n > 16 and interleave % block_n:
        block_n //= 2
    return block_n


def fit_interleave(cfg: GemmConfig, interleave: int | None) -> GemmConfig:
    """``cfg`` with its tile width fitted to the GLU interleave."""
    bn = _fused_block_n(cfg.block_n, interleave)
    return cfg if bn == cfg.block_n else dataclasses.replace(cfg, block_n=bn)


@memoized
def _fit_all(cands: tuple[GemmConfig, ...], interleave: int | None) -> tuple[GemmConfig, ...]:
    return tuple(dict.fromkeys(fit_interleave(c, interleave) for c in cands))


def fc1_candidates(
    gated: bool, interleave: int | None, dtype: torch.dtype = torch.bfloat16
) -> tuple[GemmConfig, ...]:
    """The fc1 kernel's candidates for operands of ``dtype``, default first."""
    if dtype == torch.float32:
        return _fit_all(_FC1_FP32, interleave)
    return _fit_all(_FC1_GATED if gated else _FC1, interleave)


def dact_candidates(
    interleave: int | None, rows: int, F: int, store_a: bool, dtype: torch.dtype = torch.bfloat16
) -> tuple[GemmConfig, ...]:
    """The dact kernel's candidates for ``rows`` (R, the static row count), ``F`` and operands
    of ``dtype``, default first: the wide tile for 16-bit operands, large R, moderate F and no
    recomputed activation to store."""
    if dtype == torch.float32:
        return _fit_all(_DACT_FP32, interleave)
    if rows >= DACT_WIDE_MIN_ROWS and F <= DACT_WIDE_MAX_F and not store_a:
        return _fit_all(_DACT_WIDE_FIRST, interleave)
    return _fit_all(_DACT_ALL, interleave)


@memoized
def dact_partial_rows(F: int, interleave: int | None) -> int:
    """Rows of the dprobs-partials buffer that the dact kernel needs for any config it may
    run: one per BLOCK_N-wide F tile of the narrowest candidate (the interpreter's included).
    Cached: every backward asks."""
    cands = (
        *_fit_all(_DACT_ALL, interleave),
        *_fit_all(_DACT_FP32, interleave),
        fit_interleave(INTERPRET_CONFIG, interleave),
    )
    return max(cdiv(F, c.block_n) for c in cands)
