"""The benchmarks' routing draws and the grouped-GEMM benchmark's averaging over draws (CPU, no
timing)."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import benchmark_grouped_gemm as bench_gg
import common


def test_skewed_routing_is_fixed_per_draw_and_leaves_the_caller_rng_alone():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = common.skewed_routing(65536, 128, 1)
    assert torch.equal(torch.random.get_rng_state(), before)
    torch.rand(5)  # other draws in between must not change a draw's routing
    assert torch.equal(common.skewed_routing(65536, 128, 1), a)
    assert not torch.equal(common.skewed_routing(65536, 128, 2), a)
    assert int(a.sum()) == 65536 and int((a == 0).sum()) >= 1


def test_draw_zero_is_the_routing_of_the_first_skewed_shape_before_draws():
    # The TE seed's skewed routing: seed 0 for the global RNG and for the generator.
    torch.manual_seed(0)
    old = common.routing_counts(66560, 20, True, torch.Generator().manual_seed(0))
    assert torch.equal(common.skewed_routing(66560, 20, 0), old)


def _row(shape, routing, pname, draw, moekit, torch_tf):
    row = {k: 1.0 for k in bench_gg._AVERAGED}
    row.update(shape=shape, routing=routing, draw=draw, moekit_tflops=moekit,
               torch_tflops=torch_tf, ratio_vs_torch=moekit / torch_tf,
               ratio_per_round=[moekit / torch_tf])  # fmt: skip
    row["pass"] = pname
    return row


def test_aggregate_draws_geometric_mean_ratio_and_range():
    rows = [
        _row("te_seed", "uniform", "fc1_fwd", None, 700.0, 700.0),
        _row("qwen3", "skewed", "fc1_fwd", 0, 600.0, 500.0),
        _row("qwen3", "skewed", "fc1_fwd", 1, 500.0, 500.0),
        _row("qwen3", "skewed", "fc2_fwd", 0, 450.0, 500.0),
        _row("qwen3", "skewed", "fc2_fwd", 1, 550.0, 500.0),
    ]
    cells = bench_gg.aggregate_draws(rows)
    assert [(c["shape"], c["pass"]) for c in cells] == [
        ("te_seed", "fc1_fwd"), ("qwen3", "fc1_fwd"), ("qwen3", "fc2_fwd"),
    ]  # fmt: skip
    assert cells[0]["ratio_vs_torch"] == 1.0 and cells[0]["draw"] is None
    fc1 = cells[1]
    assert fc1["ratio_vs_torch"] == pytest.approx(math.sqrt(1.2 * 1.0))
    assert fc1["moekit_tflops"] == pytest.approx(550.0)
    assert fc1["ratio_per_draw"] == pytest.approx([1.2, 1.0])
    assert bench_gg._spread(fc1) == "1.00-1.20"
    # ratios 0.9 and 1.1 average 1.0 arithmetically but 0.995 geometrically: below parity
    assert cells[2]["ratio_vs_torch"] == pytest.approx(math.sqrt(0.9 * 1.1))
    assert cells[2]["ratio_vs_torch"] < 1.0
    summary = "\n".join(bench_gg.target_summary(cells))
    assert "ratio < 1.0: 1 of 3" in summary and "qwen3/skew/fc2_fwd=0.99" in summary
