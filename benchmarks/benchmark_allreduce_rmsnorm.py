"""All-reduce + residual add + RMSNorm over symmetric memory against NCCL, one process per GPU.

    bash benchmarks/run_allreduce_rmsnorm.sh --out results/    # sets the no-multicast env

Checks (``tests/distributed/gpu_allreduce_check``; ``--skip-checks``), then tokens × hidden,
bf16: µs per call, max over ranks of a median over ≥ --iters calls (fixed counts), eager, CUDA
graph of --graph-calls calls (the targets) and graph1. Baselines nccl+torch, symm1/symm2+torch;
ours one_shot, two_shot, lamport(_two_shot), auto, nccl_fused. Bus BW as in nccl-tests.
"""

from __future__ import annotations

import itertools
import os
import runpy
import time

import common as bc
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moekit.distributed import SymmetricPool, init_distributed, set_pool
from moekit.kernels.allreduce import SIGNAL_BYTES
from moekit.ops import allreduce_add_rmsnorm, auto_algo
from moekit.ops.allreduce import DEFAULT_LAMPORT_SLOT_BYTES, workspace_of

BASELINES = ("nccl+torch", "symm1+torch", "symm2+torch")
OURS = ("one_shot", "two_shot", "lamport", "lamport_two_shot", "auto", "nccl_fused")
NAN = float("nan")


def make_methods(x, residual, weight, sbuf: torch.Tensor | None, pool):
    """Each method: a zero-argument callable doing one full call on fixed tensors."""
    T, H = x.shape
    work = x.clone()
    norm = lambda ro: (F.rms_norm(ro, (H,), weight, 1e-6), ro)
    with_norm = lambda reduce: lambda: norm(reduce() + residual)  # all-reduce, torch's add + norm
    methods = {"nccl+torch": with_norm(lambda: (dist.all_reduce(work), work)[1])}
    if sbuf is not None:
        sbuf, grp, ops = sbuf[: T * H].view(T, H), dist.group.WORLD.group_name, torch.ops.symm_mem
        one_copy, one, two = (getattr(ops, op, None) for op in ("one_shot_all_reduce_copy",
                              "one_shot_all_reduce", "two_shot_all_reduce_"))  # fmt: skip
        if one_copy is not None:  # copies x into sbuf itself
            methods["symm1+torch"] = with_norm(lambda: one_copy(sbuf, x, "sum", grp))
        elif one is not None:
            methods["symm1+torch"] = with_norm(lambda: one(sbuf.copy_(x), "sum", grp))
        if two is not None:
            methods["symm2+torch"] = with_norm(lambda: (two(sbuf.copy_(x), "sum", grp), sbuf)[1])
    ws = workspace_of(pool)
    algos = ["one_shot", "two_shot", "auto"]
    for lam in ("lamport", "lamport_two_shot"):
        if ws is not None and ws.lamport_fits(T, H, x.element_size(), lam, pool.world_size):
            algos.insert(-1, lam)
    for algo in [*algos, "nccl"]:
        name = "nccl_fused" if algo == "nccl" else algo
        methods[name] = lambda algo=algo: allreduce_add_rmsnorm(x, residual, weight, algo=algo)
    return methods


def time_us(fn, mode: str, iters: int, calls: int) -> float:
    """µs per call, the maximum over ranks of a median over ≥ ``iters`` calls (every rank makes
    as many): ``eager`` batches of ``calls`` back-to-back calls (≥ 10 batches), ``graph`` a CUDA
    graph of ``calls`` calls (≥ 20 replays), ``graph1`` a graph of one call."""
    calls = 1 if mode == "graph1" else calls
    torch.cuda.synchronize()
    dist.barrier()
    if mode == "eager":
        batch = lambda: [fn() for _ in range(calls)]
        us = bc.fixed_count_ms(batch, warmup=1, calls=max(-(-iters // calls), 10)) * 1e3 / calls
    else:
        us = bc.graph_us(fn, calls, fixed_count=True, replays=max(-(-iters // calls), 20))
    return bc.over_ranks(us)


COLUMNS = [
    "T", "H", "MB", *((m, f"{m}_graph_us") for m in BASELINES + OURS), "auto/a", "auto/best",
    ("busbw", "busbw_GBps"), ("eager a", "nccl+torch_eager_us"), ("eager auto", "auto_eager_us"),
    ("g1 a", "nccl+torch_graph1_us"), ("g1 auto", "auto_graph1_us"), "x eager"]  # fmt: skip


def suggest_thresholds(rows: list[dict], world: int) -> str:
    """Which of our algorithms is fastest per size → the ``auto`` thresholds to suggest."""
    sugg = []
    for r in rows:
        cands = {k: v for k in OURS if k != "auto" and (v := r.get(f"{k}_graph_us", NAN)) == v}
        if cands:
            sugg.append((r["T"] * r["H"] * 2, min(cands, key=cands.get)))
    top = lambda ok: max([b for b, k in sugg if ok(k)], default=0) // 1024
    return (f"fastest per size: {[(f'{b / 1e6:.2f}MB', k) for b, k in sugg]}\n"
            f"suggested for W={world}: MOEKIT_AR_LAMPORT_MAX_KB={top(lambda k: k == 'lamport')} "
            f"MOEKIT_AR_LAMPORT_TWO_SHOT_MAX_KB={top(lambda k: k.startswith('lamport'))} "
            f"MOEKIT_AR_ONE_SHOT_MAX_KB={top(lambda k: k == 'one_shot')} "
            f"MOEKIT_AR_TWO_SHOT_MAX_KB={top(lambda k: k != 'nccl_fused')} (current auto picks: "
            f"{sorted({auto_algo(b, world, True) for b, _ in sugg})})")  # fmt: skip


def verdict(rows: list[dict]) -> dict:
    """Targets on graph µs: auto ≥ 2× (a) to 256 tokens, 1.2× from 4096, else 1×; ≤ best base."""
    out = {"fail": [], "pass": []}
    for r in rows:
        target = 2.0 if r["T"] <= 256 else (1.2 if r["T"] >= 4096 else 1.0)
        ok = r["auto/a"] >= target and r["auto_graph_us"] <= r["best_base"]
        out["pass" if ok else "fail"].append(
            f"T={r['T']} H={r['H']}: auto {r['auto_graph_us']:.1f} µs, (a) {r['nccl+torch_graph_us']:.1f}, "
            f"best baseline {r['best_base']:.1f}, target ≥ {target}× (a)")  # fmt: skip
    return out


def panels(rows: list[dict], world: int) -> list[bc.Panel]:
    """Graph-mode latency against tokens, a line per method, a panel per hidden size."""
    out = []
    for H in sorted({r["H"] for r in rows}):
        rs = sorted((r for r in rows if r["H"] == H), key=lambda r: r["T"])
        lines = {m: ([r["T"] for r in rs], [r.get(f"{m}_graph_us", NAN) for r in rs])
                 for m in BASELINES + OURS if any(f"{m}_graph_us" in r for r in rs)}  # fmt: skip
        out.append(bc.Panel(lines, "latency per call (µs, CUDA graph)", kind="line", logx=True,
                            xlabel="tokens", logy=True,
                            title=f"all-reduce + add + RMSNorm, H={H}, bf16, {world} GPUs"))  # fmt: skip
    return out


def time_size(T, H, args, info, sbuf, pool) -> dict:
    """Every method × mode at one size (NaN, ``{method}_error`` where refused), bus BW, ratios."""
    device, world = info.device, info.world_size
    g = torch.Generator(device=device).manual_seed(T * 31 + H + 977 * info.rank)
    x = torch.randn(T, H, device=device, generator=g).to(torch.bfloat16)
    g.manual_seed(T * 31 + H)
    residual = torch.randn(T, H, device=device, generator=g).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(H, device=device, generator=g)).to(torch.bfloat16)
    timers = {f"{mode}_us": lambda f, mode=mode: time_us(f, mode, args.iters, args.graph_calls)
              for mode in ("eager", "graph", "graph1")}  # fmt: skip
    methods = make_methods(x, residual, weight, sbuf, pool)
    row = bc.measure(methods, timers, 1, {"T": T, "H": H, "MB": T * H * 2 / 1e6})
    us = lambda m, mode="graph": row.get(f"{m}_{mode}_us", NAN)
    row["best_base"] = min([v for v in map(us, BASELINES) if v == v], default=NAN)
    row["busbw_GBps"] = T * H * 2 * 2 * (world - 1) / world / (us("auto") * 1e-6) / 1e9
    row["auto/a"], row["auto/best"] = us("nccl+torch") / us("auto"), row["best_base"] / us("auto")
    row["x eager"] = us("nccl+torch", "eager") / us("auto", "eager")
    return row


def main() -> None:
    ap = bc.parser(__doc__, smoke=False)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 8, 64, 256, 1024, 4096, 16384])
    ap.add_argument("--hidden", type=int, nargs="*", default=[4096, 7168])
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--check-iters", type=int, default=1000)
    ap.add_argument("--graph-calls", type=int, default=20, help="calls per CUDA graph")
    args = ap.parse_args()
    if args.iters < 200:
        raise SystemExit("--iters must be >= 200 (median over at least 200 calls)")
    info = init_distributed()
    world, t_start, rank0 = info.world_size, time.perf_counter(), info.rank == 0
    max_numel = max(args.tokens) * max(args.hidden)
    # one pool, made first: a two_shot of the largest shape (2 halves of T·H·2 B), Lamport slots
    size = SIGNAL_BYTES + 2 * (max_numel + 8 * 16384) * 2 + 2 * world * DEFAULT_LAMPORT_SLOT_BYTES
    pool = set_pool(SymmetricPool(dist.group.WORLD, size_bytes=size))
    env = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
    if rank0:
        bc.log(f"world={world} device={torch.cuda.get_device_name()} torch={torch.__version__} "
               f"pool={pool} env=" + ",".join(f"{k}={os.environ.get(k)}" for k in env))  # fmt: skip
    if not args.skip_checks:
        path = os.path.join(bc.REPO, "tests", "distributed", "gpu_allreduce_check.py")
        runpy.run_path(path)["run_checks"](iters=args.check_iters)
    try:  # baseline (b): torch's own symmetric-memory all-reduce ops on a rendezvoused buffer
        import torch.distributed._symmetric_memory as symm_mem

        sbuf = symm_mem.empty(max_numel, dtype=torch.bfloat16, device=info.device)
        symm_mem.rendezvous(sbuf, dist.group.WORLD)
    except (RuntimeError, AttributeError, ImportError) as e:  # baseline (b) reported as missing
        if rank0:
            bc.log(f"baseline (b) unavailable: {type(e).__name__}: {e}")
        sbuf = None
    rows = []
    for H, T in itertools.product(args.hidden, args.tokens):
        rows.append(time_size(T, H, args, info, sbuf, pool))
        if rank0:
            bc.log(f"  done T={T} H={H} ({time.perf_counter() - t_start:.0f} s)")
        torch.cuda.empty_cache()
    if rank0:
        rows.sort(key=lambda r: (r["T"], r["H"]))
        auto = {str(b): auto_algo(b, world, True) for b in (2 * r["T"] * r["H"] for r in rows)}
        slot = getattr(workspace_of(pool), "lamport_slot_bytes", 0)
        meta = {"world_size": world, **bc.meta(True), "iters": args.iters,
                "graph_calls": args.graph_calls, "lamport_slot_bytes": slot, "auto_picks": auto}  # fmt: skip
        data = {"meta": meta, "rows": rows, "verdict": verdict(rows)}
        bc.log(f"\ntotal {time.perf_counter() - t_start:.0f} s; latency µs, CUDA graph of "
               f"back-to-back calls (median, max over {world} ranks); bf16; g1 = one call per "
               "graph replay")  # fmt: skip
        bc.finish(args.out, "allreduce_rmsnorm", data, COLUMNS, panels(rows, world), floatfmt=".1f")
        bc.log(suggest_thresholds(rows, world))
        bc.log(f"targets met at {len(data['verdict']['pass'])}/{len(rows)} sizes")
        bc.log("\n".join(f"  MISSED {f}" for f in data["verdict"]["fail"]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
