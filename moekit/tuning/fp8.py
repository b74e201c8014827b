"""Config choice for the FP8 quantization kernels: a pure function of the recipe's axis, block
and (rowwise) the length of a row or column.

The kernels are streaming ones (read 2 bytes, write 1 per element): a tile of 16K elements
keeps enough loads in flight per program, with the block's side fixed by the blockwise recipe.
The rowwise kernel reads its lines twice (amax, then quantize): a program's lines span at most
``LINE_ELEMS`` elements, so that what the programs resident on the GPU have read once
(132 SMs × a few programs × 64 KiB of bf16) stays within an H100/H200's 50 MB of L2 for the
second read.
"""

from __future__ import annotations

import dataclasses

from moekit.runtime.intmath import next_power_of_2

__all__ = [
    "ACT_BWD_TILE",
    "ACT_TILE",
    "TWO_WAY_TILE",
    "QuantizeConfig",
    "TileWalkConfig",
    "quantize_config",
    "rowwise_quantize_config",
]

TILE_ELEMS = 16384
LINE_ELEMS = 32768  # elements of the lines of one rowwise program
COL_LINES = 64  # columns of a per-column program: 128 contiguous bytes of bf16 per row


@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
    block_m: int  # tile rows (the block side for col / both scales)
    block_k: int  # tile columns (the block side for row / both scales)
    num_warps: int


def quantize_config(axis: str, block: int) -> QuantizeConfig:
    """Tile of one program: the block along each scaled dimension, the rest filling
    ``TILE_ELEMS``; row blocks take several rows, col blocks several columns."""
    other = max(1, TILE_ELEMS // block)
    if axis == "row":
        return QuantizeConfig(min(other, 64), block, 8)
    if axis == "col":
        return QuantizeConfig(block, min(other, 64), 8)
    return QuantizeConfig(block, block, 8)


def rowwise_quantize_config(axis: str, length: int) -> QuantizeConfig:
    """Lines (rows, or columns with ``axis="col"``) of one rowwise program and its step along
    them, for lines of ``length`` elements. Rows are contiguous along the step: as many of
    them as fit ``LINE_ELEMS`` (at most 64), the step filling the tile. Columns are contiguous
    across the lines: 64 of them, stepping over 256 rows (a weight's per-input-channel copy,
    made once per weight version: its second read may come from HBM)."""
    span = next_power_of_2(max(length, 1))
    if axis == "col":
        return QuantizeConfig(COL_LINES, min(TILE_ELEMS // COL_LINES, span), 8)
    lines = min(64, 1 << max(0, (LINE_ELEMS // max(length, 1)).bit_length() - 1))
    return QuantizeConfig(lines, min(TILE_ELEMS // lines, span), 8)


@dataclasses.dataclass(frozen=True)
class TileWalkConfig:
    """The tile of the kernels that write a tensor quantized both ways (1×128, and 128×1 along
    the tokens) from one read: the FP8 MLP's activation kernels and the two-way quantization.
    A 128-row token block by one 128-column block per program, walked ``chunk`` whole rows at
    a time: a whole [128, 128] tile of the activation backward's three fp32 inputs and two
    outputs held at once spills registers, these chunks spill none. 16 rows at 4 warps is the
    fastest forward; the backward takes 8 warps (its faster configs spill)."""

    block_m: int = 128
    block_n: int = 128
    chunk: int = 16  # rows per step of the walk
    num_warps: int = 4


ACT_TILE = TileWalkConfig()
ACT_BWD_TILE = TileWalkConfig(num_warps=8)
TWO_WAY_TILE = TileWalkConfig()  # one input, the forward activation kernel's load
