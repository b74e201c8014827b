"""Grouped MLP: moekit's fused grouped_mlp against torch._grouped_mm + autograd.

    python benchmarks/benchmark_grouped_mlp.py --out bench_out [--quick] [--smoke]

SwiGLU expert MLP, fwd + autograd.grad, 18·R·H·F FLOPs, skewed routing, ceiling dense torch.mm.
Host overhead at a CPU-bound shape (behind a GPU sleep, both autograd thread modes, against a
kernel-less floor; launches; graph replay). Per shape: do_bench, best of 2 rounds; peak and
saved MiB; the JSON after every shape (--budget-s).
"""

from __future__ import annotations

import math
import os
import time
from functools import partial

import common as bc
import torch
import torch.nn.functional as F

from moekit.ops import grouped_mlp
from moekit.reference.grouped_gemm import grouped_mm_ragged_m_ref

SHAPES = [  # name, R routed rows, E experts, H hidden, F expert width (real MoE layers)
    ("te_seed", 66560, 20, 2048, 512), ("qwen3_30b_a3b", 262144, 128, 2048, 768),
    ("olmoe", 65536, 64, 2048, 1024), ("deepseek_v3_ep8", 32768, 32, 7168, 2048),
    ("mixtral", 16384, 8, 4096, 14336)]  # fmt: skip
SMOKE_SHAPES = [("smoke_a", 64, 4, 32, 16), ("smoke_b", 96, 3, 64, 32)]
HOST_SHAPE = ("host_cpu_bound", 4096, 8, 1024, 1024)
CONTENDERS = ["moekit", "moekit_recompute", "torch_grouped_mm", "loop"]
FLOOR = "autograd_floor"
DTYPE = torch.bfloat16
# (autograd multithreading, key suffix): backward on autograd's device thread, or the caller's
HOST_MODES = ((True, "host_us"), (False, "host_us_caller_thread"))


def make_inputs(R, E, H, Fd, skewed, device, seed):
    """Routing counts (host), offsets [E] int32, the leaves x, w1, w2, probs and the output
    gradient dy, made on the device (a host randn of Mixtral's w1 takes seconds)."""
    torch.manual_seed(seed)
    counts = bc.routing_counts(R, E, skewed, torch.Generator().manual_seed(seed))
    offsets = torch.cumsum(counts, 0).to(torch.int32).to(device)
    g = torch.Generator(device=device).manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, device=device, dtype=DTYPE, generator=g)
    x = rand(R, H).requires_grad_(True)
    w1 = (rand(E, 2 * Fd, H) / math.sqrt(H)).requires_grad_(True)
    w2 = (rand(E, H, Fd) / math.sqrt(Fd)).requires_grad_(True)
    probs = torch.rand(R, device=device, generator=g).requires_grad_(True)
    return counts, offsets, x, w1, w2, probs, rand(R, H)


def _gmm(a, b, offsets):
    if a.is_cuda:
        return torch._grouped_mm(a, b, offs=offsets)
    return grouped_mm_ragged_m_ref(a, b, offsets, a.dtype)  # CUDA-only op; a differentiable ref


def torch_mlp(x, offsets, w1, w2, probs):
    """torch._grouped_mm + SwiGLU · probs under autograd (bf16 · fp32 probs → fp32 → bf16)."""
    g, u = _gmm(x, w1.transpose(1, 2), offsets).chunk(2, -1)
    return _gmm((F.silu(g) * u * probs[:, None]).to(x.dtype), w2.transpose(1, 2), offsets)


def loop_mlp(x, w1, w2, probs, host_counts):
    """Per-expert F.linear; split / unbind (not slicing) so autograd's backward is one cat /
    stack, not E full-size zero-filled gradients summed."""
    xs, ps, outs = x.split(host_counts), probs.split(host_counts), []
    for e in (e for e, c in enumerate(host_counts) if c > 0):
        g, u = F.linear(xs[e], w1[e]).chunk(2, -1)
        outs.append(F.linear((F.silu(g) * u * ps[e][:, None]).to(x.dtype), w2[e]))
    return torch.cat(outs)


def make_steps(counts, offsets, x, w1, w2, probs, dy, names):
    """name -> one forward + backward (autograd.grad to x, w1, w2, probs); ``.fwd`` the forward."""
    host_counts, ins = counts.tolist(), (x, w1, w2, probs)  # host bounds, outside any timing
    fwd = {
        "moekit": lambda: grouped_mlp(x, offsets, w1, w2, probs, recompute_activation=False),
        "moekit_recompute": lambda: grouped_mlp(x, offsets, w1, w2, probs,
                                                recompute_activation=True),
        "torch_grouped_mm": lambda: torch_mlp(x, offsets, w1, w2, probs),
        "loop": lambda: loop_mlp(x, w1.unbind(0), w2.unbind(0), probs, host_counts),
        FLOOR: lambda: bc.AutogradFloor.apply(x, offsets, w1, w2, probs)}  # fmt: skip
    steps = {}
    for n in names:
        steps[n] = lambda f=fwd[n]: torch.autograd.grad(f(), ins, dy)
        steps[n].fwd = fwd[n]
    return steps


def saved_mib(step) -> float:
    """MiB a forward keeps alive for its backward (activations saved plus the output)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = step.fwd()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    del y
    return held / 2**20


def run_shape(shape, names, ms, peak, device, seed, cuda) -> dict:
    """One shape, skewed routing: warm + memory, then timing in alternating rounds."""
    name, R, E, H, Fd = shape
    counts, *inputs = make_inputs(R, E, H, Fd, True, device, seed)
    steps = make_steps(counts, *inputs, names)
    flops = 18 * R * H * Fd
    row = {"shape": name, "R": R, "E": E, "H": H, "F": Fd, "flops": flops,
           "idle_experts": int((counts == 0).sum()), "max_rows_per_expert": int(counts.max()),
           "floor_ms": flops / (peak * 1e9)}  # fmt: skip
    for c, step in steps.items():  # the first call compiles and autotunes
        row[f"{c}_peak_mib"] = bc.peak_mib(step) if cuda else (step(), math.nan)[1]
        row[f"{c}_saved_mib"] = saved_mib(step) if cuda else math.nan
    bc.measure(steps, {"ms": ms}, 2, row)
    for c in names:
        row[f"{c}_tflops"] = flops / row[f"{c}_ms"] / 1e9
        row[f"{c}_pct_peak"] = 100 * row[f"{c}_tflops"] / peak
    row["ratio_vs_torch"] = row["torch_grouped_mm_ms"] / row["moekit_ms"]
    row["ratio_recompute_vs_torch"] = row["torch_grouped_mm_ms"] / row["moekit_recompute_ms"]
    if cuda and seed == 0:
        row["launches"] = {c: bc.count_launches(steps[c]) for c in names if c != "loop"}
    return row


def run_host(names, ms, device, n, cycles, cuda, smoke) -> dict:
    """Host µs per fwd + bwd at the CPU-bound shape (best of 3 rounds in turns, both autograd
    modes) against AutogradFloor; launches per call; a CUDA graph's replay (host and GPU µs)."""
    name, R, E, H, Fd = ("smoke_host", 64, 4, 32, 16) if smoke else HOST_SHAPE
    steps = make_steps(*make_inputs(R, E, H, Fd, False, device, 1234), [*names, FLOOR])
    res = {"shape": name, "R": R, "E": E, "H": H, "F": Fd, "calls": n}

    def host(fn, multithreaded: bool) -> float:
        with torch.autograd.set_multithreading_enabled(multithreaded):
            us, covered = bc.host_us_per_call(fn, n, cycles, passes=1)
        return us if covered else math.inf  # the GPU went idle: the host waited

    bc.measure(steps, {key: partial(host, multithreaded=mt) for mt, key in HOST_MODES}, 3, res)
    for _, k in HOST_MODES:  # k[7:]: the mode's suffix
        ratio = res[f"moekit_{k}"] / res[f"torch_grouped_mm_{k}"]
        res[f"host_ratio_moekit_vs_torch{k[7:]}"] = ratio
    if cuda:  # after all the host timings: the profiler and graphs must not perturb them
        gpu_us = lambda f: ms(f) * 1e3
        bc.measure(steps, {"eager_gpu_us": gpu_us, "launches": bc.count_launches}, 1, res)
        graphs = {c: bc.capture(steps[c]).replay
                  for c in ("torch_grouped_mm", *names) if c != "loop"}  # fmt: skip
        bc.measure(graphs, {"graph_host_us": lambda f: bc.host_us_per_call(f, n, cycles)[0],
                            "graph_gpu_us": gpu_us}, 1, res)  # fmt: skip
    return bc.without_rounds(res)


def main() -> None:
    ap = bc.parser(__doc__, quick="skip the loop baseline, fewer reps")
    ap.add_argument("--shapes", default=None, help="comma list of shape names (default: all)")
    ap.add_argument("--budget-s", type=float, help="no new shape after (default 150 quick, 900)")
    args = ap.parse_args()
    t_start, cuda = time.time(), torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    shapes = bc.pick(SMOKE_SHAPES if args.smoke else SHAPES, args.shapes)
    names = [c for c in CONTENDERS if not (args.quick and c == "loop")]
    torch.manual_seed(0)
    ms = bc.eager_timer(cuda, *((10, 60) if args.quick or args.smoke else (25, 200)))
    dense = lambda: bc.DensePeak(DTYPE, device, 8192 if cuda else 512, ms).tflops()
    peak, n = dense(), 10 if args.smoke else 50
    state = {"device": bc.device_name(cuda), "args": vars(args), "peak_tflops": [peak], "rows": []}
    bc.log(f"device: {state['device']}  dense bf16 peak (torch.mm): {peak:.0f} TFLOP/s")
    cycles = bc.sleep_cycles_per_ms() if cuda else None
    host = partial(run_host, names, ms, device, n, cycles, cuda, args.smoke)
    host, _, failed = bc.run_cases([("host overhead", host)])
    state["host"] = host[0] if host else None
    cases = [(s[0], partial(run_shape, s, names, ms, peak, device, i, cuda))
             for i, s in enumerate(shapes)]  # fmt: skip
    path = os.path.join(args.out, "grouped_mlp.json")
    after = lambda rows: bc.write_json(path, {**state, "rows": rows})
    budget = args.budget_s or (150.0 if args.quick else 900.0)
    state["rows"], state["skipped_shapes"], state["failed"] = bc.run_cases(cases, budget, after)
    state["failed"].update(failed)
    state["peak_tflops"].append(dense() if cuda else peak)
    state["seconds"] = time.time() - t_start
    host = state["host"] or {}
    bc.log({k: v for k, v in host.items() if "host" in k or "launches" in k})
    tf = bc.bars(state["rows"], {c: f"{c}_tflops" for c in names}, "TFLOP/s, fwd + bwd (18·R·H·F)",
                 hlines={f"dense torch.mm peak {peak:.3g}": peak})  # fmt: skip
    hrows = [{"c": c, **{k: host.get(f"{c}_{k}") for mt, k in HOST_MODES}} for c in names]
    hp = bc.bars(hrows, {k: k for _, k in HOST_MODES}, "host µs per fwd + bwd", label="c")
    cols = ["shape", *(f"{c}_ms" for c in names), "floor_ms", "moekit_tflops",
            "ratio_vs_torch", "ratio_recompute_vs_torch", *(f"{c}_peak_mib" for c in names),
            *(f"{c}_saved_mib" for c in names if c != "loop")]  # fmt: skip
    bc.finish(args.out, "grouped_mlp", state, cols, [tf, hp])


if __name__ == "__main__":
    main()
