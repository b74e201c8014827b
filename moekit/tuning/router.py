"""Launch shape of the top-k routing kernels: tokens per program and warps, from E."""

from __future__ import annotations

import dataclasses

from moekit.config import interpret_mode
from moekit.runtime.intmath import next_power_of_2

__all__ = ["RouterConfig", "router_config"]


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    block_t: int  # tokens per program
    block_e: int  # E padded to a power of two: one token's logits in registers
    num_warps: int


def router_config(num_experts: int) -> RouterConfig:
    """About 4096 scores per program (fewer tokens as E grows), at least one token; the
    interpreter takes small blocks (it runs programs one after another)."""
    block_e = max(next_power_of_2(num_experts), 16)
    if interpret_mode():
        return RouterConfig(block_t=4, block_e=block_e, num_warps=1)
    block_t = max(1, min(64, 4096 // block_e))
    return RouterConfig(block_t=block_t, block_e=block_e, num_warps=4 if block_e <= 256 else 8)
