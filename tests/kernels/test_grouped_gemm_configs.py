"""Every grouped-GEMM tile config the autotuner may pick computes the same result.

The autotuner times candidate configs and keeps the fastest, so a config that is wrong in some
corner (the pointer-store epilogue, warp specialisation, a transposed weight) would only show up
on the shapes where it wins. GPU: every real candidate, with counts around the tile edges;
CPU (interpreter): the dynamic ragged-K schedule's counter reset.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton

from moekit.kernels import grouped_gemm as K
from moekit.reference.grouped_gemm import grouped_mm_ragged_k_ref, grouped_mm_ragged_m_ref
from moekit.tuning import grouped_gemm as tuning


def _offsets(counts, device):
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def _check(cfg, counts, K_, N, dtype, device, *, k_major, bias, tail_rows=3):
    E = len(counts)
    T = sum(counts) + tail_rows  # rows past offsets[-1] must come out zero
    offsets = _offsets(counts, device)
    a = torch.randn(T, K_, dtype=dtype, device=device)
    if k_major:  # an nn.Linear-style [E, N, K] weight viewed as [E, K, N]
        b = (torch.randn(E, N, K_, dtype=dtype, device=device) / K_**0.5).transpose(1, 2)
    else:
        b = torch.randn(E, K_, N, dtype=dtype, device=device) / K_**0.5
    bias_t = torch.randn(E, N, dtype=dtype, device=device) if bias else None
    out = torch.full((T, N), float("nan"), dtype=dtype, device=device)
    K.grouped_mm_ragged_m(a, b, offsets, out, bias_t, config=cfg)
    ref = grouped_mm_ragged_m_ref(a.float(), b.float(), offsets, torch.float32)
    if bias:
        rows = torch.repeat_interleave(
            torch.arange(E, device=device), offsets.diff(prepend=offsets[:1] * 0).long()
        )
        ref[: sum(counts)] += bias_t.float()[rows]
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    assert not torch.isnan(out).any(), f"{cfg}: rows left unwritten"
    err = (out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12)
    assert err < tol, f"{cfg}: relative error {err:.2e}"
    assert torch.all(out[sum(counts) :] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("k_major", [False, True])
def test_gpu_every_ragged_m_candidate(k_major):
    counts = [0, 1, 63, 64, 65, 127, 128, 129, 200, 777, 0, 3000]
    # ragged_m_candidates sets a_bounded (small experts) and GROUP_M 16 (large K and N) on
    # every candidate; the 3000-row expert has 24 m-tiles, so bands of 16 differ from 8.
    variants = [(False, 8), (True, 8), (False, 16) if k_major else (True, 16)]
    for base in tuning.RAGGED_M_CANDIDATES:
        for bounded, group_m in variants:
            cfg = dataclasses.replace(base, a_bounded=bounded, group_m=group_m)
            _check(cfg, counts, 1024, 768, torch.bfloat16, "cuda", k_major=k_major, bias=k_major)


def _check_ragged_k(cfg, counts, M, N, dtype, device, *, accumulate, calls=2):
    """Two calls back to back (a dynamically scheduled launch must leave its counter zeroed
    for the next one), both against the reference."""
    E = len(counts)
    T = sum(counts) + 5  # columns past offsets[-1] belong to no expert
    offsets = _offsets(counts, device)
    for _ in range(calls):
        dy = torch.randn(T, M, dtype=dtype, device=device)
        x = torch.randn(T, N, dtype=dtype, device=device)
        ref = grouped_mm_ragged_k_ref(dy.t().float(), x.float(), offsets, torch.float32)
        if accumulate:
            out = torch.randn(E, M, N, dtype=torch.float32, device=device)
            ref = ref + out
        else:
            out = torch.full((E, M, N), float("nan"), dtype=dtype, device=device)
        K.grouped_mm_ragged_k(dy.t(), x, offsets, out, accumulate, config=cfg)
        tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
        err = (out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12)
        assert err < tol, f"{cfg}: relative error {err:.2e}"
        empty = [e for e, c in enumerate(counts) if c == 0]
        if not accumulate:
            assert torch.all(out[empty] == 0), f"{cfg}: empty expert not zero"


@pytest.mark.gpu
@pytest.mark.parametrize("accumulate", [False, True])
def test_gpu_every_ragged_k_candidate(accumulate):
    counts = [0, 1, 63, 64, 65, 127, 2000, 129, 0, 700]
    for cfg in tuning.RAGGED_K_CANDIDATES:
        try:
            _check_ragged_k(cfg, counts, 400, 520, torch.bfloat16, "cuda", accumulate=accumulate)
        except triton.runtime.errors.OutOfResources:
            # Some fp32 128 x 256 C tiles exceed shared memory (the autotuner skips them the
            # same way); the sub-tiled 3-stage ones exist to fit and must not.
            fits = cfg.epilogue_subtile and cfg.num_stages == 3
            assert accumulate and cfg.block_n == 256 and not fits, f"{cfg} does not fit"


@pytest.mark.gpu
def test_gpu_dynamic_ragged_k_in_cuda_graph():
    """A dynamically scheduled launch captured in a graph: every replay starts from a zeroed
    counter and gives the right result for new data."""
    cfg = next(c for c in tuning.RAGGED_K_CANDIDATES if c.dynamic)
    counts = [0, 300, 5, 1200, 64]
    offsets = _offsets(counts, "cuda")
    T = sum(counts)
    dy = torch.randn(T, 256, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(T, 384, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(len(counts), 256, 384, dtype=torch.bfloat16, device="cuda")
    K.grouped_mm_ragged_k(dy.t(), x, offsets, out, False, config=cfg)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        K.grouped_mm_ragged_k(dy.t(), x, offsets, out, False, config=cfg)
    for _ in range(3):
        dy.copy_(torch.randn_like(dy))
        x.copy_(torch.randn_like(x))
        graph.replay()
        ref = grouped_mm_ragged_k_ref(dy.t().float(), x.float(), offsets, torch.float32)
        err = (out.double() - ref.double()).norm() / ref.double().norm()
        assert err < 2e-2


_TE_SEED_SKEWED = [25, 658, 3790, 9655, 0, 2170, 2136, 4922, 1911, 752,
                   475, 2445, 303, 8224, 593, 941, 1, 2300, 398, 24861]  # fmt: skip


@pytest.mark.gpu
def test_gpu_flattened_dynamic_ragged_k_schedules():
    """The routing-chosen ragged-K schedule at the TE-seed wgrad size: eagerly, the uniform
    routing takes the static deal and the skewed one the dynamic schedule (a counter started
    past the last tile shows which); captured once in a CUDA graph, replays with either
    routing switch schedules and stay right."""
    from moekit.runtime.device import tile_counter

    cfg = tuning.RAGGED_K_DEFAULT_16
    assert cfg.flatten and cfg.dynamic
    T, E = sum(_TE_SEED_SKEWED), len(_TE_SEED_SKEWED)
    uniform = [T // E] * E
    dy = torch.randn(T, 1024, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(T, 2048, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(E, 1024, 2048, dtype=torch.bfloat16, device="cuda")
    for counts, schedule in ((uniform, "static"), (_TE_SEED_SKEWED, "dynamic")):
        counter = tile_counter(dy.device)
        counter[0] = 1 << 30  # past every tile: a dynamic run computes none
        out.fill_(float("nan"))
        K.grouped_mm_ragged_k(dy.t(), x, _offsets(counts, "cuda"), out, False, config=cfg)
        taken = "dynamic" if int(counter[0]) == 0 else "static"
        counter.zero_()
        assert taken == schedule
        assert bool(torch.isnan(out).any()) == (schedule == "dynamic")

    offsets = _offsets(uniform, "cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        K.grouped_mm_ragged_k(dy.t(), x, offsets, out, False, config=cfg)
    for counts in (_TE_SEED_SKEWED, uniform, _TE_SEED_SKEWED):
        offsets.copy_(_offsets(counts, "cuda"))
        dy.copy_(torch.randn_like(dy))
        graph.replay()
        ref = grouped_mm_ragged_k_ref(dy.t().float(), x.float(), offsets, torch.float32)
        err = (out.double() - ref.double()).norm() / ref.double().norm()
        assert err < 2e-2


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_ragged_k_default_by_output_dtype(out_dtype):
    """The untuned ragged-K config (no autotuning, CUDA-graph capture) depends on the output:
    the routing-chosen schedule for 16-bit outputs, the dynamic one for fp32 (whose flattened
    static loop is slow); the candidates are the same set either way."""
    cands = tuning.ragged_k_candidates(torch.bfloat16, out_dtype)
    assert set(cands) == set(tuning.RAGGED_K_CANDIDATES)
    assert len(cands) == len(set(cands))
    assert cands[0].dynamic and cands[0].flatten == (out_dtype != torch.float32)
    assert tuning.ragged_k_candidates(torch.float32, out_dtype) == tuning.FP32_CANDIDATES


@pytest.mark.parametrize(
    "T, E, K_, N, fine, bounded, wide",
    [
        (65536, 128, 2048, 1536, True, True, False),  # Qwen3 fc1: 512 rows per expert
        (32768, 64, 1024, 2048, True, True, False),  # OLMoE fc2
        (32768, 32, 2048, 7168, True, False, False),  # DeepSeek-V3 EP8 fc2: 1024 rows/expert
        (32768, 32, 7168, 4096, False, False, True),  # DeepSeek-V3 EP8 fc1: K too long
        (32768, 128, 2880, 5760, False, True, True),  # gpt-oss fc1: 256 rows/expert, long K
        (66560, 20, 512, 2048, False, False, False),  # TE seed fc2: 3328 rows/expert, short K
        (66560, 20, 2048, 1024, False, False, False),  # TE seed fc1: narrow N
        (16384, 8, 4096, 28672, False, False, True),  # Mixtral
    ],
)
def test_ragged_m_default_by_shape(T, E, K_, N, fine, bounded, wide):
    """The 4-stage sub-tiled config leads the ragged-M candidates (the default without tuning
    or under CUDA-graph capture, the tuner's prior otherwise) only for small experts and a
    short K; with at most 512 rows per expert on average every candidate loads A bounded at
    the expert's end; outside the fine-grained case, with K and N >= 2048, every candidate
    swizzles over bands of 16 m-tiles. The candidates are otherwise the same."""
    cands = tuning.ragged_m_candidates(torch.bfloat16, T, E, K_, N)
    lead = dataclasses.replace(tuning.RAGGED_M_FINE_GRAINED, a_bounded=bounded)
    assert (cands[0] == lead) == fine
    assert all(c.a_bounded == bounded for c in cands)
    assert all(c.group_m == (16 if wide else 8) for c in cands)
    base = {dataclasses.replace(c, a_bounded=False, group_m=8) for c in cands}
    assert base == set(tuning.RAGGED_M_CANDIDATES)
    assert len(cands) == len(tuning.RAGGED_M_CANDIDATES)
    assert tuning.ragged_m_candidates(torch.float32, T, E, K_, N) == tuning.FP32_CANDIDATES


@pytest.mark.parametrize(
    "T, E, N, small",
    [
        (2, 8, 8192, True),  # Mixtral decode step, top-2
        (128, 64, 2048, True),  # OLMoE decode, 16 tokens: 2 rows per expert
        (1024, 64, 2048, True),  # 16 rows per expert
        (1040, 64, 2048, False),  # just over, and enough tiles
        (512, 8, 2048, True),  # short prefill: 64 rows per expert, but only 96 default tiles
        (4096, 8, 2048, False),  # 320 default tiles
        (8192, 256, 1024, False),  # 32 rows per expert, 1280 default tiles
    ],
)
def test_ragged_m_small_problems_lead_with_narrow_tiles(T, E, N, small):
    """Few rows per expert, or too few default tiles for the SMs: the narrow deep-K config
    leads (a decode step is weight-bandwidth bound); the candidate set stays the same."""
    cands = tuning.ragged_m_candidates(torch.bfloat16, T, E, 1024, N, 132)
    assert (dataclasses.replace(cands[0], a_bounded=False) == tuning.RAGGED_M_SMALL) == small
    base = {dataclasses.replace(c, a_bounded=False, group_m=8) for c in cands}
    assert base == set(tuning.RAGGED_M_CANDIDATES)


@pytest.mark.parametrize(
    "T, E, N, num_sms, decode",
    [
        (2, 8, 4096, 132, True),  # Mixtral decode dgrad / fc2: 2 x 32 narrow tiles
        (2, 8, 8192, 132, False),  # Mixtral decode fc1: 128 narrow tiles
        (8, 128, 1536, 132, False),  # Qwen3 decode: 96 narrow tiles
        (1, 8, 4096, 132, True),  # a single row
        (2, 8, 4096, 100, False),  # 64 tiles cover half of 100 SMs
    ],
)
def test_ragged_m_decode_config_where_narrow_tiles_leave_most_sms_idle(T, E, N, num_sms, decode):
    """Where even the narrow tiles would cover under half the SMs, the half-width decode config
    leads (more SMs streaming the weights); the candidate set stays the same."""
    cands = tuning.ragged_m_candidates(torch.bfloat16, T, E, 8192, N, num_sms)
    assert (dataclasses.replace(cands[0], a_bounded=False) == tuning.RAGGED_M_DECODE) == decode
    base = {dataclasses.replace(c, a_bounded=False, group_m=8) for c in cands}
    assert base == set(tuning.RAGGED_M_CANDIDATES)


def test_dynamic_schedule_counter_resets(monkeypatch):
    """Interpreter/CPU: the last program of a dynamically scheduled launch re-zeroes the shared
    counter, so consecutive launches reusing one counter (as launches on one CUDA stream do)
    each see every tile exactly once."""
    from moekit.config import interpret_mode

    if not interpret_mode():
        pytest.skip("runs the kernel in Triton's interpreter (TRITON_INTERPRET=1)")
    counter = torch.zeros(2, dtype=torch.int32)
    monkeypatch.setattr(K, "tile_counter", lambda device: counter)
    cfg = dataclasses.replace(tuning.INTERPRET_CONFIG, dynamic=True)
    for accumulate in (False, True, False):
        _check_ragged_k(cfg, [0, 40, 3, 70], 32, 64, torch.float16, "cpu", accumulate=accumulate,
                        calls=1)  # fmt: skip
        assert counter.tolist() == [0, 0]


@pytest.mark.parametrize(
    "counts, M",
    [
        # empty experts first, in the middle and last: they rank last and are zero-filled
        # after the flattened loop instead of taking a K step
        ([0, 40, 0, 3, 70, 0], 64),
        ([90, 0, 0, 0], 64),  # every row to one expert
        ([1], 32),  # a single row, E = 1
        ([33, 31, 65, 2, 0, 17, 50], 32),  # M = one tile: program p starts at rank p
        ([20, 0, 45, 7], 48),  # M not a multiple of the tile: partial C tiles
        ([0, 0, 0], 64),  # no rows at all: only zero tiles
    ],
)
def test_flattened_ragged_k_loop(counts, M):
    """Interpreter/CPU: the hand-fused ragged-K loop (``flatten=True``) counts each program's K
    steps in-kernel; a miscount would drop or repeat tiles, so check it against the
    reference on routings with empty experts, one expert with everything, and programs
    whose first tile is not of the largest expert."""
    from moekit.config import interpret_mode

    if not interpret_mode():
        pytest.skip("runs the kernel in Triton's interpreter (TRITON_INTERPRET=1)")
    cfg = dataclasses.replace(tuning.INTERPRET_CONFIG, flatten=True)
    for accumulate in (False, True):
        _check_ragged_k(cfg, counts, M, 64, torch.float16, "cpu", accumulate=accumulate,
                        calls=1)  # fmt: skip


@pytest.mark.parametrize(
    "counts, static",
    [
        # 12 tiles of 3 K steps over 4 programs: the round-robin deal is exact
        ([64, 64, 64, 64], True),
        # 3 long tiles, then 15 short ones: round-robin gives program 0 a long tile and
        # four short ones (17 steps) where the greedy schedule ends after 15
        ([256, 32, 32, 32, 32, 32], False),
        # mildly uneven: program 0 takes 18 steps against the greedy 17, within 6%
        ([96, 96, 96, 96, 64, 64], True),
    ],
)
def test_flattened_dynamic_ragged_k_picks_its_schedule(counts, static, monkeypatch):
    """Interpreter/CPU: with ``flatten`` and ``dynamic`` both set, the kernel runs the
    flattened static deal when the routing balances it and the dynamic schedule otherwise.
    The tile counter starts past the last tile, so a dynamic run computes no tile (leaving
    NaN) and re-zeroes the counter, while a static run never touches it."""
    from moekit.config import interpret_mode

    if not interpret_mode():
        pytest.skip("runs the kernel in Triton's interpreter (TRITON_INTERPRET=1)")
    counter = torch.tensor([10**6, 0], dtype=torch.int32)
    monkeypatch.setattr(K, "tile_counter", lambda device: counter)
    cfg = dataclasses.replace(tuning.INTERPRET_CONFIG, flatten=True, dynamic=True)
    E, M, N = len(counts), 96, 32  # 3 tiles per expert at the interpreter's 32 x 32 tile
    offsets = _offsets(counts, "cpu")
    dy = torch.randn(sum(counts), M, dtype=torch.float16)
    x = torch.randn(sum(counts), N, dtype=torch.float16)
    out = torch.full((E, M, N), float("nan"), dtype=torch.float16)
    K.grouped_mm_ragged_k(dy.t(), x, offsets, out, False, config=cfg)
    if static:
        assert counter.tolist() == [10**6, 0]
        ref = grouped_mm_ragged_k_ref(dy.t().float(), x.float(), offsets, torch.float32)
        torch.testing.assert_close(out.float(), ref, rtol=2e-3, atol=2e-3)
    else:
        assert counter.tolist() == [0, 0]
        assert torch.isnan(out).all()


@pytest.mark.parametrize("slack_pct", [0, 10**6, tuning.GemmConfig(1, 1, 1).static_slack_pct])
@pytest.mark.parametrize(
    "counts", [[0, 40, 0, 3, 70, 0], [90, 0, 0, 0], [33, 31, 65, 2, 0, 17, 50], [0, 0, 0]]
)
def test_flattened_dynamic_ragged_k_either_schedule(counts, slack_pct, monkeypatch):
    """Interpreter/CPU: both schedules of the ``flatten`` + ``dynamic`` kernel (forced by the
    slack: 0 always takes the dynamic one, 10**6 the static one) against the reference, on
    routings with empty experts, one expert with everything and experts ending within the
    first tile; the counter is left zeroed for the next launch."""
    from moekit.config import interpret_mode

    if not interpret_mode():
        pytest.skip("runs the kernel in Triton's interpreter (TRITON_INTERPRET=1)")
    counter = torch.zeros(2, dtype=torch.int32)
    monkeypatch.setattr(K, "tile_counter", lambda device: counter)
    cfg = dataclasses.replace(
        tuning.INTERPRET_CONFIG, flatten=True, dynamic=True, static_slack_pct=slack_pct
    )
    for accumulate in (False, True):
        _check_ragged_k(cfg, counts, 48, 64, torch.float16, "cpu", accumulate=accumulate,
                        calls=1)  # fmt: skip
        assert counter.tolist() == [0, 0]


@pytest.mark.parametrize("E", [1, 2, 8, 20, 128, 129])
def test_random_skewed_routing(E):
    """The ragged-M autotuner's second routing: ends at T, non-decreasing, skewed (the
    largest expert well above the mean), the same on every call, and drawn without touching
    the caller's random state."""
    T = 10_000
    like = torch.zeros(1, dtype=torch.int32)
    state = torch.get_rng_state()
    ends = tuning.random_skewed_offsets(T, E, like)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(ends, tuning.random_skewed_offsets(T, E, like))
    assert ends.dtype == torch.int32 and ends.shape == (E,) and int(ends[-1]) == T
    counts = ends.diff(prepend=ends[:1] * 0)
    assert torch.all(counts >= 0)
    if E >= 20:
        assert int(counts.max()) > 2.5 * T / E


def test_routing_robust_tuning_times_both_routings():
    """The tuner's launches: the candidate on the call's routing, and on a fixed other one
    (built once)."""
    seen = []
    offsets = torch.tensor([3, 3, 10], dtype=torch.int32)
    own, other = tuning.routing_robust_launches(
        lambda cfg, offsets=offsets: seen.append((cfg, offsets)), 10, 3, offsets
    )
    own("cfg")
    other("cfg")
    other("cfg2")
    assert [c for c, _ in seen] == ["cfg", "cfg", "cfg2"]
    assert seen[0][1] is offsets
    assert seen[1][1] is seen[2][1]  # built once
    assert torch.equal(seen[1][1], tuning.random_skewed_offsets(10, 3, offsets))


@pytest.mark.parametrize(
    ("speedups", "expect"),
    [
        ((1.0, 1.0), "default"),  # ties keep the default
        ((1.10, 1.10), "other"),  # > 5% faster on both routings
        ((1.20, 1.03), "default"),  # faster in total, but not by 5% on the second routing
        ((1.03, 1.20), "default"),
        ((0.8, 0.8), "default"),
    ],
)
def test_tuner_keeps_the_default_unless_clearly_faster(monkeypatch, tmp_path, speedups, expect):
    """``choose_config`` with one launch per routing: a candidate replaces the default only if
    it is faster by more than ``keep_default_within`` on every routing (timings faked)."""
    default = tuning.GemmConfig(128, 256, 64, flatten=True, expert_groups=True)
    other = tuning.GemmConfig(128, 256, 64)
    times = {(default, 0): 1.0, (default, 1): 2.0}
    times[(other, 0)], times[(other, 1)] = 1.0 / speedups[0], 2.0 / speedups[1]

    def timed(routing):
        return lambda cfg: ("timed", cfg, routing)

    def fake_bench(fn, **_):
        _, cfg, routing = fn()
        return times[(cfg, routing)]

    monkeypatch.setattr(tuning, "interpret_mode", lambda: False)
    monkeypatch.setattr(tuning, "autotune_enabled", lambda: True)
    monkeypatch.setattr(tuning, "is_capturing", lambda: False)
    monkeypatch.setattr(tuning.triton.testing, "do_bench", fake_bench)
    monkeypatch.setattr(tuning.store, "fingerprint", lambda device: {"gpu": "test"})
    monkeypatch.setenv("MOEKIT_CACHE_DIR", str(tmp_path))
    got = tuning.choose_config(
        "m", ("test", speedups), torch.bfloat16, torch.device("cuda"), (default, other),
        lambda: (timed(0), timed(1)), keep_default_within=0.05,
    )  # fmt: skip
    assert got == (default if expect == "default" else other)


@pytest.mark.parametrize(
    "group_m, a_bounded", [(1, False), (2, True), (8, False), (8, True), (16, False)]
)
def test_expert_grouped_ragged_m_schedule(group_m, a_bounded):
    """Interpreter/CPU: with ``expert_groups`` the ragged-M schedule locates each tile's expert
    from a per-expert tile cumsum and swizzles within the expert; a miscount would drop or
    repeat tiles. Experts with no rows, one row, several m-tiles (block 32 here) and bands of
    GROUP_M m-tiles cut short at an expert's end. ``a_bounded``: A rows past each expert's end
    load as zeros (a wrong bound would zero rows the expert owns)."""
    from moekit.config import interpret_mode

    if not interpret_mode():
        pytest.skip("runs the kernel in Triton's interpreter (TRITON_INTERPRET=1)")
    cfg = dataclasses.replace(
        tuning.INTERPRET_CONFIG, expert_groups=True, group_m=group_m, a_bounded=a_bounded
    )
    counts = [40, 0, 1, 70, 33, 0, 130, 5, 64]
    if group_m > 8:  # an expert of 19 m-tiles: one full band of 16 and one cut short
        counts[3] = 600
    _check(cfg, counts, 48, 72, torch.float16, "cpu", k_major=True, bias=False)
    _check(cfg, counts, 48, 72, torch.float16, "cpu", k_major=False, bias=True)


@pytest.mark.parametrize("kind", ["m", "m a_bounded", "k", "k dynamic", "k flat"])
def test_experts_ending_within_the_first_tile(kind, monkeypatch):
    """Interpreter/CPU: experts that end before row BLOCK (32 here) cannot be bounded by the
    row-bounded descriptors and take the pointer paths (ragged M: a loop after the main one;
    ragged K: one masked step, after the flattened loop in its flattened form)."""
    from moekit.config import interpret_mode

    if not interpret_mode():
        pytest.skip("runs the kernel in Triton's interpreter (TRITON_INTERPRET=1)")
    counts = [3, 0, 9, 19, 1, 40, 0, 70]  # ends 3, 3, 12, 31, 32, 72, 72, 142
    if kind.startswith("m"):
        cfg = dataclasses.replace(tuning.INTERPRET_CONFIG, a_bounded=kind == "m a_bounded")
        _check(cfg, counts, 48, 40, torch.float16, "cpu", k_major=True, bias=True)
        return
    cfg = dataclasses.replace(
        tuning.INTERPRET_CONFIG, dynamic=kind == "k dynamic", flatten=kind == "k flat"
    )
    counter = torch.zeros(2, dtype=torch.int32)
    monkeypatch.setattr(K, "tile_counter", lambda device: counter)
    for accumulate in (False, True):
        _check_ragged_k(cfg, counts, 48, 40, torch.float16, "cpu", accumulate=accumulate,
                        calls=1)  # fmt: skip


@pytest.mark.gpu
def test_gpu_flattened_ragged_k_te_seed_routing():
    """The benchmark's skewed TE-seed routing (one idle expert, one with 37% of the rows, a
    first expert of 25 rows) at full size, where a descriptor base outside the tensor once
    faulted (see tests/kernels/test_tma_bounds.py)."""
    counts = _TE_SEED_SKEWED
    offsets = _offsets(counts, "cuda")
    T = sum(counts)
    dy = torch.randn(T, 1024, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(T, 2048, dtype=torch.bfloat16, device="cuda")
    ref = grouped_mm_ragged_k_ref(dy.t().float(), x.float(), offsets, torch.float32)
    for cfg in [c for c in tuning.RAGGED_K_CANDIDATES if c.flatten]:
        out = torch.full((len(counts), 1024, 2048), float("nan"), dtype=torch.bfloat16,
                         device="cuda")  # fmt: skip
        K.grouped_mm_ragged_k(dy.t(), x, offsets, out, False, config=cfg)
        err = (out.double() - ref.double()).norm() / ref.double().norm()
        assert err < 2e-2, f"{cfg}: relative error {err:.2e}"
        assert torch.all(out[4] == 0)
