"""Config choice for the permute kernels: the routing-metadata launches and the row copies.

Every choice is a pure function of static sizes (pairs N = T·k, slots k, width H), so one
training shape always runs one config and the launches can be replayed.
"""

from __future__ import annotations

import dataclasses

from moekit.runtime.intmath import cdiv, next_power_of_2
from moekit.runtime.state import memoized

__all__ = [
    "SMALL_BLOCKS_MIN_PAIRS",
    "TILE_ELEMS",
    "CopyConfig",
    "MetaConfig",
    "copy_config",
    "fit_block_h",
    "meta_config",
    "tile_config",
]

# Elements of one [k, BLOCK_H] tile of a copy kernel: enough loads in flight per program to
# stream at memory speed, few enough registers to keep several programs per SM.
TILE_ELEMS = 8192

# From this many (token, slot) pairs on, the metadata runs many small single-warp blocks.
SMALL_BLOCKS_MIN_PAIRS = 1 << 16


@dataclasses.dataclass(frozen=True)
class MetaConfig:
    """Launch shape of the three metadata kernels (histogram, scan, rows)."""

    block_n: int  # pairs per block (a power of two); B = ceil(N / block_n) blocks
    hist_warps: int
    rows_warps: int
    scan_block_e: int  # experts per scan program
    scan_block_b: int  # blocks per step of the scan's loop (a power of two)
    scan_warps: int


def _scan(block_e: int, max_block_b: int, num_blocks: int) -> tuple[int, int, int]:
    """(experts, blocks per step, warps) of the scan: a step never wider than the blocks there
    are; 8 warps once a step's tile is large enough to keep them busy."""
    block_b = min(next_power_of_2(num_blocks), max_block_b)
    return block_e, block_b, 8 if block_b * block_e >= 2048 else 4


@memoized(maxsize=1024)  # runs on every call of permute
def meta_config(n: int) -> MetaConfig:
    """The metadata config for N = T·k pairs.

    Large N: 256-pair blocks on one warp each. A one-warp bitonic sort needs no barriers, and
    the many blocks that result are cheap for a scan that walks wide steps of them over four
    experts per program. Small N: about 512 blocks (256 to 1024 pairs each), enough to fill the
    GPU while each block still sorts a useful number of pairs.
    """
    if n >= SMALL_BLOCKS_MIN_PAIRS:
        block_n = 256
        scan = _scan(4, 2048, cdiv(n, block_n))
        return MetaConfig(block_n, 1, 1, *scan)
    block_n = min(max(next_power_of_2(cdiv(max(n, 1), 512)), 256), 1024)
    scan = _scan(8, 512, cdiv(max(n, 1), block_n))
    return MetaConfig(block_n, 4, 4, *scan)


@dataclasses.dataclass(frozen=True)
class CopyConfig:
    """Tile configuration of a copy kernel (the scatter or the gather of rows)."""

    block_h: int  # H elements per step (a power of two)
    num_warps: int
    # False: each step is a [K_PAD, BLOCK_H] tile of the token's k rows (reduced over k by
    # tl.sum in the gather, a broadcast store in the scatter). True: a static loop over the k
    # slots, one [BLOCK_H] row each (the gather accumulates into a 1-D fp32 vector: no
    # cross-thread reduction; the scatter loads x once per step and stores it k times).
    loop_k: bool = False
    # Streams touched once (rows read by the gather, rows written by both, the dot rows and,
    # with loop_k, x in the scatter) are marked evict_first, so they do not push reused lines
    # out of L2.
    evict_first: bool = False

    @property
    def zero_rows(self) -> int:
        """Rows per step of the zero-fill of padding and tail rows (one tile's worth)."""
        return max(TILE_ELEMS // self.block_h, 1)


def fit_block_h(block_h: int, H: int) -> int:
    """``block_h`` capped at H's next power of two, halved (down to 256) while that leaves a
    mostly masked last chunk: H = 7168 gets 1024, not 4096, so no step is three-quarters
    idle."""
    block_h = min(block_h, next_power_of_2(max(H, 1)))
    while block_h > 256 and H % block_h and H % block_h < block_h // 2:
        block_h //= 2
    return block_h


def tile_config(k: int, H: int) -> CopyConfig:
    """A [K_PAD, BLOCK_H] tile of about TILE_ELEMS elements; 8 warps once it holds 4096
    elements or more (fewer would each hold too many registers)."""
    k_pad = next_power_of_2(max(k, 1))
    block_h = fit_block_h(max(TILE_ELEMS // k_pad, 64), H)
    return CopyConfig(block_h=block_h, num_warps=8 if k_pad * block_h >= 4096 else 4)


def copy_config(kind: str, k: int, H: int, dot: bool = False) -> CopyConfig:
    """The config of a ``kind`` ("scatter" or "gather") launch; ``dot``: the scatter of
    unpermute's backward (weighted rows and the prob-gradient dot).

    * Gather with k >= 4: a [k, BLOCK_H] tile would be reduced over k across warps through
      shared memory; a loop over the k rows into a 1-D fp32 accumulator needs no such
      reduction and keeps the gather at the rate of a plain copy.
    * Scatter with the dot and k >= 4: its fp32 products hold more registers per element, and
      4 warps per program leave room for more resident programs.
    * Plain scatter with k <= 2 and H <= 4096: a [k, BLOCK_H] tile is then one or two rows
      wide; a loop over the slots with 2048-wide steps keeps more bytes in flight per program,
      and evict-first stores keep the written rows, never read again here, out of the way.
    * Otherwise the [k, BLOCK_H] tile.
    """
    tile = tile_config(k, H)
    if kind == "gather":
        if k >= 4:
            return CopyConfig(block_h=fit_block_h(2048, H), num_warps=4, loop_k=True)
        return tile
    if dot:
        return dataclasses.replace(tile, num_warps=4) if k >= 4 else tile
    if k <= 2 and H <= 4096:
        return CopyConfig(block_h=fit_block_h(2048, H), num_warps=8, loop_k=True, evict_first=True)
    return tile
