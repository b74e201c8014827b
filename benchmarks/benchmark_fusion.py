"""moekit.fusion.Sequential against the fused op called directly and its own unfused plan.

    python benchmarks/benchmark_fusion.py --out bench_out [--smoke] [--autocast] [--pairs N]
    torchrun --nproc-per-node 2 benchmarks/benchmark_fusion.py --tp --out bench_out

Each rule's chain, fwd + bwd: host µs behind a GPU sleep (best of 5 rounds), eager and graph µs.
Target: sequential ≤ direct + max(10 µs, 10 %) on the CPU-time gap of --pairs adjacent pairs.
--tp: the all-reduce rule after a row-parallel Linear; --autocast: fp32 grouped_mlp.
"""

from __future__ import annotations

import math
import os
import statistics

import common as bc
import torch
import torch.distributed as dist

import moekit.fusion as mf
from moekit.distributed import init_distributed
from moekit.nn import MoELayer, RMSNorm, RouterConfig, RowParallelLinear
from moekit.ops import add_rmsnorm, grouped_mlp

ROUNDS = 5
DT = torch.bfloat16 if torch.cuda.is_available() else torch.float32  # the interpreter: no bf16


def _tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def training_step(fn, grads, leaves):
    """fwd + bwd of ``fn()`` against fixed output gradients, into fresh gradients of ``leaves``
    (no accumulation into ``.grad``, which a CUDA graph cannot hold)."""
    return lambda: torch.autograd.grad(_tuple(fn()), leaves, grads, allow_unused=True)


def output_grads(fn):
    with torch.no_grad():
        outs = _tuple(fn())
    # a CPU generator: a failed (reported) CUDA graph capture leaves the CUDA one unusable
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(o.shape, generator=gen, dtype=o.dtype).to(o.device) for o in outs)


def mlp_case(rows, E, H, F, dev, autocast=False):
    """``autocast``: fp32 parameters and inputs, both calls in a bf16 autocast region."""
    dt = torch.float32 if autocast else DT
    seq = mf.Sequential(mf.GroupedLinear(E, H, 2 * F, device=dev, dtype=dt), mf.ScaledSwiGLU(),
                        mf.GroupedLinear(E, F, H, device=dev, dtype=dt))  # fmt: skip
    x = torch.randn(rows, H, device=dev, dtype=dt, requires_grad=True)
    probs = torch.rand(rows, device=dev, dtype=dt, requires_grad=True)
    counts = torch.distributions.Multinomial(rows, torch.rand(E)).sample().to(torch.int64)
    offsets = counts.cumsum(0).to(torch.int32).to(dev)
    w1, w2 = seq[0].weight, seq[2].weight
    # fp16 on the CPU: Triton's interpreter computes tl.dot on bf16 wrongly
    half = torch.bfloat16 if dev.type == "cuda" else torch.float16
    region = torch.autocast(dev.type, dtype=half, enabled=autocast)  # a decorator too
    direct = region(lambda: grouped_mlp(x, offsets, w1, w2, probs))
    sequential = region(lambda: seq(x, offsets, probs))
    leaves = [x, probs, w1, w2]
    return seq, (direct, leaves), (sequential, leaves)


def norm_case(T, H, dev):
    seq = mf.Sequential(mf.AddExtraInput(), mf.MakeExtraOutput(),
                        mf.RMSNorm(H, device=dev, dtype=DT))  # fmt: skip
    x, r = (torch.randn(T, H, device=dev, dtype=DT, requires_grad=True) for _ in range(2))
    leaves = [x, r, seq[2].weight]
    return seq, (lambda: add_rmsnorm(x, r, leaves[2], 1e-6), leaves), (lambda: seq(x, r), leaves)


def linear_norm_case(T, H, dev):
    """A chain of two steps (Linear, then add_rmsnorm), each run by its own autograd form."""
    seq = mf.Sequential(mf.Linear(H, H, device=dev, dtype=DT), mf.AddExtraInput(),
                        mf.MakeExtraOutput(), mf.RMSNorm(H, device=dev, dtype=DT))  # fmt: skip
    x, r = (torch.randn(T, H, device=dev, dtype=DT, requires_grad=True) for _ in range(2))
    w, wn = seq[0].weight, seq[3].weight
    direct = lambda: add_rmsnorm(torch.nn.functional.linear(x, w), r, wn, 1e-6)
    return seq, (direct, [x, r, w, wn]), (lambda: seq(x, r), [x, r, w, wn])


def moe_case(T, H, E, k, F, dev):
    router = RouterConfig(aux_loss_coeff=1e-2)
    seq = mf.Sequential(mf.Router(H, E, k, router, device=dev, dtype=DT), mf.Permute(E),
                        mf.GroupedLinear(E, H, 2 * F, device=dev, dtype=DT), mf.ScaledSwiGLU(),
                        mf.GroupedLinear(E, F, H, device=dev, dtype=DT), mf.Unpermute())  # fmt: skip
    layer = MoELayer(H, F, E, k, router=router, device=dev, dtype=DT)
    with torch.no_grad():
        layer.router.weight.copy_(seq[0].weight)
        layer.experts.fc1_weight.copy_(seq[2].weight)
        layer.experts.fc2_weight.copy_(seq[4].weight)
    x = torch.randn(T, H, device=dev, dtype=DT, requires_grad=True)
    direct = (lambda: layer(x), [x, *layer.parameters()])
    return seq, direct, (lambda: seq(x), [x, *seq.parameters()])


def host_figures(row, steps, cycles, tp: bool, pairs: int) -> None:
    """Host and eager µs, best of ROUNDS in turns, the order rotating (host time drifts); then the
    sequential - direct gap of adjacent pairs by the wall clock and by process CPU time."""
    # short host batches: an MoE step enqueues ~100 launches
    host = lambda f: bc.host_us_per_call(f, 200, cycles, per_batch=8, fixed_count=tp)[0]
    eager = lambda f: (bc.fixed_count_ms(f) if tp else bc.bench_ms(f)) * 1e3
    bc.measure(steps, {"host_us": host, "eager_us": eager}, ROUNDS, row, rotate=True)
    gaps = [s - d for s, d in zip(row["sequential_host_us_rounds"], row["direct_host_us_rounds"])]
    row["host_gap_rounds_median_us"] = statistics.median(gaps)
    by_clock = bc.paired_host_gaps_us(steps["sequential"], steps["direct"], pairs, cycles,
                                      per_batch=4, fixed_count=tp)  # fmt: skip
    for key, paired in zip(("host_gap", "host_gap_cpu"), by_clock):
        row[f"{key}_us"], row[f"{key}_covered"] = paired.gap_us, paired.covered
        row[f"{key}_quartiles_us"] = statistics.quantiles(paired.gaps_us, n=4)[::2]  # 1st, 3rd
        row[f"{key}_direct_us"] = paired.b_us


def graph_times(row, steps, tp: bool) -> None:
    """GPU µs of a CUDA graph of 10 calls for host-bound shapes (GPU-bound: eager); not --tp."""
    for who, step in steps.items():
        row[f"{who}_graph_us"] = math.nan
        if tp or who == "unfused" or row[f"{who}_eager_us"] > 2000:
            continue
        try:
            row[f"{who}_graph_us"] = bc.graph_us(step, calls=10)
        except Exception as exc:  # a chain that cannot be captured
            while exc.__context__ is not None:  # the error inside the capture
                exc = exc.__context__
            row[f"{who}_graph_error"] = bc.error_line(exc)
            bc.log(f"  {who}: no CUDA graph ({row[f'{who}_graph_error']})")


def measure_case(name, rule, seq, direct_case, sequential_case, smoke, cycles, tp=False,
                 pairs=200) -> dict:  # fmt: skip
    """``tp``: every call holds a collective: each rank makes as many calls, no CUDA graphs."""
    (direct, direct_leaves), (sequential, seq_leaves) = direct_case, sequential_case
    grads = output_grads(direct)
    # they must agree before timing; no autograd graph may outlive this (it breaks a capture)
    with torch.no_grad():
        out_d, out_s = direct(), sequential()
    rel = lambda a, b: float((a - b).norm() / b.norm().clamp_min(1e-30))
    err = max(rel(s.float(), d.float()) for s, d in zip(_tuple(out_s), _tuple(out_d)))
    plan = seq.plan()  # for an input of the parameters' dtype and device
    fused = rule in plan.fused("forward") or rule in plan.fused("backward")
    seq_step = training_step(sequential, grads, seq_leaves)
    steps = {"sequential": seq_step, "direct": training_step(direct, grads, direct_leaves),
             "unfused": mf.fusions(disable=["all"])(seq_step)}  # fmt: skip
    row = {"case": name, "rule": rule, "applied": fused, "output_rel_err": err}
    if smoke:
        bc.measure(steps, {"host_us": lambda f: bc.host_ms(f) * 1e3}, 1, row)
    else:
        host_figures(row, steps, cycles, tp, pairs)
        graph_times(row, steps, tp)
    d, s = row["direct_host_us"], row["sequential_host_us"]
    if "host_gap_cpu_us" in row:  # the direct op's CPU time per call sets the allowance
        d = row["host_gap_cpu_direct_us"]
    allowance = max(10.0, 0.1 * d)
    row.update(host_allowance_us=allowance, host_budget_us=d + allowance,
               host_target_met=row.get("host_gap_cpu_us", s - d) <= allowance)  # fmt: skip
    if not smoke:
        row["fused_speedup_eager"] = row["unfused_eager_us"] / row["sequential_eager_us"]
    return row


def single_gpu_cases(smoke: bool, dev, autocast: bool = False):
    """(name, rule, case) of every chain (``autocast``: the grouped MLP's, fp32 under autocast)."""
    if autocast:
        shapes = [(64, 4, 64, 64)] if smoke else [(1024, 8, 1024, 1024), (32768, 64, 2048, 1024)]
        name = lambda R, E, H, F: "mlp_tiny" if smoke else f"mlp R={R} E={E} H={H} F={F}"
        return [(f"{name(*s)} autocast", "grouped_mlp", mlp_case(*s, dev, True)) for s in shapes]
    if smoke:
        return [("mlp_tiny", "grouped_mlp", mlp_case(64, 4, 64, 64, dev)),
                ("norm_tiny", "add_rmsnorm", norm_case(16, 64, dev)),
                ("linear_norm_tiny", "add_rmsnorm", linear_norm_case(16, 64, dev)),
                ("moe_tiny", "moe", moe_case(16, 64, 4, 2, 64, dev))]  # fmt: skip
    return [
        ("mlp R=1024 E=8 H=1024 F=1024", "grouped_mlp", mlp_case(1024, 8, 1024, 1024, dev)),
        ("mlp R=32768 E=64 H=2048 F=1024", "grouped_mlp", mlp_case(32768, 64, 2048, 1024, dev)),
        ("moe T=256 H=2048 E=64 k=8 F=1024", "moe", moe_case(256, 2048, 64, 8, 1024, dev)),
        ("moe T=8192 H=2048 E=64 k=8 F=1024", "moe", moe_case(8192, 2048, 64, 8, 1024, dev)),
        ("add_rmsnorm T=256 H=4096", "add_rmsnorm", norm_case(256, 4096, dev)),
        ("add_rmsnorm T=16384 H=4096", "add_rmsnorm", norm_case(16384, 4096, dev)),
        ("linear+add_rmsnorm T=256 H=4096", "add_rmsnorm", linear_norm_case(256, 4096, dev)),
    ]


def tp_cases(dev, smoke: bool):
    W, rank = dist.get_world_size(), dist.get_rank()
    cases = []
    for T, H in ((16, 64),) if smoke else ((256, 4096), (4096, 4096)):
        dt = torch.float32 if smoke else DT
        seq = mf.Sequential(mf.Linear(H, H, mode="row", device=dev, dtype=dt), mf.AllReduce(),
                            mf.AddExtraInput(), mf.MakeExtraOutput(),
                            mf.RMSNorm(H, device=dev, dtype=dt))  # fmt: skip
        row = RowParallelLinear(H, H, norm=RMSNorm(H, device=dev, dtype=dt), device=dev, dtype=dt)
        with torch.no_grad():
            row.weight.copy_(seq[0].weight)
        g = torch.Generator(device=dev).manual_seed(rank)
        x = torch.randn(T, H // W, device=dev, dtype=dt, generator=g, requires_grad=True)
        r = torch.randn(T, H, device=dev, dtype=dt, requires_grad=True)
        direct = (lambda row=row, x=x, r=r: row(x, r), [x, r, *row.parameters()])
        sequential = (lambda seq=seq, x=x, r=r: seq(x, r), [x, r, *seq.parameters()])
        name = f"allreduce T={T} H={H} W={W}"
        cases.append((name, "allreduce_add_rmsnorm", (seq, direct, sequential)))
    return cases


COLUMNS = [
    "case", "rule", "sequential_host_us", "direct_host_us", "host_budget_us", "host_gap_us",
    "host_gap_cpu_us", "host_allowance_us", "sequential_graph_us", "direct_graph_us",
    "sequential_eager_us", "unfused_eager_us",
    ("cpu gap quartiles", lambda r: " ".join(f"{q:+.1f}" for q in r.get("host_gap_cpu_quartiles_us", []))),
    ("target", lambda r: "met" if r["host_target_met"] else "MISSED"), ("fused x", "fused_speedup_eager"),
]  # fmt: skip


def main() -> None:
    ap = bc.parser(__doc__)
    ap.add_argument("--tp", action="store_true", help="the all-reduce rule, under torchrun")
    ap.add_argument("--only", default="", help="cases whose name contains one of these (a,b,..)")
    ap.add_argument("--pairs", type=int, default=200, help="adjacent call pairs for the gap")
    ap.add_argument("--autocast", action="store_true", help="grouped_mlp, fp32 params, autocast")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    smoke = args.smoke or not cuda
    if args.tp:
        init_distributed()
        dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        cases = tp_cases(dev, smoke)
    else:
        dev = torch.device("cuda" if cuda else "cpu")
        cases = single_gpu_cases(smoke, dev, args.autocast)
    cycles = bc.sleep_cycles_per_ms() if cuda else None
    writer = not args.tp or dist.get_rank() == 0
    stem = "fusion_tp" if args.tp else "fusion_autocast" if args.autocast else "fusion"
    data = {"device": bc.device_name(cuda), "rows": []}
    for name, rule, case in cases:
        if args.only and not any(part in name for part in args.only.split(",")):
            continue
        bc.log(f"{name}: {rule}\n  " + str(case[0].plan()).replace("\n", "\n  "))
        data["rows"].append(measure_case(name, rule, *case, smoke, cycles, args.tp, args.pairs))
        bc.release_memory()  # the CUDA graphs' memory pools
        if writer:  # each case as it finishes: a run cut short keeps the cases it measured
            bc.write_json(os.path.join(args.out, f"{stem}.json"), data)
    if args.tp:
        # every rank leaves the group: exiting with a live gloo group may abort at teardown
        dist.destroy_process_group()
    if writer:
        series = {w: f"{w}_host_us" for w in ("direct", "sequential", "unfused")}
        panel = bc.bars(data["rows"], {**series, "target (budget)": "host_budget_us"},
                        "host µs per fwd + bwd", label="case",
                        title="moekit.fusion.Sequential vs the fused op called directly")  # fmt: skip
        bc.finish(args.out, stem, data, COLUMNS, [panel], floatfmt=".1f")


if __name__ == "__main__":
    main()
