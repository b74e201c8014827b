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
import sys
import time

import common as bc
import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from moekit.distributed import SymmetricPool, init_distributed, set_pool  # noqa: E402
from moekit.kernels.allreduce import SIGNAL_BYTES  # noqa: E402
from moekit.ops import allreduce_add_rmsnorm, auto_algo  # noqa: E402
from moekit.ops.allreduce import DEFAULT_LAMPORT_SLOT_BYTES, workspace_of  # noqa: E402

TOKENS = (1, 8, 64, 256, 1024, 4096, 16384)
HIDDEN = (4096, 7168)
EPS = 1e-6


def _log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


# --- methods: each returns a zero-argument callable doing one full call on fixed tensors ---
class TorchSymm:
    """Baseline (b): torch's own symmetric-memory all-reduce ops on a rendezvoused buffer."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = dist.group.WORLD.group_name
        self.buf = symm_mem.empty(numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buf, dist.group.WORLD)
        ops = torch.ops.symm_mem
        self.one_shot_copy = getattr(ops, "one_shot_all_reduce_copy", None)
        self.one_shot = getattr(ops, "one_shot_all_reduce", None)
        self.two_shot = getattr(ops, "two_shot_all_reduce_", None)

    def view(self, T: int, H: int) -> torch.Tensor:
        return self.buf[: T * H].view(T, H)


def make_methods(x, residual, weight, torch_symm: TorchSymm | None, pool):
    T, H = x.shape
    work = x.clone()

    def with_norm(reduce):  # the baselines: an all-reduce, then torch's add + RMSNorm
        def run():
            ro = reduce() + residual
            return F.rms_norm(ro, (H,), weight, EPS), ro

        return run

    methods = {"nccl+torch": with_norm(lambda: (dist.all_reduce(work), work)[1])}
    if torch_symm is not None:
        ops, sbuf, grp = torch_symm, torch_symm.view(T, H), torch_symm.group_name
        if ops.one_shot_copy is not None:  # copies x into sbuf itself
            methods["symm1+torch"] = with_norm(lambda: ops.one_shot_copy(sbuf, x, "sum", grp))
        elif ops.one_shot is not None:
            methods["symm1+torch"] = with_norm(lambda: ops.one_shot(sbuf.copy_(x), "sum", grp))
        if ops.two_shot is not None:
            two = lambda: (ops.two_shot(sbuf.copy_(x), "sum", grp), sbuf)[1]
            methods["symm2+torch"] = with_norm(two)
    ws = workspace_of(pool)
    algos = ["one_shot", "two_shot", "auto"]
    for lam in ("lamport", "lamport_two_shot"):
        if ws is not None and ws.lamport_fits(T, H, x.element_size(), lam, pool.world_size):
            algos.insert(-1, lam)
    for algo in algos:
        methods[algo] = lambda algo=algo: allreduce_add_rmsnorm(x, residual, weight, algo=algo)
    methods["nccl_fused"] = lambda: allreduce_add_rmsnorm(x, residual, weight, algo="nccl")
    return methods


# --- timing: every rank makes the same number of calls (a fixed count), the slowest rank counts ---
def _max_over_ranks(us: float, device) -> float:
    t = torch.tensor([us], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def time_us(fn, mode: str, iters: int, calls: int, device) -> float:
    """µs per call, the maximum over ranks of a median over ≥ ``iters`` calls: ``eager`` batches
    of ``calls`` back-to-back calls (≥ 10 batches), ``graph`` a CUDA graph of ``calls`` calls
    (≥ 20 replays), ``graph1`` a graph of one call."""
    calls = 1 if mode == "graph1" else calls
    torch.cuda.synchronize()
    dist.barrier()
    if mode == "eager":
        batches = max(-(-iters // calls), 10)
        batch = lambda: [fn() for _ in range(calls)]
        us = bc.fixed_count_ms(batch, warmup=1, calls=batches) * 1e3 / calls
    else:
        us = bc.graph_us(fn, calls, fixed_count=True, replays=max(-(-iters // calls), 20))
    return _max_over_ranks(us, device)


BASELINES = ("nccl+torch", "symm1+torch", "symm2+torch")
OURS = ("one_shot", "two_shot", "lamport", "lamport_two_shot", "auto", "nccl_fused")
NAN = float("nan")
COLUMNS = [
    "T", "H", "MB", *((m, f"{m}_graph_us") for m in BASELINES + OURS), "auto/a", "auto/best",
    ("busbw", "busbw_GBps"), ("eager a", "nccl+torch_eager_us"), ("eager auto", "auto_eager_us"),
    ("g1 a", "nccl+torch_graph1_us"), ("g1 auto", "auto_graph1_us"), "x eager",
]  # fmt: skip


def suggest_thresholds(rows: list[dict], world: int) -> str:
    """Which of our algorithms is fastest per size → the ``auto`` thresholds to suggest."""
    sugg = []
    for r in rows:
        cands = {k: r.get(f"{k}_graph_us", NAN) for k in OURS if k != "auto"}
        cands = {k: v for k, v in cands.items() if v == v}
        if cands:
            sugg.append((r["T"] * r["H"] * 2, min(cands, key=cands.get)))
    top = lambda ok: max([b for b, k in sugg if ok(k)], default=0) // 1024
    return (
        f"fastest per size: {[(f'{b / 1e6:.2f}MB', k) for b, k in sugg]}\n"
        f"suggested for W={world}: MOEKIT_AR_LAMPORT_MAX_KB={top(lambda k: k == 'lamport')} "
        f"MOEKIT_AR_LAMPORT_TWO_SHOT_MAX_KB={top(lambda k: k.startswith('lamport'))} "
        f"MOEKIT_AR_ONE_SHOT_MAX_KB={top(lambda k: k == 'one_shot')} "
        f"MOEKIT_AR_TWO_SHOT_MAX_KB={top(lambda k: k != 'nccl_fused')} (current auto picks: "
        f"{sorted({auto_algo(b, world, True) for b, _ in sugg})})"
    )


def verdict(rows: list[dict]) -> dict:
    """The targets on graph µs: auto ≥ 2× (a) up to 256 tokens, 1.2× from 4096, else parity;
    and no slower than the best baseline."""
    out = {"fail": [], "pass": []}
    for r in rows:
        target = 2.0 if r["T"] <= 256 else (1.2 if r["T"] >= 4096 else 1.0)
        ok = r["auto/a"] >= target and r["auto_graph_us"] <= r["best_base"]
        out["pass" if ok else "fail"].append(
            f"T={r['T']} H={r['H']}: auto {r['auto_graph_us']:.1f} µs, (a) "
            f"{r['nccl+torch_graph_us']:.1f}, best baseline {r['best_base']:.1f}, target ≥ {target}× (a)"
        )
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


# --- main ---
def run_checks(iters: int) -> None:
    """tests/distributed/gpu_allreduce_check.run_checks (loaded by path)."""
    import importlib.util

    path = os.path.join(REPO, "tests", "distributed", "gpu_allreduce_check.py")
    spec = importlib.util.spec_from_file_location("gpu_allreduce_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.run_checks(iters=iters)


def time_size(T, H, args, info, torch_symm, pool) -> dict:
    """Every method and mode at one size (``{method}_{mode}_us``; NaN and ``{method}_error``
    where a method rejects the size), auto's bus bandwidth and the ratios to the baselines."""
    device, world = info.device, info.world_size
    g = torch.Generator(device=device).manual_seed(T * 31 + H + 977 * info.rank)
    x = torch.randn(T, H, device=device, generator=g).to(torch.bfloat16)
    g.manual_seed(T * 31 + H)
    residual = torch.randn(T, H, device=device, generator=g).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(H, device=device, generator=g)).to(torch.bfloat16)
    methods = make_methods(x, residual, weight, torch_symm, pool)
    methods = {n: f for n, f in methods.items() if not args.methods or n in args.methods}
    timers = {f"{mode}_us": lambda f, mode=mode: time_us(f, mode, args.iters, args.graph_calls,
              device) for mode in args.modes}  # fmt: skip
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
    ap.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    ap.add_argument("--hidden", type=int, nargs="*", default=list(HIDDEN))
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--check-iters", type=int, default=1000)
    ap.add_argument("--graph-calls", type=int, default=20, help="calls per CUDA graph")
    ap.add_argument("--methods", nargs="*", default=None, help="only these methods")
    ap.add_argument("--modes", nargs="*", default=["eager", "graph", "graph1"])
    args = ap.parse_args()
    if args.iters < 200:
        raise SystemExit("--iters must be >= 200 (median over at least 200 calls)")
    info = init_distributed()
    world, t_start = info.world_size, time.perf_counter()
    max_numel = max(args.tokens) * max(args.hidden)
    # one pool big enough for a two_shot of the largest shape (two halves of T·H·2 bytes) and
    # the Lamport slots, created before anything else
    size = SIGNAL_BYTES + 2 * (max_numel + 8 * 16384) * 2 + 2 * world * DEFAULT_LAMPORT_SLOT_BYTES
    pool = set_pool(SymmetricPool(dist.group.WORLD, size_bytes=size))
    env = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
    _log(f"world={world} device={torch.cuda.get_device_name()} torch={torch.__version__} "
         f"pool={pool} env=" + ",".join(f"{k}={os.environ.get(k)}" for k in env))  # fmt: skip
    if not args.skip_checks:
        run_checks(args.check_iters)
    try:
        torch_symm = TorchSymm(max_numel, torch.bfloat16, info.device)
    except (RuntimeError, AttributeError, ImportError) as e:  # baseline (b) reported as missing
        _log(f"baseline (b) unavailable: {type(e).__name__}: {e}")
        torch_symm = None
    rows = []
    for H, T in itertools.product(args.hidden, args.tokens):
        rows.append(time_size(T, H, args, info, torch_symm, pool))
        _log(f"  done T={T} H={H} ({time.perf_counter() - t_start:.0f} s)")
        torch.cuda.empty_cache()
    if info.rank == 0:
        rows.sort(key=lambda r: (r["T"], r["H"]))
        meta = {"world_size": world, "device": torch.cuda.get_device_name(),
                "torch": torch.__version__, "iters": args.iters, "graph_calls": args.graph_calls,
                "lamport_slot_bytes": getattr(workspace_of(pool), "lamport_slot_bytes", 0),
                "auto_picks": {str(2 * r["T"] * r["H"]): auto_algo(2 * r["T"] * r["H"], world,
                               True) for r in rows}}  # fmt: skip
        data = {"meta": meta, "rows": rows, "verdict": verdict(rows)}
        print(f"\ntotal {time.perf_counter() - t_start:.0f} s; latency µs, CUDA graph of "
              f"back-to-back calls (median, max over {world} ranks); bf16; g1 = one call per "
              "graph replay", flush=True)  # fmt: skip
        bc.finish(args.out, "allreduce_rmsnorm", data, COLUMNS, panels(rows, world), floatfmt=".1f")
        bc.log(suggest_thresholds(rows, world))
        bc.log(f"targets met at {len(data['verdict']['pass'])}/{len(rows)} sizes")
        bc.log("\n".join(f"  MISSED {f}" for f in data["verdict"]["fail"]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
