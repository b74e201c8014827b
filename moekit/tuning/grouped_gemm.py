"""Config choice for the grouped-GEMM kernels: the config type, the default for a static shape,
the autotuner's candidates and the autotuner.

A config is chosen per static key (dtype, N, K, E, layout flags, never the ragged row count),
so a training loop whose routing changes every step keeps one choice per layer shape. The
default is a shape rule. With ``MOEKIT_AUTOTUNE=1`` the first call of a key on a GPU times the
candidates once, on this call's routing and on a fixed skewed one (a choice must serve every
later routing), and keeps the default unless another candidate is clearly faster on both; the
choice is logged and saved on disk (:mod:`moekit.tuning.store`), so later processes reuse it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Callable

import torch
import triton
import triton.testing

from moekit.config import autotune_enabled, interpret_mode
from moekit.runtime.cache import cache_entries, cache_get, cached
from moekit.runtime.device import is_capturing
from moekit.runtime.intmath import cdiv
from moekit.tuning import store

_log = logging.getLogger("moekit.tuning")

__all__ = [
    "FP8_ROWWISE_RAGGED_M",
    "FP32_CANDIDATES",
    "INTERPRET_CONFIG",
    "RAGGED_K_CANDIDATES",
    "RAGGED_K_DEFAULT_16",
    "RAGGED_M_CANDIDATES",
    "RAGGED_M_DECODE",
    "RAGGED_M_FINE_GRAINED",
    "RAGGED_M_SMALL",
    "GemmConfig",
    "choose_config",
    "fp8_ragged_m_config",
    "ragged_k_candidates",
    "ragged_m_candidates",
    "routing_robust_launches",
    "skewed_offsets",
    "tuned_configs",
]


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tile shape and schedule of one grouped-GEMM launch."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8  # m-tiles per swizzle band (neighbouring programs share A and B in L2)
    num_warps: int = 8
    num_stages: int = 3
    # Fuse the tile and K loops, overlapping a tile's epilogue with the next tile's loads:
    # Triton's loop flattening in ragged M; in ragged K (whose K loop length varies by
    # expert, which Triton cannot flatten) a hand-fused loop over the static deal of tiles.
    flatten: bool = False
    c_tma: bool = True  # TMA store (or TMA reduce-add) of C, else masked pointer stores
    warp_specialize: bool = False  # producer/consumer warps for the tile loop
    # TMA epilogue in two [BM, BN/2] halves: half the epilogue's shared memory, which leaves
    # room for one more pipeline stage (or an fp32 C tile) at BN = 256.
    epilogue_subtile: bool = False
    # Ragged K only: programs take tiles from an atomic counter (greedy, longest expert first)
    # instead of a static round-robin deal, which skewed expert sizes leave unbalanced. With
    # ``flatten`` too, the kernel picks one of the two schedules from the routing, on the
    # device: the static deal when its estimated makespan is within ``static_slack_pct`` % of
    # the greedy one's (the flattened loop gains that much per step).
    dynamic: bool = False
    static_slack_pct: int = 106
    # Ragged M only: swizzle tiles within each expert rather than over the global m-tile
    # index, so concurrently running tiles share one expert's weights.
    expert_groups: bool = False
    # Ragged M only: load A through a descriptor bounded at the tile's expert end, so the rows
    # of the next expert in an expert's last tile (never stored) are not read but zero-filled.
    a_bounded: bool = False


# Small tiles: the interpreter runs programs one after another.
INTERPRET_CONFIG = GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=1)

# Expert-aligned bands with the flattened loop: robust across routings, which matters because
# the choice is reused for every routing a layer sees.
RAGGED_M_DEFAULT = GemmConfig(
    128, 256, 64, num_warps=8, num_stages=3, flatten=True, expert_groups=True
)
# Where experts are small and K short, tiles are short-lived and their warps mostly wait for
# operand tiles: the sub-tiled epilogue frees shared memory for a fourth pipeline stage.
RAGGED_M_FINE_GRAINED = dataclasses.replace(RAGGED_M_DEFAULT, num_stages=4, epilogue_subtile=True)
# Few rows per expert (decode steps, short prefills): the weights dominate the bytes and the
# large tiles leave SMs idle, so narrower tiles with a deep K pipeline (more tiles, more bytes
# in flight per SM).
RAGGED_M_SMALL = GemmConfig(64, 128, 128, num_warps=4, num_stages=4)
# Where even those tiles cover under half the SMs (a decode step over few experts, e.g. 2 rows
# of Mixtral), each SM's share of the weights streams at the SM's own bandwidth limit: tiles
# half as wide put twice the SMs on the weights, and 16-row tiles (the rows are a handful
# anyway) leave the shared memory to four 256-deep stages of weights in flight.
RAGGED_M_DECODE = GemmConfig(16, 64, 256, num_warps=4, num_stages=4)
RAGGED_M_CANDIDATES = (
    RAGGED_M_DEFAULT,
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3, flatten=True),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=4, epilogue_subtile=True),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=4, epilogue_subtile=True, flatten=True),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=4, c_tma=False),
    GemmConfig(64, 256, 64, num_warps=4, num_stages=4),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3, warp_specialize=True),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3, expert_groups=True),
    RAGGED_M_FINE_GRAINED,
    RAGGED_M_SMALL,
    RAGGED_M_DECODE,
)
# fp32 operands: smaller tiles (twice the bytes per element).
FP32_CANDIDATES = (
    GemmConfig(128, 128, 32, num_warps=8, num_stages=3),
    GemmConfig(128, 64, 32, num_warps=4, num_stages=4),
)
# Rowwise FP8 (fp8_ragged_m_config): four 32 KiB stages of e4m3 A and B tiles and the bf16
# epilogue tile fit Hopper's shared memory.
FP8_ROWWISE_RAGGED_M = GemmConfig(128, 128, 128, num_warps=8, num_stages=4, flatten=True)
SMALL_MAX_ROWS_PER_EXPERT = 16
FINE_GRAINED_MAX_ROWS_PER_EXPERT = 1024
FINE_GRAINED_MAX_K = 2048
A_BOUNDED_MAX_ROWS_PER_EXPERT = 512
WIDE_BAND_MIN_K_N = 2048
WIDE_BAND_GROUP_M = 16


def _few_tiles(T: int, E: int, N: int, num_sms: int) -> bool:
    """Whether the default's 128 x 256 tiles would leave SMs idle: at most T / 128 full m-tiles
    plus one partial tile per expert with rows, times the n-tiles."""
    return (T // 128 + min(E, T)) * cdiv(N, 256) < num_sms


def _few_narrow_tiles(T: int, E: int, N: int, num_sms: int) -> bool:
    """Whether even the narrow config's tiles (at most T / 64 full m-tiles plus one partial
    tile per expert with rows, times the n-tiles) would cover under half the SMs."""
    small = RAGGED_M_SMALL
    return (T // small.block_m + min(E, T)) * cdiv(N, small.block_n) < num_sms // 2


def ragged_m_candidates(
    dtype: torch.dtype, T: int, E: int, K: int, N: int, num_sms: int = 132
) -> tuple[GemmConfig, ...]:
    """The ragged-M candidates for this static shape, its default first.

    * Few rows per expert (at most 16 on average) or too few default tiles to fill the
      ``num_sms`` SMs lead with the narrow deep-K config; where its tiles would still cover
      under half the SMs, with the half-width decode config.
    * Fine-grained experts (≤ 1024 rows each on average) with K ≤ 2048 lead with the 4-stage
      sub-tiled config; larger experts or a longer K amortise the pipeline's fill and the
      3-stage config with a full-width epilogue does better.
    * With ≤ 512 rows per expert on average (at most four m-tiles) the rows past an expert's end
      in its last tile are a large share of the rows computed, so every candidate loads A
      bounded at the expert's end (those rows read as zeros, not from memory).
    * Outside the fine-grained case, where K, N ≥ 2048, every candidate swizzles over bands of
      16 m-tiles: an expert then has many n-tiles, and a taller band covers them with less of A
      and B resident in L2 at once.
    """
    if dtype == torch.float32:
        return FP32_CANDIDATES
    cands = RAGGED_M_CANDIDATES
    if _few_narrow_tiles(T, E, N, num_sms):
        cands = (RAGGED_M_DECODE, *(c for c in cands if c != RAGGED_M_DECODE))
    elif T <= SMALL_MAX_ROWS_PER_EXPERT * E or _few_tiles(T, E, N, num_sms):
        cands = (RAGGED_M_SMALL, *(c for c in cands if c != RAGGED_M_SMALL))
    elif T <= FINE_GRAINED_MAX_ROWS_PER_EXPERT * E and K <= FINE_GRAINED_MAX_K:
        cands = (RAGGED_M_FINE_GRAINED, *(c for c in cands if c != RAGGED_M_FINE_GRAINED))
    elif K >= WIDE_BAND_MIN_K_N and N >= WIDE_BAND_MIN_K_N:
        cands = tuple(dataclasses.replace(c, group_m=WIDE_BAND_GROUP_M) for c in cands)
    if T <= A_BOUNDED_MAX_ROWS_PER_EXPERT * E:
        cands = tuple(dataclasses.replace(c, a_bounded=True) for c in cands)
    return cands


# 16-bit output: the routing-chosen schedule (flattened static deal where the routing is
# balanced, greedy dynamic where it is skewed), so one config serves both kinds of routing.
RAGGED_K_DEFAULT_16 = GemmConfig(
    128, 256, 64, num_warps=8, num_stages=3, epilogue_subtile=True, flatten=True, dynamic=True
)
# fp32 output (main_grad accumulation): the flattened loop's reduce-add epilogue stalls it, so
# the dynamic schedule alone.
RAGGED_K_DEFAULT_FP32_OUT = dataclasses.replace(RAGGED_K_DEFAULT_16, flatten=False)
RAGGED_K_CANDIDATES = (
    GemmConfig(128, 128, 64, num_warps=8, num_stages=4),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3, epilogue_subtile=True),
    RAGGED_K_DEFAULT_FP32_OUT,
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3, c_tma=False),
    # A full-width fp32 C tile exceeds shared memory (the tuner skips it where it does not fit).
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3, dynamic=True),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3, flatten=True),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3, epilogue_subtile=True, flatten=True),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=4, epilogue_subtile=True, flatten=True),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3, c_tma=False, flatten=True),
    RAGGED_K_DEFAULT_16,
    dataclasses.replace(RAGGED_K_DEFAULT_16, num_stages=4),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3, c_tma=False, flatten=True, dynamic=True),
)


def ragged_k_candidates(dtype: torch.dtype, out_dtype: torch.dtype) -> tuple[GemmConfig, ...]:
    """The ragged-K candidates with the default for this output dtype first."""
    if dtype == torch.float32:
        return FP32_CANDIDATES
    first = RAGGED_K_DEFAULT_FP32_OUT if out_dtype == torch.float32 else RAGGED_K_DEFAULT_16
    return (first, *(c for c in RAGGED_K_CANDIDATES if c != first))


Launch = Callable[[GemmConfig], object]
# A candidate replaces the default only if faster by more than this fraction on every routing
# timed: the tuner's short timings move by about that much from run to run, and the choice
# serves routings the tuner never saw.
KEEP_DEFAULT_WITHIN = 0.05


def choose_config(
    kind: str,
    key: tuple,
    dtype: torch.dtype,
    device: torch.device,
    candidates: tuple[GemmConfig, ...],
    launches: Callable[[], tuple[Launch, ...]],
    interpret_config: GemmConfig = INTERPRET_CONFIG,
    keep_default_within: float = KEEP_DEFAULT_WITHIN,
) -> GemmConfig:
    """The config of a ``kind`` launch with static ``key``: the interpreter's small tiles off a
    GPU; ``candidates[0]`` (the default) with tuning off or inside CUDA-graph capture; else the
    tuned choice, timed once per key (``launches()`` gives the calls to time, each taking a
    config; every one of them must leave the call's outputs as a plain launch would)."""
    if interpret_mode() or device.type != "cuda":
        return interpret_config
    full_key = ("tuned", kind, dtype, *key)
    if not autotune_enabled() or is_capturing():
        found = cache_get(full_key)
        return found if found is not None else candidates[0]

    def stored_or_tuned() -> GemmConfig:
        fp = store.fingerprint(device)
        stored = store.lookup(fp, repr(full_key))
        try:
            cfg = GemmConfig(**stored) if stored is not None else None
        except TypeError:  # fields of another GemmConfig: tune afresh
            cfg = None
        if cfg in candidates:
            return cfg
        t0 = time.perf_counter()
        cfg = _tune(candidates, launches(), keep_default_within)
        _log.info(
            "moekit: tuned %s %s in %.1f s (%d candidates): %s",
            kind, key, time.perf_counter() - t0, len(candidates), cfg,
        )  # fmt: skip
        store.save(fp, repr(full_key), dataclasses.asdict(cfg))
        return cfg

    return cached(full_key, stored_or_tuned)


def _time_candidate(cand: GemmConfig, launches: tuple[Launch, ...], is_default: bool):
    """Median milliseconds of each launch with ``cand``, or None if it cannot be built here."""
    try:
        return [triton.testing.do_bench(lambda f=f: f(cand), warmup=5, rep=20) for f in launches]
    except triton.runtime.errors.OutOfResources:
        if is_default:
            raise
        return None  # e.g. an fp32 C tile that does not fit in shared memory
    except Exception as exc:  # compiler errors come in several types
        if is_default:
            raise
        warnings.warn(f"moekit: grouped GEMM config {cand} skipped: {str(exc)[:200]}", stacklevel=4)
        return None


def _tune(
    candidates: tuple[GemmConfig, ...], launches: tuple[Launch, ...], keep_default_within: float
) -> GemmConfig:
    # Two rounds over the candidates, the second in reverse order, each keeping its best time
    # per launch: a GPU's clock drifts as it heats up, which would favour whichever ran first.
    times: dict[GemmConfig, list[float]] = {}
    for round_ in range(2):
        for cand in candidates if round_ == 0 else tuple(reversed(candidates)):
            if round_ and cand not in times:
                continue  # could not be built in the first round
            ms = _time_candidate(cand, launches, cand is candidates[0])
            if ms is not None:
                prev = times.get(cand, [float("inf")] * len(ms))
                times[cand] = [min(x, y) for x, y in zip(ms, prev)]
    best = min(times, key=lambda c: sum(times[c]))
    default = candidates[0]
    margin = 1 + keep_default_within
    if best is not default and not all(b * margin < d for b, d in zip(times[best], times[default])):
        return default
    return best


def tuned_configs() -> dict[tuple, GemmConfig]:
    """The autotuner's choices so far, keyed by ("tuned", form, dtype, static sizes, layout)."""
    return cache_entries("tuned")


def routing_robust_launches(
    launch: Callable[..., object], T: int, E: int, offsets: torch.Tensor
) -> tuple[Launch, ...]:
    """``launch(cfg)`` on this call's routing and ``launch(cfg, offsets=o)`` on a fixed random
    skewed routing ``o`` of the same size: the key leaves the routing out, so a candidate that
    happens to suit the first call's routing must not be kept if it is slow on others."""
    other = random_skewed_offsets(T, E, offsets)
    return (launch, lambda cfg: launch(cfg, offsets=other))


def _ends_from_shares(share: torch.Tensor, T: int, like: torch.Tensor) -> torch.Tensor:
    """Cumulative end offsets (``like``'s dtype and device) of T rows split by ``share``."""
    ends = torch.floor(torch.cumsum(share, 0) / share.sum() * T)
    ends[-1:].fill_(T)  # a fill kernel: `ends[-1] = T` would copy a host scalar (a sync)
    return ends.to(like.dtype)


def skewed_offsets(T: int, E: int, like: torch.Tensor) -> torch.Tensor:
    """Cumulative ends of a Zipf-like routing of T rows over E experts (expert e gets a share
    proportional to 1 / (e + 1)), built on the device: no host-to-device copy while tuning."""
    share = 1.0 / torch.arange(1, E + 1, dtype=torch.float64, device=like.device)
    return _ends_from_shares(share, T, like)


def random_skewed_offsets(T: int, E: int, like: torch.Tensor) -> torch.Tensor:
    """Cumulative ends of a random skewed routing of T rows over E experts, the same for every
    call with these sizes: shares -log(u) * v^(1/0.6) for uniform u, v (close to gamma(0.6)
    draws, a common model of MoE routing skew) from a generator of its own, so the caller's
    random state is untouched. Large and small experts come in random order."""
    g = torch.Generator(device=like.device)
    g.manual_seed(E)
    u = torch.rand(2, E, generator=g, device=like.device, dtype=torch.float64)
    share = -torch.log1p(-u[0]) * u[1] ** (1 / 0.6)
    return _ends_from_shares(share, T, like)


def fp8_ragged_m_config(block: int | None) -> GemmConfig:
    """The FP8 ragged-M launch. Blockwise (``block`` the scale block): K tiles of the block, so
    each tile is promoted once; 128×128 output tiles and 8 warps, the best of a first sweep on
    an H200 (experiments/fp8_gemm_probe.py). Rowwise (``block`` None): the K loop of the
    unscaled GEMM, in the probe's unscaled kernel's shape (128×128×128 tiles, 8 warps, four
    stages, the flattened persistent loop); not yet tuned on a GPU."""
    if block is None:
        return FP8_ROWWISE_RAGGED_M
    return GemmConfig(block_m=128, block_n=block, block_k=block, num_warps=8, num_stages=3)
