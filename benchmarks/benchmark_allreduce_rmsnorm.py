"""All-reduce + residual add + RMSNorm over symmetric memory against NCCL, one process per GPU.

    bash benchmarks/run_allreduce_rmsnorm.sh --out results/    # sets the no-multicast env

1. Correctness pass (``tests/distributed/gpu_allreduce_check.run_checks``): every algo vs the
   reference, bit-identical on every rank, ``--check-iters`` repeated calls, back-to-back calls
   with one rank delayed in turn, cached launch plans + a misaligned input, CUDA-graph capture,
   the NCCL fallback with a too-small pool, bad input, backward. ``--skip-checks`` skips it.
2. Timing grid: tokens × hidden, bf16. Per method and shape, the latency of one call, the maximum
   over ranks of a median over ≥ ``--iters`` (≥ 200) calls, in three modes:
     ``eager``  : ``--graph-calls`` calls issued back to back from Python, each batch timed
                  with CUDA events and divided by the number of calls; median over the batches
                  (host-bound when a call's GPU time is shorter than its launch cost, for every
                  method alike; batching keeps one rank's host jitter from landing on one call);
     ``graph``  : ``--graph-calls`` calls captured back to back in one CUDA graph; each replay is
                  timed with CUDA events and divided by the number of calls, the median over the
                  replays is reported (device latency per call, the way nccl-tests and vLLM's
                  custom all-reduce measure it; the targets are checked on this mode);
     ``graph1`` : a CUDA graph holding one call, each replay timed alone (adds the graph launch
                  gap on an idle GPU).
   Methods:
     (a)  ``nccl+torch``   : NCCL all_reduce (in place) + torch add + torch RMSNorm
     (b1) ``symm1+torch``  : torch symm_mem one_shot_all_reduce(_copy) + the same add and norm
     (b2) ``symm2+torch``  : copy into symm memory + torch symm_mem two_shot_all_reduce_ + add/norm
     ``one_shot`` / ``two_shot`` / ``lamport`` / ``lamport_two_shot`` / ``auto`` / ``nccl_fused``:
     moekit.ops.allreduce_add_rmsnorm with that ``algo`` (the Lamport ones only where the call
     fits the pool's Lamport slots).
   Bus bandwidth = bytes · 2(W−1)/W / time (the nccl-tests convention).
3. Rank 0 prints a compact table last and writes ``allreduce_rmsnorm.json`` + ``.png`` to --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import pyplot, save_figure, write_json

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


# ----------------------------------------------------------------------------------------------
# methods: each returns a zero-argument callable doing one full call on fixed tensors
# ----------------------------------------------------------------------------------------------


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
    methods = {}
    work = x.clone()

    def nccl_torch():
        dist.all_reduce(work)
        ro = work + residual
        return F.rms_norm(ro, (H,), weight, EPS), ro

    methods["nccl+torch"] = nccl_torch
    if torch_symm is not None:
        sbuf = torch_symm.view(T, H)
        if torch_symm.one_shot_copy is not None or torch_symm.one_shot is not None:

            def symm1():
                if torch_symm.one_shot_copy is not None:  # copies x into sbuf itself
                    s = torch_symm.one_shot_copy(sbuf, x, "sum", torch_symm.group_name)
                else:
                    sbuf.copy_(x)
                    s = torch_symm.one_shot(sbuf, "sum", torch_symm.group_name)
                ro = s + residual
                return F.rms_norm(ro, (H,), weight, EPS), ro

            methods["symm1+torch"] = symm1
        if torch_symm.two_shot is not None:

            def symm2():
                sbuf.copy_(x)
                torch_symm.two_shot(sbuf, "sum", torch_symm.group_name)
                ro = sbuf + residual
                return F.rms_norm(ro, (H,), weight, EPS), ro

            methods["symm2+torch"] = symm2
    ws = workspace_of(pool)
    algos = ["one_shot", "two_shot", "auto"]
    for lam in ("lamport", "lamport_two_shot"):
        if ws is not None and ws.lamport_fits(T, H, x.element_size(), lam, pool.world_size):
            algos.insert(-1, lam)
    for algo in algos:
        methods[algo] = lambda algo=algo: allreduce_add_rmsnorm(x, residual, weight, algo=algo)
    methods["nccl_fused"] = lambda: allreduce_add_rmsnorm(x, residual, weight, algo="nccl")
    return methods


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------


def _events(n: int) -> list[torch.cuda.Event]:
    return [torch.cuda.Event(enable_timing=True) for _ in range(n)]


def _per_call_us(starts, ends, calls: int, device) -> float:
    """µs per call: the median over the timed batches, then the maximum over ranks (a
    collective is as slow as its slowest rank)."""
    torch.cuda.synchronize()
    per_call = [s.elapsed_time(e) / calls for s, e in zip(starts, ends)]
    med = torch.tensor([statistics.median(per_call)], dtype=torch.float64, device=device)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return float(med.item()) * 1e3


def time_eager(fn, iters: int, device, calls: int = 1) -> float:
    """Median per-call latency of ``calls`` back-to-back eager calls timed together (≥ ``iters``
    calls in all, ≥ 10 batches); ``calls = 1`` times every call alone."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    batches = max(-(-iters // calls), 10)
    starts, ends = _events(batches), _events(batches)
    for i in range(batches):
        starts[i].record()
        for _ in range(calls):
            fn()
        ends[i].record()
    return _per_call_us(starts, ends, calls, device)


def time_graph(fn, iters: int, device, calls: int = 1) -> float:
    """Median per-call latency of a CUDA graph holding ``calls`` back-to-back calls (≥ ``iters``
    calls in all, ≥ 20 replays)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    replays = max(-(-iters // calls), 20)
    starts, ends = _events(replays), _events(replays)
    for i in range(replays):
        starts[i].record()
        graph.replay()
        ends[i].record()
    out = _per_call_us(starts, ends, calls, device)
    del graph
    return out


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------

BASELINES = ("nccl+torch", "symm1+torch", "symm2+torch")
OURS = ("one_shot", "two_shot", "lamport", "lamport_two_shot", "auto", "nccl_fused")


def summarize(rows: list[dict], world: int) -> tuple[str, dict]:
    by = {}
    for r in rows:
        by.setdefault((r["tokens"], r["hidden"]), {})[(r["method"], r["mode"])] = r
    lines = []
    hdr = (
        f"{'T':>6} {'H':>5} {'MB':>7} | {'(a)':>8} {'(b1)':>8} {'(b2)':>8} | {'1shot':>8} "
        f"{'2shot':>8} {'lamp':>8} {'lamp2':>8} {'auto':>8} {'ncclF':>8} | {'auto/a':>6} {'auto/best':>9} "
        f"{'busbw':>7} | {'eager a':>8} {'eager auto':>10} {'x':>5} | {'g1 a':>6} {'g1 auto':>7}"
    )
    lines.append(
        f"latency µs, CUDA graph of back-to-back calls (median, max over {world} ranks); bf16; "
        "g1 = one call per graph replay"
    )
    lines.append(hdr)
    verdict = {"fail": [], "pass": []}
    for (T, H), m in sorted(by.items()):

        def g(name, mode="graph", m=m):
            r = m.get((name, mode))
            return r["us"] if r else float("nan")

        a = g("nccl+torch")
        best_base = min([v for v in (g(b) for b in BASELINES) if v == v], default=float("nan"))
        auto = g("auto")
        mb = T * H * 2 / 1e6
        busbw = m.get(("auto", "graph"), {}).get("busbw_GBps", float("nan"))
        ea, eauto = g("nccl+torch", "eager"), g("auto", "eager")
        lines.append(
            f"{T:>6} {H:>5} {mb:>7.2f} | {a:>8.1f} {g('symm1+torch'):>8.1f} "
            f"{g('symm2+torch'):>8.1f} | {g('one_shot'):>8.1f} {g('two_shot'):>8.1f} "
            f"{g('lamport'):>8.1f} {g('lamport_two_shot'):>8.1f} {auto:>8.1f} {g('nccl_fused'):>8.1f} | {a / auto:>6.2f} "
            f"{best_base / auto:>9.2f} {busbw:>7.1f} | {ea:>8.1f} {eauto:>10.1f} "
            f"{ea / eauto:>5.2f} | {g('nccl+torch', 'graph1'):>6.1f} {g('auto', 'graph1'):>7.1f}"
        )
        target = 2.0 if T <= 256 else (1.2 if T >= 4096 else 1.0)
        ok = a / auto >= target and auto <= best_base * 1.0
        (verdict["pass"] if ok else verdict["fail"]).append(
            f"T={T} H={H}: auto {auto:.1f} µs, (a) {a:.1f}, best baseline {best_base:.1f}, "
            f"target ≥ {target}× (a)"
        )
    # which of our algorithms is fastest per size → thresholds for `auto`
    sugg = []
    for (T, H), m in sorted(by.items()):
        cands = {
            k: m[(k, "graph")]["us"]
            for k in ("one_shot", "two_shot", "lamport", "lamport_two_shot", "nccl_fused")
            if (k, "graph") in m
        }
        if not cands:
            continue
        sugg.append((T * H * 2, min(cands, key=cands.get)))
    lam_max = max([b for b, k in sugg if k == "lamport"], default=0)
    lam2_max = max([b for b, k in sugg if k.startswith("lamport")], default=0)
    one_max = max([b for b, k in sugg if k == "one_shot"], default=0)
    two_max = max([b for b, k in sugg if k != "nccl_fused"], default=0)
    lines.append(
        f"fastest per size: {[(f'{b / 1e6:.2f}MB', k) for b, k in sugg]}\n"
        f"suggested for W={world}: MOEKIT_AR_LAMPORT_MAX_KB={lam_max // 1024} "
        f"MOEKIT_AR_LAMPORT_TWO_SHOT_MAX_KB={lam2_max // 1024} "
        f"MOEKIT_AR_ONE_SHOT_MAX_KB={one_max // 1024} "
        f"MOEKIT_AR_TWO_SHOT_MAX_KB={two_max // 1024} (current auto picks: "
        f"{sorted({auto_algo(b, world, True) for b, _ in sugg})})"
    )
    lines.append(f"targets met at {len(verdict['pass'])}/{len(by)} sizes")
    for f in verdict["fail"]:
        lines.append(f"  MISSED {f}")
    return "\n".join(lines), verdict


def plot(rows: list[dict], path: str, world: int) -> None:
    plt = pyplot()
    hidden = sorted({r["hidden"] for r in rows})
    fig, axes = plt.subplots(1, len(hidden), figsize=(6 * len(hidden), 4.5), squeeze=False)
    for ax, H in zip(axes[0], hidden):
        for method in BASELINES + OURS:
            pts = sorted(
                (r["tokens"], r["us"])
                for r in rows
                if r["hidden"] == H and r["method"] == method and r["mode"] == "graph"
            )
            if pts:
                style = "--" if method in BASELINES else "-"
                ax.plot(*zip(*pts), style, marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("latency per call (µs, CUDA graph)")
        ax.set_title(f"all-reduce + add + RMSNorm, H={H}, bf16, {world} GPUs")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, path)


# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_out")
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
    world, device = info.world_size, info.device
    t_start = time.perf_counter()
    max_numel = max(args.tokens) * max(args.hidden)
    # one pool big enough for a two_shot of the largest shape (two halves of T·H·2 bytes) and
    # the Lamport slots, created before anything else
    lamport = 2 * world * DEFAULT_LAMPORT_SLOT_BYTES
    size = SIGNAL_BYTES + 2 * (max_numel + 8 * 16384) * 2 + lamport
    pool = set_pool(SymmetricPool(dist.group.WORLD, size_bytes=size))
    _log(
        f"world={world} device={torch.cuda.get_device_name()} torch={torch.__version__} "
        f"pool={pool} env="
        + ",".join(
            f"{k}={os.environ.get(k)}"
            for k in (
                "NCCL_NVLS_ENABLE",
                "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                "NVSHMEM_DISABLE_NVLS",
            )
        )
    )
    if not args.skip_checks:
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "gpu_allreduce_check",
            os.path.join(REPO, "tests", "distributed", "gpu_allreduce_check.py"),
        )
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.run_checks(iters=args.check_iters)

    try:
        torch_symm = TorchSymm(max_numel, torch.bfloat16, device)
    except (RuntimeError, AttributeError, ImportError) as e:  # baseline (b) reported as missing
        _log(f"baseline (b) unavailable: {type(e).__name__}: {e}")
        torch_symm = None

    rows = []
    for H in args.hidden:
        for T in args.tokens:
            g = torch.Generator(device=device).manual_seed(T * 31 + H + 977 * info.rank)
            x = torch.randn(T, H, device=device, generator=g).to(torch.bfloat16)
            g.manual_seed(T * 31 + H)
            residual = torch.randn(T, H, device=device, generator=g).to(torch.bfloat16)
            weight = (1 + 0.1 * torch.randn(H, device=device, generator=g)).to(torch.bfloat16)
            nbytes = T * H * 2
            methods = make_methods(x, residual, weight, torch_symm, pool)
            for name, fn in methods.items():
                if args.methods and name not in args.methods:
                    continue
                for mode in args.modes:
                    try:
                        if mode == "eager":
                            us = time_eager(fn, args.iters, device, args.graph_calls)
                        else:
                            calls = args.graph_calls if mode == "graph" else 1
                            us = time_graph(fn, args.iters, device, calls)
                    except RuntimeError as e:  # e.g. a baseline op that rejects this size
                        _log(f"  {name} {mode} T={T} H={H} failed: {e}")
                        continue
                    busbw = nbytes * 2 * (world - 1) / world / (us * 1e-6) / 1e9
                    rows.append(
                        {"tokens": T, "hidden": H, "method": name, "mode": mode, "us": us,
                         "busbw_GBps": busbw, "bytes": nbytes}
                    )  # fmt: skip
            _log(f"  done T={T} H={H} ({time.perf_counter() - t_start:.0f} s)")
            del x, residual, weight
            torch.cuda.empty_cache()

    if info.rank == 0:
        table, verdict = summarize(rows, world)
        os.makedirs(args.out, exist_ok=True)
        meta = {
            "world_size": world,
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "iters": args.iters,
            "graph_calls": args.graph_calls,
            "lamport_slot_bytes": getattr(workspace_of(pool), "lamport_slot_bytes", 0),
            "auto_picks": {str(r["bytes"]): auto_algo(r["bytes"], world, True) for r in rows},
        }
        write_json(
            os.path.join(args.out, "allreduce_rmsnorm.json"),
            {"meta": meta, "rows": rows, "verdict": verdict},
        )
        try:
            plot(rows, os.path.join(args.out, "allreduce_rmsnorm.png"), world)
        except ImportError as e:
            print(f"no plot: {e}")
        print(f"\ntotal {time.perf_counter() - t_start:.0f} s\n" + table, flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
