"""Config choice for the FP8 quantization kernel: a pure function of the recipe's axis and block.

The kernel is a streaming one (read 2 bytes, write 1 per element): a tile of 16K elements keeps
enough loads in flight per program, with the block's side fixed by the recipe.
"""

from __future__ import annotations

import dataclasses

__all__ = ["QuantizeConfig", "quantize_config"]

TILE_ELEMS = 16384


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
