"""The permute benchmark's GPU-time bookkeeping, on CPU (the benchmark itself runs on a GPU by
hand; tests/benchmarks/test_benchmark_smoke.py runs its --smoke mode)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import benchmark_permute as bench


def test_gpu_time_split_by_flush_marker():
    # GPU time per call = the device activities between two flush markers, the markers' own
    # durations excluded; events arrive unordered and activity before the first marker is dropped.
    m = bench.FLUSH_MARKER
    events = [
        ("warm_kernel", 0.0, 5.0),
        (f"{m}_0d1d", 10.0, 110.0),
        ("_routing_hist_kernel", 111.0, 113.0),
        ("Memset (Device)", 113.0, 113.5),
        (f"{m}_0d1d", 200.0, 300.0),
        ("_scatter_rows_kernel", 300.0, 340.0),
        ("_routing_rows_kernel", 120.0, 127.5),  # out of order: belongs to the first call
    ]
    assert bench.per_call_us(events) == [2.0 + 0.5 + 7.5, 40.0]
