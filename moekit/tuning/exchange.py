"""Launch shapes of the expert exchange's peer-reading kernels (:mod:`moekit.kernels.exchange`).

Reading peers' memory over NVLink is latency-bound per request: a program holds one
``[block_r, block_h]`` tile of loads in flight, and the rate comes from many programs' tiles in
flight at once. Measured on 4 × H200 (NV18, GPU-to-GPU copy engine 394 GB/s), the dispatch read
of the Qwen3-30B-A3B layer reached 340 GB/s per GPU from 16-row tiles and four programs per SM
(214 GB/s with 8-row tiles and two per SM); the combine's summing read 350 GB/s from eight per SM.
"""

from __future__ import annotations

import dataclasses

from moekit.runtime.intmath import next_power_of_2

__all__ = ["PullConfig", "pull_config"]

TILE_BYTES = 32768  # bytes one program loads per step: 16 rows of a 2 KiB row slice


@dataclasses.dataclass(frozen=True)
class PullConfig:
    block_r: int  # rows per program step
    block_h: int  # columns per program step (a power of two)
    programs_per_sm: int  # persistent programs per SM (capped by the work)


def pull_config(kind: str, H: int, element_size: int) -> PullConfig:
    """``kind``: "tokens" (the dispatch's gather), "sum" (the combine's summing read, which
    also holds an fp32 accumulator tile), or "copy" (local staging)."""
    block_r = 16
    per_row = max(16, TILE_BYTES // (block_r * element_size))
    if kind == "sum":  # W loads and an fp32 tile per step: a narrower slice
        per_row //= 2
    block_h = min(next_power_of_2(H), per_row)
    programs = {"tokens": 4, "sum": 8, "copy": 2}[kind]
    return PullConfig(block_r, block_h, programs)
