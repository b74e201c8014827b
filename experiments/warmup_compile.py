# ruff: noqa: E501
"""Cold first step of a new MoE block: compile time per kernel, with and without compiling a
body's kernels ahead in threads (moekit.runtime.replay.compile_ahead).

    PYTHONPATH=. python experiments/warmup_compile.py [serial] [ahead]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

CHILD = r"""
import sys, time, threading, collections
import torch
from triton import knobs
import moekit.ops as ops
import moekit.runtime.replay as replay
if sys.argv[1] == "serial":
    replay.compile_ahead = lambda body, wait=True: None
log = []
def listener(src, metadata, metadata_group, times, cache_hit):
    total = times.ir_initialization + sum(t for _, t in times.lowering_stages) + times.store_results
    stages = dict(times.lowering_stages)
    log.append((src.name, total / 1e6, stages.get("cubin", 0) / 1e6, threading.current_thread().name, time.perf_counter()))
knobs.compilation.listener = listener
x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w1 = (torch.randn(64, 2048, 2048, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
w2 = (torch.randn(64, 2048, 1024, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
probs, idx = torch.randn(4096, 64, device="cuda").softmax(-1).topk(8, dim=-1)
probs.requires_grad_()
torch.cuda.synchronize()
t0 = time.perf_counter()
d = ops.permute(x, indices=idx, probs=probs, num_experts=64)
t1 = time.perf_counter()
h = ops.grouped_mlp(d.hidden, d.offsets, w1, w2, d.probs)
t2 = time.perf_counter()
y = ops.unpermute(h, d, weighted=False)
t3 = time.perf_counter()
y.sum().backward()
torch.cuda.synchronize()
t4 = time.perf_counter()
print(f"{sys.argv[1]}: total {t4 - t0:.2f} s  permute {t1 - t0:.2f}  mlp fwd {t2 - t1:.2f}  unpermute {t3 - t2:.2f}  backward {t4 - t3:.2f}")
for name, s, cubin, thread, t in log:
    print(f"   {name[:40]:40} {s:6.2f} s (ptxas {cubin:5.2f})  {thread[:24]:24} at {t - t0:6.2f}")
print(f"   {len(log)} compiles, sum {sum(l[1] for l in log):.2f} s, ptxas sum {sum(l[2] for l in log):.2f} s")
"""


def main() -> None:
    for mode in sys.argv[1:] or ("serial", "ahead"):
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, TRITON_CACHE_DIR=tmp, MOEKIT_AUTOTUNE="0")
            out = subprocess.run(
                [sys.executable, "-c", CHILD, mode], env=env, capture_output=True, text=True
            )
            print(out.stdout, out.stderr[-2000:])


if __name__ == "__main__":
    main()
