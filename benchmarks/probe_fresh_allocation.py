"""Bandwidth of a permute scatter right after a large cudaMalloc, call by call (H100 finding).

    python benchmarks/probe_fresh_allocation.py   # CUDA only, ~10 s

Prints GB/s per call of ``scatter_rows`` (T=65536, H=7168, k=8, E=64: a 7.5 GB output) into a
buffer allocated just after ``torch.cuda.empty_cache()`` (a fresh cudaMalloc), after zeroing it,
after a 1 s wait, and for ``zero_`` alone. On the lent H100 the first ~15 ms after such an
allocation ran ~13% slower (2360 vs 2730 GB/s), which is why benchmarks/benchmark_permute.py
settles each configuration's memory before timing (see docs/permute.md, "Results").
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from moekit.kernels import permute as kernels
from moekit.ops.permute import permute

T, K, H, E = 65536, 8, 7168, 64
CALLS = 16


def per_call_gbs(fn, nbytes: int) -> str:
    events = [torch.cuda.Event(enable_timing=True) for _ in range(CALLS + 1)]
    events[0].record()
    for i in range(CALLS):
        fn()
        events[i + 1].record()
    torch.cuda.synchronize()
    return " ".join(
        f"{nbytes / (events[i].elapsed_time(events[i + 1]) * 1e-3) / 1e9:.0f}" for i in range(CALLS)
    )


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    torch.manual_seed(0)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    idx = torch.rand(T, E, device="cuda").topk(K, dim=1).indices
    d = permute(x, idx, num_experts=E)
    row_index, offsets, tpe, R = d.row_index, d.offsets, d.tokens_per_expert, d.num_rows
    del d
    nbytes = (T + R) * H * x.element_size()

    def scatter(out):
        return lambda: kernels.scatter_rows(
            x, row_index, R, offsets, tpe, pad_programs=False, pad_rows=0, tail_lo=R, out=out
        )

    print(f"scatter T={T} H={H} k={K} E={E}, GB/s per call (read T·H + write R·H):")
    for case in ("fresh", "fresh, zero_ first", "fresh, 1 s wait", "reused from the cache"):
        if case != "reused from the cache":
            torch.cuda.empty_cache()
        out = torch.empty(R, H, dtype=x.dtype, device="cuda")
        if "zero_" in case:
            out.zero_()
        if "wait" in case:
            torch.cuda.synchronize()
            time.sleep(1.0)
        print(f"  {case:22s} {per_call_gbs(scatter(out), nbytes)}", flush=True)
        del out
    torch.cuda.empty_cache()
    out = torch.empty(R, H, dtype=x.dtype, device="cuda")
    print(f"  {'zero_ of a fresh one':22s} {per_call_gbs(out.zero_, out.numel() * 2)}")


if __name__ == "__main__":
    main()
