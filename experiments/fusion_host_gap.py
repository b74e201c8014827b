"""Where benchmark_fusion's host-time gap (Sequential − the fused op called directly) comes
from on a GPU host: the gap per phase (forward without grad, forward with grad, forward +
backward), the adjacent-pair gaps by position in their batch and by which call went first,
and a cProfile of each contender's forward + backward.

    PYTHONPATH=. python experiments/fusion_host_gap.py
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import benchmark_fusion as bf
from common import host_us_per_call, paired_host_gaps_us, sleep_cycles_per_ms


def nograd(fn):
    def run():
        with torch.no_grad():
            fn()

    return run


def main() -> None:
    dev = torch.device("cuda")
    cycles = sleep_cycles_per_ms()
    cases = [
        ("add_rmsnorm T=256 H=4096", bf.norm_case(256, 4096, dev)),
        ("mlp R=1024 E=8 H=1024 F=1024", bf.mlp_case(1024, 8, 1024, 1024, dev)),
        ("linear+add_rmsnorm T=256 H=4096", bf.linear_norm_case(256, 4096, dev)),
    ]
    for name, (_seq, (d, dl), (s, sl)) in cases:
        grads = bf.output_grads(d)
        phases = {
            "fwd no grad": (nograd(s), nograd(d)),
            "fwd grad": (s, d),
            "fwd+bwd": (bf.training_step(s, grads, sl), bf.training_step(d, grads, dl)),
        }
        print(f"== {name}")
        for phase, (fs, fd) in phases.items():
            gaps = []
            for i in range(6):
                order = ((fs, "s"), (fd, "d")) if i % 2 == 0 else ((fd, "d"), (fs, "s"))
                us = {}
                for fn, who in order:
                    us[who] = host_us_per_call(fn, 200, cycles, per_batch=8)[0]
                gaps.append(us["s"] - us["d"])
            print(
                f"  {phase:12s} batches: direct {us['d']:7.1f} µs, gap median "
                f"{statistics.median(gaps):+6.1f} (rounds {', '.join(f'{g:+.0f}' for g in gaps)})"
            )
        fs, fd = phases["fwd+bwd"]
        wall, cpu = paired_host_gaps_us(fs, fd, 400, cycles, per_batch=4)
        for clock, p in (("wall", wall), ("cpu", cpu)):
            by_pos = {}
            for j, g in enumerate(p.gaps_us):
                by_pos.setdefault((j % 4, "s first" if j % 2 == 0 else "d first"), []).append(g)
            text = ", ".join(
                f"{k[0]}/{k[1]}: {statistics.median(v):+.0f}" for k, v in sorted(by_pos.items())
            )
            q = statistics.quantiles(p.gaps_us, n=4)
            print(
                f"  pairs {clock}: gap {p.gap_us:+.1f} (q {q[0]:+.0f} {q[2]:+.0f}), "
                f"direct {p.b_us:.0f}; by position/order {text}"
            )
        for who, fn in (("sequential", fs), ("direct", fd)):
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            prof = cProfile.Profile(time.process_time)
            prof.enable()
            for _ in range(300):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            out = io.StringIO()
            st = pstats.Stats(prof, stream=out)
            print(f"  cProfile {who}: {st.total_tt / 300 * 1e6:.0f} µs per call (profiled)")
            st.sort_stats("tottime").print_stats(12)
            for line in out.getvalue().splitlines():
                if line.strip() and ("/" in line or "{" in line) and "ncalls" not in line:
                    print("    " + line.strip()[:150])


if __name__ == "__main__":
    main()
