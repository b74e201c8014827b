"""Config choice for the all-reduce + RMSNorm family: the algorithm ``algo="auto"`` picks, and the
launch shape (grid, warps, column split, gather layout) of each kernel.

``auto`` uses per-world-size thresholds where the algorithms were compared on hardware (the
table and the benchmark that reproduces it are in docs/allreduce_rmsnorm.md), a cost model for
other world sizes, and user overrides (:func:`set_auto_thresholds`, then the ``MOEKIT_AR_*``
variables read through :mod:`moekit.config`) before either.
"""

from __future__ import annotations

import dataclasses
import math

from moekit.config import allreduce_threshold_bytes, interpret_mode
from moekit.runtime.cache import cache_clear
from moekit.runtime.intmath import cdiv, next_power_of_2

__all__ = [
    "PLAN_CACHE_KIND",
    "AllreduceConfig",
    "allreduce_config",
    "auto_algo",
    "rmsnorm_bwd_grid",
    "row_num_warps",
    "set_auto_thresholds",
]

# Entries of moekit.runtime.cache holding the ops' all-reduce launch plans, which embed the
# algorithm ``auto`` picked: dropped when the thresholds change.
PLAN_CACHE_KIND = "allreduce_plan"

TWO_SHOT_ALGOS = ("two_shot", "lamport_two_shot")
LAMPORT_ALGOS = ("lamport", "lamport_two_shot")


@dataclasses.dataclass(frozen=True)
class AllreduceConfig:
    """Launch shape of one call of the fused all-reduce kernel."""

    grid: int  # programs per rank; at most one per SM, so every program of every rank is resident
    num_warps: int
    split: int = 1  # Lamport push phases: column pieces per row (more programs share the stores)
    gather_tile: bool = False  # two_shot: gather the W rows of a chunk index as one [W, H] tile


# The [W, H] gather tile is kept in registers: past this many elements it would spill.
GATHER_TILE_MAX_ELEMENTS = 32768


def row_num_warps(H: int) -> int:
    """Warps per program of a row kernel whose tile covers a row of ``H`` elements: about 16
    fp32 values per thread, so a row stays in registers without leaving threads idle."""
    block = next_power_of_2(H)
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


def rmsnorm_bwd_grid(T: int, num_sms: int) -> int:
    """Programs of the persistent add + RMSNorm backward: two per SM hide each other's load
    latency; more would only add fp32 partial rows of dw for the final sum to read."""
    return max(1, min(T, 2 * num_sms))


def _gather_tile(algo: str, world: int, H: int) -> bool:
    """two_shot's all-gather as one [W, H] tile per step puts the W − 1 remote row loads in
    flight together, where a row-by-row loop waits on each before the norm's reduction. Two
    ranks have a single remote row per step, so they keep the row loop."""
    if algo != "two_shot" or world < 4:
        return False
    return next_power_of_2(world) * next_power_of_2(H) <= GATHER_TILE_MAX_ELEMENTS


def _num_warps(algo: str, world: int, H: int, gather_tile: bool) -> int:
    block = next_power_of_2(H)
    if gather_tile:  # at most 32 fp32 values of the [W, H] tile per thread
        return max(4, min(16, next_power_of_2(world) * block // (32 * 32)))
    if algo == "two_shot" and block <= 8192:
        # row by row, two_shot is bound by its remote loads: fewer warps with longer rows per
        # thread keep more loads in flight per warp
        return 4
    return row_num_warps(H)


def lamport_split(work: int, max_programs: int, H: int, num_warps: int) -> int:
    """Column pieces per row in the Lamport push phases (``work`` rows to push per rank).

    The push phases are remote stores, whose throughput grows with the number of SMs issuing
    them: 4 pieces while the rows alone cannot fill the grid, else 2 (one piece leaves the
    stores of a row on one SM; more than 2 only adds programs once the grid is full). A piece
    keeps at least 4 elements per thread. Always 1 in the interpreter: pieces make programs
    wait on other programs of the same launch, which the interpreter runs one after another."""
    if interpret_mode():
        return 1
    split = 4 if work < max_programs else 2
    block = next_power_of_2(H)
    while split > 1 and block // split < 4 * 32 * num_warps:
        split //= 2
    return split


def allreduce_config(algo: str, T: int, H: int, world: int, max_programs: int) -> AllreduceConfig:
    """The launch shape of a [T, H] all-reduce with ``algo`` over ``world`` ranks, on at most
    ``max_programs`` programs (the SM count, capped by what the kernel's flag layout holds).

    One program per row (one_shot) or per row of a rank's chunk (two_shot); the Lamport
    algorithms also count the column pieces of their push phases."""
    gather_tile = _gather_tile(algo, world, H)
    num_warps = _num_warps(algo, world, H, gather_tile)
    work = cdiv(T, world) if algo in TWO_SHOT_ALGOS else T
    split = 1
    if algo in LAMPORT_ALGOS:
        split = lamport_split(work, max_programs, H, num_warps)
        if split > 1:
            work = max(work * split, T)
    grid = max(1, min(work, max_programs))
    return AllreduceConfig(grid, num_warps, split, gather_tile)


# Largest message (T·H·element size, bytes) each algorithm is picked for, on the world sizes
# where the algorithms were compared. NCCL (+ the local add and norm) never won there, so it
# is picked only above a user-set two_shot maximum.
ONE_SHOT_MAX = {2: 8 << 20, 4: 1 << 20}
LAMPORT_MAX = {2: 512 << 10, 4: 0}  # on 4 ranks lamport_two_shot wins already at one token
LAMPORT_TWO_SHOT_MAX = {2: 4 << 20, 4: 8 << 20}

# Cost model for other world sizes: one_shot moves (W−1)·N bytes into each GPU, two_shot
# 2(W−1)/W·N plus one more barrier. This is the number of bytes NVLink moves into a GPU in
# the time of that extra barrier; two_shot wins once the bytes it saves exceed it.
BARRIER_COST_BYTES = 1_350_000

_overrides: dict[str, int | None] = dict.fromkeys(
    ("one_shot", "two_shot", "lamport", "lamport_two_shot")
)


def set_auto_thresholds(
    one_shot_max_bytes: int | None = None,
    two_shot_max_bytes: int | None = None,
    lamport_max_bytes: int | None = None,
    lamport_two_shot_max_bytes: int | None = None,
) -> None:
    """Override ``auto``. For bf16/fp16: lamport up to ``lamport_max_bytes``, then
    lamport_two_shot up to ``lamport_two_shot_max_bytes`` (each only where the message fits the
    pool's Lamport slots); then, for every dtype: one_shot up to ``one_shot_max_bytes``, two_shot
    up to ``two_shot_max_bytes``, NCCL above. ``None`` restores the default / environment.
    Drops the cached launch plans, so the next call of every shape decides again."""
    _overrides["one_shot"] = one_shot_max_bytes
    _overrides["two_shot"] = two_shot_max_bytes
    _overrides["lamport"] = lamport_max_bytes
    _overrides["lamport_two_shot"] = lamport_two_shot_max_bytes
    cache_clear(PLAN_CACHE_KIND)


def _threshold(name: str, default: float | None) -> float | None:
    """The user's maximum for ``name`` (set_auto_thresholds, then the environment), else
    ``default``."""
    value = _overrides[name]
    if value is None:
        value = allreduce_threshold_bytes(name)
    return default if value is None else value


def _one_shot_model_max(world_size: int) -> float:
    gain = (world_size - 1) * (1.0 - 2.0 / world_size)  # bytes two_shot saves per message byte
    return math.inf if gain <= 0 else BARRIER_COST_BYTES / gain


def auto_algo(nbytes: int, world_size: int, sixteen_bit: bool = False) -> str:
    """The algorithm ``auto`` picks for a message of ``nbytes`` (T·H·element size);
    ``sixteen_bit``: bf16/fp16, so the Lamport algorithms are candidates (the op still checks
    that the message fits the pool's Lamport slots and takes the plain twin otherwise)."""
    if sixteen_bit:
        if nbytes <= _threshold("lamport", LAMPORT_MAX.get(world_size, 0)):
            return "lamport"
        if nbytes <= _threshold("lamport_two_shot", LAMPORT_TWO_SHOT_MAX.get(world_size, 0)):
            return "lamport_two_shot"
    one_max = _threshold("one_shot", ONE_SHOT_MAX.get(world_size))
    if one_max is None:
        one_max = _one_shot_model_max(world_size)
    if nbytes <= one_max:
        return "one_shot"
    if nbytes <= _threshold("two_shot", math.inf):
        return "two_shot"
    return "nccl"
